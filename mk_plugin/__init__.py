"""mk_plugin: small-batch Llama decoding at the memory-bandwidth limit, as a vLLM plugin.

Importing the package touches no GPU and imports neither vLLM nor CuPy; see README.md.
"""
from .spec import LlamaSpec, UnsupportedModel

__all__ = ["LlamaSpec", "UnsupportedModel"]
__version__ = "0.1.0"
