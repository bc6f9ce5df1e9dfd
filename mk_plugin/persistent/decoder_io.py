"""MegakernelDecoder's checks of what it is given and the device tables it builds from it: the weights (shapes,
dtypes, alignment for the bulk copies) and their address table with MK_W_TMA's tensor maps, the KV caches'
address table with MK_ATT_TMA's tensor maps, and the step's inputs. A mixin of backend.MegakernelDecoder, whose
attributes (spec, weights, device, executor, lm_head, the maps and keys) it reads and sets."""
from __future__ import annotations

import torch

from ..triton_ops._checks import check_shape, check_tensor, check_tokens
from .encoding import LP_COUNT, LayerPtr, ModelPtr


class DecoderIOMixin:
    def _check_weights(self) -> None:
        s, dt, dev = self.spec, self.spec.torch_dtype, self.device
        w = self.weights
        if len(w.layers) != s.num_layers:
            raise ValueError(f"weights have {len(w.layers)} layers, spec.num_layers={s.num_layers}")

        def chk(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
            check_tensor(name, t, dtypes=(dt,), device=dev)
            check_shape(name, t, shape)
            if self.executor == "cuda" and t.data_ptr() % 16:
                raise ValueError(f"{name} is not 16-byte aligned (bulk copies need it)")

        h, i = s.hidden_size, s.intermediate_size
        for li, lw in enumerate(w.layers):
            chk(f"layers[{li}].qkv", lw.qkv, (s.qkv_size, h))
            chk(f"layers[{li}].o", lw.o, (h, s.q_size))
            chk(f"layers[{li}].gate_up", lw.gate_up, (2 * i, h))
            chk(f"layers[{li}].down", lw.down, (h, i))
            chk(f"layers[{li}].input_norm", lw.input_norm, (h,))
            chk(f"layers[{li}].post_norm", lw.post_norm, (h,))
        chk("final_norm", w.final_norm, (h,))
        if self.lm_head:
            chk("lm_head", w.lm_head, (s.vocab_size, h))
        if self._wants_w_tma():   # MK_W_TMA's column groups: the error names what the model lacks, on any executor
            from .tensormap import check_weights_model
            check_weights_model(s)

    def _weight_table(self) -> torch.Tensor:
        """[(L + 1) * LP_COUNT] int64 device addresses (encoding.LayerPtr / ModelPtr slots)."""
        rows = []
        for lw in self.weights.layers:
            row = [0] * LP_COUNT
            row[LayerPtr.QKV] = lw.qkv.data_ptr()
            row[LayerPtr.O] = lw.o.data_ptr()
            row[LayerPtr.GATE_UP] = lw.gate_up.data_ptr()
            row[LayerPtr.DOWN] = lw.down.data_ptr()
            row[LayerPtr.IN_NORM] = lw.input_norm.data_ptr()
            row[LayerPtr.POST_NORM] = lw.post_norm.data_ptr()
            rows += row
        last = [0] * LP_COUNT
        last[ModelPtr.FINAL_NORM] = self.weights.final_norm.data_ptr()
        last[ModelPtr.LM_HEAD] = self.weights.lm_head.data_ptr() if self.lm_head else 0
        rows += last
        table = torch.tensor(rows, dtype=torch.int64).to(self.device)
        if self._wants_w_tma():
            self._ensure_weight_maps(table)
        return table

    def _ensure_weight_maps(self, table: torch.Tensor) -> None:
        """MK_W_TMA's weight tensor maps, built once and kept alive here, their address in `table`'s WEIGHT_MAPS
        slot (written in place: programs captured before read the slot only if their variant copies by maps)."""
        if self._wmaps is not None:
            return
        from .tensormap import check_weights_model, weight_maps
        check_weights_model(self.spec)
        self._wmaps = weight_maps(self.spec, self.weights.layers, self.weights.lm_head if self.lm_head else None,
                                  self.device)
        table[self.spec.num_layers * LP_COUNT + ModelPtr.WEIGHT_MAPS] = self._wmaps.data_ptr()

    def _kv_table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The kernel's kvptr table: the layer caches' addresses, and for an MK_ATT_TMA build the addresses of
        their tensor maps after them (kvptr[LAYERS + l]; tensormap.py), rebuilt when a cache changes."""
        att_tma = self._needs_maps
        key = tuple((c.data_ptr(), c.shape[0]) if att_tma else c.data_ptr() for c in kv_caches)
        if key != self._kv_key:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the kv cache tensors changed during CUDA-graph capture; run one "
                                   "eager step with the final kv caches before capturing")
            ptrs = [c.data_ptr() for c in kv_caches]
            if att_tma:
                from .tensormap import MAP_BYTES, device_maps
                try:   # ValueError: caches the maps cannot describe (tensormap.kv_tile_map_args)
                    # kept alive here: kvptr points into it
                    self._kvmaps = device_maps(kv_caches, self.device)
                except ValueError as e:
                    self._att_tma_off(str(e))
                    key = tuple(c.data_ptr() for c in kv_caches)
                else:
                    ptrs += [self._kvmaps.data_ptr() + MAP_BYTES * i for i in range(len(kv_caches))]
            self._kvptr = torch.tensor(ptrs, dtype=torch.int64).to(self.device)
            self._kv_key = key
        assert self._kvptr is not None
        return self._kvptr

    def _check_inputs(self, hidden, positions, kv_caches, block_table, seq_lens, slot_mapping, cos_sin_cache,
                      out, logits_out) -> None:
        s, dt, dev = self.spec, self.spec.torch_dtype, self.device
        check_tensor("hidden", hidden, ndim=2, dtypes=(dt,), device=dev)
        b = hidden.shape[0]
        check_tokens("hidden", b)
        check_shape("hidden", hidden, (b, s.hidden_size))
        check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,), device=dev)
        check_shape("positions", positions, (b,))
        check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), device=dev)
        check_shape("slot_mapping", slot_mapping, (b,))
        check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
        check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev, contiguous=False)
        if block_table.stride(1) != 1:
            raise ValueError(f"block_table rows must be contiguous, got stride {block_table.stride()}")
        if block_table.shape[0] < b or seq_lens.shape[0] < b:
            raise ValueError(f"batch B={b} exceeds block_table rows {block_table.shape[0]} / "
                             f"seq_lens entries {seq_lens.shape[0]}")
        check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32, dt), device=dev,
                     contiguous=False)
        if cos_sin_cache.shape[1] != s.head_dim or cos_sin_cache.stride(1) != 1:
            raise ValueError(f"cos_sin_cache must be [max_pos, {s.head_dim}] with contiguous rows, got "
                             f"shape {tuple(cos_sin_cache.shape)} stride {cos_sin_cache.stride()}")
        if len(kv_caches) != s.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv caches for {s.num_layers} layers")
        bs = None
        for i, c in enumerate(kv_caches):
            check_tensor(f"kv_caches[{i}]", c, ndim=5, dtypes=(dt,), device=dev)
            if c.shape[1] != 2 or c.shape[3] != s.num_kv_heads or c.shape[4] != s.head_dim:
                raise ValueError(f"kv_caches[{i}] has shape {tuple(c.shape)}, expected "
                                 f"[num_blocks, 2, block_size, {s.num_kv_heads}, {s.head_dim}]")
            if bs is not None and c.shape[2] != bs:
                raise ValueError(f"kv_caches[{i}] block size {c.shape[2]} != {bs} of layer 0")
            bs = c.shape[2]
            if self.executor == "cuda" and c.data_ptr() % 16:
                raise ValueError(f"kv_caches[{i}] is not 16-byte aligned")
        if out is not None:
            check_tensor("out", out, ndim=2, dtypes=(dt,), device=dev)
            check_shape("out", out, (b, s.hidden_size))
        if logits_out is not None:
            if not self.lm_head:
                raise ValueError("logits_out given but this decoder was built with lm_head=False")
            check_tensor("logits_out", logits_out, ndim=2, dtypes=(torch.float32,), device=dev)
            check_shape("logits_out", logits_out, (b, s.vocab_size))
