"""One small declaration per architecture; importing this package registers them all."""

from . import gpt2, llama, gemma  # noqa: I001  (registry order = the order in the docs)

__all__ = ["gpt2", "llama", "gemma"]
