"""Measured winners of the megakernel's task split (tuning.ScheduleTuning) and where they live.

Winners are stored per GPU model like the Triton linear's (triton_ops/linear.py): a packaged table
`tuned/megakernel_<gpu>.json` (committed from the GPU host) and a user cache
(`~/.cache/mk_plugin/`, or the file MK_TUNING names); a winner is used only when it beat the base
the search started from by more than TUNED_MIN_GAIN (replay noise), and a batch size without one runs that
base: on a GPU the ring-fed attention (UNTUNED_TUNING) since session 27, because a search at one short context
cannot see the ring's long-context gain; before, the plain default.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..spec import LlamaSpec
from ..triton_ops._device import gpu_slug
from .encoding import spec_hash
from .tuning import DEFAULT_TUNING, UNTUNED_TUNING, ScheduleTuning

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
TUNED_MIN_GAIN = 0.02   # a winner replaces the default only when > 2% faster (graph replay noise ~0.5%)
FORMAT = 1


def tuned_file(device_name: str) -> Path:
    """The packaged table of one GPU model (written by bench/autotune.py --write-tuned)."""
    return TUNED_DIR / f"megakernel_{gpu_slug(device_name)}.json"


def user_cache_file(device_name: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mk_plugin" / f"megakernel_{gpu_slug(device_name)}.json"


@dataclass(frozen=True, order=True)
class TuningKey:
    """What a measured winner is valid for. The kernel source is recorded in the entry but not
    keyed on: any tuning is correct for any source; an old winner is at worst a slower choice."""
    spec_hash: int
    batch: int
    num_sms: int
    lm_head: bool
    fallback: tuple[str, ...] = ()

    @classmethod
    def of(cls, spec_hash: int, batch: int, num_sms: int, lm_head: bool, fallback: Iterable[str] = ()) -> TuningKey:
        return cls(int(spec_hash), int(batch), int(num_sms), bool(lm_head), tuple(sorted(fallback)))


@dataclass
class TuningEntry:
    """One measured key: the search's best tuning and its time against the base it started from (default_us: the
    base's time; meta "base": that tuning's JSON, written since session 27; older tables searched from the plain
    default). A best equal to the base means nothing beat it by TUNED_MIN_GAIN."""
    key: TuningKey
    tuning: ScheduleTuning
    best_us: float
    default_us: float
    meta: dict = field(default_factory=dict)   # spec name, date, commit, source hash, command, base

    @property
    def gain(self) -> float:
        return self.default_us / self.best_us - 1.0 if self.best_us > 0 else 0.0

    @property
    def base(self) -> ScheduleTuning:
        """The tuning the search started from, which a batch size without a winner runs."""
        b = self.meta.get("base")
        return DEFAULT_TUNING if b is None else ScheduleTuning.from_json(b)

    def to_json(self) -> dict:
        return {"key": asdict(self.key) | {"fallback": list(self.key.fallback)}, "tuning": self.tuning.to_json(),
                "best_us": round(self.best_us, 2), "default_us": round(self.default_us, 2), "meta": self.meta}

    @classmethod
    def from_json(cls, d: Mapping) -> TuningEntry:
        k = dict(d["key"])
        return cls(TuningKey.of(k["spec_hash"], k["batch"], k["num_sms"], k["lm_head"], k.get("fallback", ())),
                   ScheduleTuning.from_json(d["tuning"]), float(d["best_us"]), float(d["default_us"]),
                   dict(d.get("meta", {})))


class TuningTable:
    """Winners of one GPU model, keyed by TuningKey; a JSON file on disk."""

    def __init__(self, gpu: str, entries: Iterable[TuningEntry] = ()):
        self.gpu = gpu
        self.entries: dict[TuningKey, TuningEntry] = {e.key: e for e in entries}

    @classmethod
    def load(cls, path: Path, gpu: str) -> TuningTable:
        """The table in `path` (empty if the file does not exist). A malformed file is an error that
        names it: a silently ignored table would silently drop measured winners."""
        if not path.exists():
            return cls(gpu)
        try:
            d = json.loads(path.read_text())
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
            return cls(str(d.get("gpu", gpu)), [TuningEntry.from_json(e) for e in d["entries"]])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"megakernel tuning table {path} is malformed ({e}); delete it or re-run "
                             "bench/autotune.py") from None

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": FORMAT, "gpu": self.gpu,
                "entries": [e.to_json() for e in sorted(self.entries.values(), key=lambda e: e.key)]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        tmp.replace(path)   # atomic: a concurrent reader sees the old or the new table
        return path

    def put(self, entry: TuningEntry) -> None:
        self.entries[entry.key] = entry

    def runs(self, key: TuningKey) -> ScheduleTuning | None:
        """The tuning the decoder builds for `key` from this table alone: its winner (or the nearest batch size's),
        else the measured base; None where the table knows nothing of the model."""
        e = self.nearest(key)
        return e.tuning if e is not None else self.base_for(key)

    def merge_from_entry(self, entry: TuningEntry, update: Mapping) -> str:
        """Put the result of a search that started from what this table runs for entry.key (bench/autotune.py
        --start table) without losing the record of what it measured before, and say what was done:
        - the search moved nothing: the entry stays as it was (its measurement, provenance and updates);
        - the key has no entry and the search found what the nearest batch size's entry already gives it: nothing
          is added (the decoder would run the same program; session 54's 1B b12 on the H100);
        - the key's entry moved: its tuning and best_us change, its base and meta stay, and `update`
          (date, commit, gpu, change, source) is appended to meta["updates"] (session 53's manual record, now
          written by the tool);
        - else (a key the table never measured, a new tuning): the entry as measured."""
        old, runs = self.entries.get(entry.key), self.runs(entry.key)
        if runs == entry.tuning:
            return "unchanged" if old is not None else "not added: the nearest entry gives it"
        if old is None:
            self.put(entry)
            return "new entry"
        meta = old.meta | {"updates": [*old.meta.get("updates", []), dict(update)]}
        # default_us stays the base's time; where the old entry was its base (the search's start), today's time of
        # it is the base's, and the larger of the two keeps the move's measured gain visible to winner()
        self.put(TuningEntry(entry.key, entry.tuning, entry.best_us, max(old.default_us, entry.default_us), meta))
        return f"updated: {runs.label() if runs is not None else '-'} -> {entry.tuning.label()}"

    def _same_model(self, key: TuningKey) -> list[TuningKey]:
        """The measured keys of key's model, SM count, lm_head and fallback (any batch size)."""
        return [k for k in self.entries if (k.spec_hash, k.num_sms, k.lm_head, k.fallback)
                == (key.spec_hash, key.num_sms, key.lm_head, key.fallback)]

    def _nearest_key(self, key: TuningKey) -> TuningKey | None:
        """key if measured, else the nearest measured batch size of its model (ties: the larger), None if none."""
        if key in self.entries:
            return key
        same = self._same_model(key)
        return min(same, key=lambda k: (abs(k.batch - key.batch), -k.batch)) if same else None

    def base_for(self, key: TuningKey) -> ScheduleTuning | None:
        """The base key's model was measured against (its nearest measured batch size's): what a batch size without
        a winner runs; None if no batch size of the model, SM count, lm_head and fallback was measured."""
        k = self._nearest_key(key)
        return None if k is None else self.entries[k].base

    def winner(self, key: TuningKey) -> TuningEntry | None:
        """The entry for `key` if its tuning beat its base by more than TUNED_MIN_GAIN."""
        e = self.entries.get(key)
        if e is None or e.tuning == e.base or e.gain <= TUNED_MIN_GAIN:
            return None
        return e

    def other_batch_winners(self, key: TuningKey) -> list[TuningEntry]:
        """The winners of key's model, SM count, lm_head and fallback at the other batch sizes, in batch order (the
        autotuner's seeds: autotune.seed_tunings)."""
        keys = sorted((k for k in self._same_model(key) if k.batch != key.batch), key=lambda k: k.batch)
        return [e for e in map(self.winner, keys) if e is not None]

    def nearest(self, key: TuningKey) -> TuningEntry | None:
        """The winner for `key` if its batch size was measured (None: the default won there), else what
        the nearest measured batch size of the same model, SM count, lm_head and fallback found (ties: the
        larger batch): its winner's split, K-split and ring depth with the default attention chunks (chunks
        are chosen per batch: they scale with B * kv heads), or None where the default won. A measured
        "default wins" stops the lookup: session 13's K-split wins at batch 16 and loses at batch 1 and 8
        (8B), so the batch-16 winner must not reach the batch sizes measured without it."""
        if key in self.entries:
            return self.winner(key)
        k = self._nearest_key(key)
        e = None if k is None else self.winner(k)
        if e is None:
            return None
        t = e.tuning.with_chunks(0)
        if t == e.base:
            return None
        return TuningEntry(key, t, e.best_us, e.default_us, e.meta | {"from_batch": k.batch})


def resolve(setting: str, device_name: str, keys: Iterable[TuningKey]) -> list[tuple[ScheduleTuning, str]]:
    """For each key, the tuning to build a program with and where it came from (for status lines);
    each table file is read once.

    setting: MK_TUNING -- "off" (defaults), "auto" (the user cache, then the packaged table), or a
    path to a table file (only that file). A key without a winner in any table runs the base its model was
    measured against (the first table that measured the model); one whose model no table has measured on this
    GPU gets UNTUNED_TUNING (on a CUDA device; "cpu" keeps the defaults). A key with the LM head whose model no
    table measured with it takes its layers' entry (the same key without the LM head): the lm_head tasks then run
    at the default split (tables are measured as bench/mk_step.py times the step, without the LM head)."""
    keys = list(keys)
    if setting == "off":
        return [(DEFAULT_TUNING, "default (MK_TUNING=off)")] * len(keys)
    paths = [user_cache_file(device_name), tuned_file(device_name)] if setting == "auto" else [Path(setting)]
    tables = [(p, TuningTable.load(p, device_name)) for p in paths]
    out = []
    for key in keys:
        layers = key.lm_head and all(tab.base_for(key) is None for _, tab in tables)
        t, why = _resolve_one(tables, replace(key, lm_head=False) if layers else key, device_name)
        if layers:
            why += "; the layers' entry (measured without the LM head; lm_head tasks at the default split)"
        out.append((t, why))
    return out


def _resolve_one(tables: list[tuple[Path, TuningTable]], key: TuningKey, device_name: str
                 ) -> tuple[ScheduleTuning, str]:
    """resolve() for one key: the first table's winner, else the measured base, else the untuned default."""
    found = next(((p, e) for p, tab in tables if (e := tab.nearest(key)) is not None), None)
    if found is None:
        base = next((b for _, tab in tables if (b := tab.base_for(key)) is not None), None)
        if base is not None and not base.is_default:
            return base, f"{base.label()}: the measured base (no measured winner)"
        if base is not None or device_name == "cpu":
            return DEFAULT_TUNING, "default (no measured winner)"
        # a model never measured on this GPU
        return UNTUNED_TUNING, f"{UNTUNED_TUNING.label()}: the default for a model not in the tables (the ring-fed attention)"
    p, e = found
    at = f"batch {e.meta['from_batch']}'s " if "from_batch" in e.meta else ""
    return e.tuning, f"{e.tuning.label()}: {at}winner in {p} ({e.best_us:.1f} vs {e.default_us:.1f} us default)"


def spec_tuning_key(spec: LlamaSpec, batch: int, num_sms: int, lm_head: bool,
                    fallback: Iterable[str] = ()) -> TuningKey:
    return TuningKey.of(spec_hash(spec), batch, num_sms, lm_head, fallback)
