"""MK_* switches: parsed in mk_plugin/config.py only; bad values raise ConfigError naming them."""
from __future__ import annotations

import pytest

from mk_plugin.config import DEFAULT_MODE, MODES, ConfigError, MkConfig, get_config
from mk_plugin.ops import STEP_OPS


def cfg(**env: str) -> MkConfig:
    return MkConfig.from_env(env)


def test_defaults():
    c = cfg()
    assert (c.mode, c.fallback, c.trace, c.verbose) == (DEFAULT_MODE, frozenset(), False, False)
    assert c.dump_logits is None and c.force_tokens is None
    assert cfg(MK_MODE="").mode == DEFAULT_MODE and cfg(MK_MODE="  ").mode == DEFAULT_MODE


@pytest.mark.parametrize("mode", MODES)
def test_modes(mode):
    assert cfg(MK_MODE=mode).mode == mode
    assert cfg(MK_MODE=f" {mode.upper()} ").mode == mode  # case and spaces are forgiven


@pytest.mark.parametrize("bad", ["fast", "mega", "triton,stock", "1"])
def test_bad_mode_names_value_and_choices(bad):
    with pytest.raises(ConfigError, match="MK_MODE") as e:
        cfg(MK_MODE=bad)
    assert all(m in str(e.value) for m in MODES)
    assert isinstance(e.value, ValueError)


def test_fallback_list():
    assert cfg(MK_FALLBACK="attention, lm_head,,").fallback == {"attention", "lm_head"}
    assert cfg(MK_FALLBACK=",".join(STEP_OPS)).fallback == set(STEP_OPS)
    with pytest.raises(ConfigError, match=r"MK_FALLBACK names unknown op\(s\) \['matmul'\]"):
        cfg(MK_FALLBACK="attention,matmul")


@pytest.mark.parametrize("name", ["MK_TRACE", "MK_VERBOSE"])
def test_flags(name):
    field = name[3:].lower()
    for v in ("1", "true", "YES", "on"):
        assert getattr(cfg(**{name: v}), field) is True
    for v in ("0", "", "false", "No", "off"):
        assert getattr(cfg(**{name: v}), field) is False
    with pytest.raises(ConfigError, match=f"{name}='2' is not a boolean"):
        cfg(**{name: "2"})


def test_debug_switches(tmp_path):
    f = tmp_path / "force.json"
    f.write_text("[1, 2, 3]")
    c = cfg(MK_DUMP_LOGITS=str(tmp_path / "dumps"), MK_FORCE_TOKENS=str(f))
    assert c.dump_logits == str(tmp_path / "dumps") and c.force_tokens == str(f)
    with pytest.raises(ConfigError, match="MK_FORCE_TOKENS"):
        cfg(MK_FORCE_TOKENS=str(tmp_path / "missing.json"))


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError):
        MkConfig(mode="nope")
    with pytest.raises(ConfigError):
        MkConfig(fallback=frozenset({"nope"}))


def test_get_config_reads_the_process_env(monkeypatch):
    monkeypatch.setenv("MK_MODE", "stock")
    monkeypatch.setenv("MK_VERBOSE", "1")
    c = get_config()
    assert c.mode == "stock" and c.verbose
    monkeypatch.setenv("MK_MODE", "megakernel")
    assert get_config().mode == "megakernel"  # not cached: subprocesses and tests see their env
    monkeypatch.setenv("MK_MODE", "bogus")
    with pytest.raises(ConfigError):
        get_config()


def test_rounding_switch():
    from mk_plugin.config import ROUNDINGS
    from mk_plugin.persistent.encoding import Rounding

    assert ROUNDINGS == tuple(r.name.lower() for r in Rounding)  # config cannot import torch: checked here
    assert cfg().rounding == "fused" and cfg(MK_ROUNDING=" Stock ").rounding == "stock"
    with pytest.raises(ConfigError, match=r"MK_ROUNDING='exact'.*fused, stock"):
        cfg(MK_ROUNDING="exact")
