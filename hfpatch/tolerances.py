"""How far an output may be from its row run alone: the numbers every check reads (``verify``,
:mod:`hfpatch.testing`, the audit and the shadow). A leaf: it imports nothing of hfpatch, nor torch."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["FP32", "NOISE_CAP", "WRONG", "relative"]

FP32 = 1e-5  # the invariant: fp32 (and fp64) outputs within this of the row alone (every check's)
WRONG = 1e-3  # a difference above this is a wrong result, not float noise (between the two: noise)
# fp32 noise grows with length (right padding alone, no position changed: 1.4-1.7e-5 at 516-1,028 tokens):
# a scenario's tolerance is four times its control's noise where that is more than FP32, at most this
NOISE_CAP = 1e-4
# half precision: relative to the largest |output| of the rows alone (a wrong position changes a tiny
# model's logits by 0.3 or more; bf16 rounds a correctly shifted rotary row by about 1 % of the largest)
_HALF = {"float16": 4e-3, "bfloat16": 3e-2}


def relative(dtype: Any) -> Optional[float]:
    """The tolerance of outputs of ``dtype`` (a torch dtype) as a share of their largest |value|, for
    half precision; None for fp32 and fp64 (:data:`FP32` holds there)."""
    return _HALF.get(str(dtype).rpartition(".")[2])
