"""Debug hooks of the adapter, MK_DUMP_LOGITS (save every step's logits with its requests' lengths) and
MK_FORCE_TOKENS (teacher forcing: the next token of each request from a file). Eager only: they read
seq_lens on the host. A mixin of MkDecodeMixin."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .decide import _forward_context_metadata
from .state import DecodeState, capturing


class DebugHooksMixin:
    def _mk_record_seq_lens(self, raw: Any = None, st: DecodeState | None = None) -> None:
        self._mk_dbg_seq_lens = None
        if raw is None:
            raw, _ = _forward_context_metadata()
        if raw is None or isinstance(raw, list):
            return
        if capturing():
            return  # .tolist() would sync the host inside a capture
        name = st.layer_name if st is not None else self.model.layers[0].self_attn.attn.layer_name
        md = raw.get(name) if isinstance(raw, Mapping) else raw
        if md is not None and hasattr(md, "seq_lens"):
            self._mk_dbg_seq_lens = [int(x) for x in md.seq_lens.tolist()]

    def _mk_debug_logits(self, logits: Any) -> Any:
        import torch

        lens, self._mk_dbg_seq_lens = self._mk_dbg_seq_lens, None
        if lens is None:
            return logits
        if len(lens) != logits.shape[0]:
            self._mk_log.warn("debug_rows", f"MK_DUMP_LOGITS/MK_FORCE_TOKENS: {logits.shape[0]} logit rows for "
                              f"{len(lens)} requests (spec decode or chunked prefill?); step skipped")
            return logits
        if self._mk_cfg.dump_logits:
            os.makedirs(self._mk_cfg.dump_logits, exist_ok=True)
            path = os.path.join(self._mk_cfg.dump_logits, f"logits_{os.getpid()}_{self._mk_dbg_calls:06d}.pt")
            torch.save({"seq_lens": lens, "logits": logits.float().cpu(), "mode": self._mk_cfg.mode}, path)
            self._mk_dbg_calls += 1
        if self._mk_cfg.force_tokens:
            if self._mk_force is None:
                with open(self._mk_cfg.force_tokens) as f:
                    self._mk_force = [int(t) for t in json.load(f)]
            for r, n in enumerate(lens):
                if 0 < n < len(self._mk_force):
                    logits[r].fill_(float("-inf"))
                    logits[r, self._mk_force[n]] = 0.0
        return logits
