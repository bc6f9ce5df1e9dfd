"""The vLLM adapter's parts (mk_plugin.vllm_adapter is the public module and entry point):
decide (which path a step takes), state (the decode state built from vLLM's model), hangs (megakernel
hang handling), debug (MK_DUMP_LOGITS / MK_FORCE_TOKENS)."""
