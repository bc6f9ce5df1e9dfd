"""Megakernel hangs inside vLLM (mk_plugin.vllm_adapter's docstring has the whole story): compute_logits
notices a recorded hang from the pinned mirror, switches the run to the Triton decode path, and
recomputes the steps the megakernel produced after it (FULL-graph replays included). A mixin of
MkDecodeMixin, which owns _mk_state, _mk_hang, _mk_py_step, _mk_last_call, _mk_graph_calls. It also hands out
the logits a megakernel step computed itself (MK_LM_HEAD=megakernel): finding the step a replay ran is the same
question."""
from __future__ import annotations

import bisect
from typing import Any

from .state import DecodeState, _DecodeCall, capturing, megakernel_of


class HangMixin:
    def _mk_after_step(self, hidden_states: Any) -> tuple[Any, Any]:
        """Called by compute_logits once per step: notice a recorded megakernel hang (no host
        synchronisation unless one is pending), switch to Triton, and return the hidden states to
        compute logits from -- recomputed with Triton when this step's came from the megakernel
        after the switch -- and the logits the megakernel computed for this step (MK_LM_HEAD=megakernel), or
        None where vLLM's LM head must compute them."""
        py_step, call = self._mk_py_step, self._mk_last_call
        self._mk_py_step, self._mk_last_call = False, None
        st = self._mk_state
        if st is None:
            return hidden_states, None
        if self._mk_hang is None:
            mk = megakernel_of(st.decoder)
            if mk is None or not mk.pending_error() or not self._mk_switch_to_triton(st):
                return hidden_states, self._mk_step_logits(st, py_step, call, hidden_states.shape[0])
        if not py_step:  # a FULL-graph replay: it ran the captured megakernel, which exited at once
            call = self._mk_graph_call(hidden_states.shape[0])
        if call is None or call.backend != "megakernel":
            return hidden_states, None  # stock or Triton produced this step
        rows = hidden_states.shape[0]
        if rows > call.out.shape[0]:
            raise RuntimeError(f"mk_plugin: cannot recompute a megakernel step of {call.out.shape[0]} rows for "
                               f"{rows} logits rows after {self._mk_hang}")
        st.decoder.decode(call.inputs, call.out)
        self._mk_counts["recomputed"] += 1
        return call.out[:rows], None

    def _mk_step_logits(self, st: DecodeState, py_step: bool, call: _DecodeCall | None, rows: int) -> Any:
        """The logits the megakernel wrote for this step's first `rows` requests, or None (vLLM's LM head computes
        them: MK_LM_HEAD=vllm, a stock or Triton step, or more rows than the step had). The step is the forward
        call that ran in Python, else the FULL graph vLLM replayed (_mk_graph_call): with FULL_AND_PIECEWISE only
        uniform decode batches replay FULL graphs, and logits rows are the requests' rows (decide.py)."""
        if st.logits_buf is None:
            return None
        if not py_step:
            call = self._mk_graph_call(rows)
        if call is None or call.logits is None or rows > call.logits.shape[0]:
            return None
        self._mk_counts["logits:megakernel"] += 1
        return call.logits[:rows]

    def _mk_graph_call(self, rows: int) -> _DecodeCall | None:
        """The decode call captured for the graph vLLM replays for `rows` requests: the smallest
        captured token count >= rows (vLLM pads a batch up to the next capture size). Called on every
        replayed step with MK_LM_HEAD=megakernel, so the sorted sizes are kept (sizes are only ever added)."""
        if len(self._mk_graph_sizes) != len(self._mk_graph_calls):
            self._mk_graph_sizes = sorted(self._mk_graph_calls)
        i = bisect.bisect_left(self._mk_graph_sizes, rows)
        return self._mk_graph_calls[self._mk_graph_sizes[i]] if i < len(self._mk_graph_sizes) else None

    def _mk_switch_to_triton(self, st: DecodeState) -> bool:
        """Read the pending hang (synchronises: rare), log it once and make the Triton decoder the
        decode path for the rest of the run. The megakernel's record is left set on purpose: the
        captured graphs keep launching it and it must keep exiting at once."""
        from ..persistent.errors import MegakernelHang
        from ..triton_ops import DecodeWorkspace, TritonDecoder

        if capturing():
            return False
        mk = megakernel_of(st.decoder)
        try:
            mk.check_errors(clear=False)
            return False  # the mirror and the record disagree: nothing to report (yet)
        except MegakernelHang as e:
            hang = e
        try:
            ws = DecodeWorkspace.allocate(st.spec, st.max_tokens, st.capacity_tokens // st.block_size, st.block_size,
                                          st.embed_buf.device)
        except ValueError as e:
            raise RuntimeError(f"mk_plugin: {hang}; the Triton decode path cannot take over ({e})") from hang
        self._mk_hang, self._mk_megakernel = hang, mk
        st.decoder = TritonDecoder(st.spec, st.weights, ws)
        self._mk_log.warn("megakernel_hang", f"{hang}. The megakernel is disabled for the rest of this run: decode "
                          "steps use the Triton path (replays of captured graphs are recomputed with it in "
                          "compute_logits). Steps computed between the hang and now returned invalid results.")
        return True
