"""The declarations: importing this package registers them all (rotary first, then absolute, then the
decoders and encoders of encoder-decoder models, then the model types hfpatch knows and does not patch:
decoder-only ones, then those of the seq2seq, speech and image-text mappings)."""

from . import rotary, absolute, seq2seq, uncovered, wrappers  # noqa: I001  (registry order = the order in status())

__all__ = ["absolute", "rotary", "seq2seq", "uncovered", "wrappers"]
