"""The declarations: importing this package registers them all (rotary first, then absolute, then the
decoders and encoders of encoder-decoder models, then the model types hfpatch knows and does not patch)."""

from . import rotary, absolute, seq2seq, uncovered  # noqa: I001  (registry order = the order in status())

__all__ = ["absolute", "rotary", "seq2seq", "uncovered"]
