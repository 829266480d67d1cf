"""The declarations, as data: every patched class (:data:`ADAPTERS`: rotary first, then the models whose
layers carry a state besides attending, then absolute, then those that take their positions from the mask,
then the decoders and encoders of encoder-decoder models, then the vision-language wrappers) and every model
type hfpatch knows and does not patch (:data:`UNDECLARED`: decoder-only ones, then those of the
seq2seq, speech and image-text mappings). The engine registers them in this order, the order of
``status()``."""

from . import absolute, from_mask, hybrid, rotary, seq2seq, uncovered, wrappers

__all__ = ["ADAPTERS", "UNDECLARED"]

ADAPTERS = (
    *rotary.ADAPTERS,
    *hybrid.ADAPTERS,
    *absolute.ADAPTERS,
    *from_mask.ADAPTERS,
    *seq2seq.ADAPTERS,
    *wrappers.ADAPTERS,
)
UNDECLARED = (*uncovered.UNDECLARED, *wrappers.UNDECLARED)
