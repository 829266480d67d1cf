"""How far an output may be from its row run alone: the numbers every check reads (``verify``,
:mod:`hfpatch.testing`, the audit and the shadow). A leaf: it imports nothing of hfpatch, nor torch.

One tolerance per precision, the reference always each sequence alone in the same regime:

- fp32 and fp64 weights, no autocast: :data:`FP32` (max |difference| at any real token);
- fp16 or bf16 weights, or ``torch.autocast`` to fp16 or bf16 over any weights: a share of the largest
  |output| of the rows alone (at least 1), the regime's dtype deciding (under autocast, autocast's):
  ``float16`` 4e-3, ``bfloat16`` 3e-2 (:func:`bound`).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["FP32", "NOISE_CAP", "WRONG", "bound", "regime", "relative"]

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


def regime(outputs: Any, weights: Any = None, autocast: Any = None) -> Any:
    """The dtype whose tolerance a check uses: autocast's where a call runs under it, else the weights'
    where they are in half precision (4.x returns fp32 logits from half weights), else the outputs'."""
    if autocast is not None:
        return autocast
    if relative(weights) is not None and relative(outputs) is None:
        return weights
    return outputs


def bound(dtype: Any, scale: float = 1.0) -> float:
    """The tolerance of a regime of ``dtype`` (:func:`regime`): :data:`FP32`, or in fp16 and bf16 a share
    of ``scale`` (the largest |output| of the rows alone, at least 1)."""
    half = relative(dtype)
    return half * max(1.0, scale) if half is not None else FP32
