"""Whether a patched class keeps a packed row to its sequences, decided in one place.

:func:`support` answers for the class, once, when it is patched (``status()``'s ``packed``, whether its
module's attention functions go in, and with :func:`padded_here` whether ``apply(unpad=True)`` may run its
padded calls on their real tokens); :func:`not_kept` answers for a call: the class's answer, then the
backend table for the model's attention and mask (:func:`hfpatch.windows.packed_not_kept`). An answer is
``"yes (how)"`` or ``"no: why"`` (a declaration's ``"yes: how"`` alike), read by :func:`kept` and
:func:`why_not` alone (:mod:`hfpatch.declarations`).
"""

from __future__ import annotations

from typing import Any, Optional

from .declarations import Adapter, Family, kept, why_not
from .packed import NOT_KEPT
from .plans import Plan
from .windows import NO_4D_MASK, kept_on, packed_not_kept

__all__ = ["KEEPS_KEYS", "NO_POSITIONS", "SEQ2SEQ", "STATE_LAYERS", "not_kept", "padded_here", "support"]

STATE_LAYERS = "its layers that carry a state run each sequence alone"
KEEPS_KEYS = "its attention keeps its keys on itself (a window of its own): no mask by sequence reaches them"
NO_POSITIONS = "neither it nor its task heads take position_ids here: no packed row's positions can be passed"
SEQ2SEQ = (
    "a decoder (or encoder) of an encoder-decoder model: hfpatch keeps the packed rows of decoder-only models"
)


def _seq2seq(family: Family) -> bool:
    """A decoder or encoder of an encoder-decoder model (or one whose positions go to a module that
    takes them from no mask)."""
    return family.seq2seq or (family.hands_to is not None and not family.from_mask)


def support(adapter: Adapter, plan: Plan) -> str:
    """The class's answer: ``yes`` and the attentions that get the mask by sequence, or ``no: why``;
    the adapter's declaration where it has one."""
    family = adapter.family
    if adapter.packed is not None:
        return adapter.packed
    if _seq2seq(family):
        return f"no: {SEQ2SEQ}"
    if plan.keeps_keys:
        return f"no: {KEEPS_KEYS}"
    if plan.no_positions:
        return f"no: {NO_POSITIONS}"
    if not family.attends and plan.mixers:
        return f"yes ({STATE_LAYERS})"
    masks = plan.masks
    if masks is None or not masks.packed:
        return f"no: {NO_4D_MASK}"
    alibi = "; not with alibi=True" if masks.alibi and family.hands_to is None else ""  # (Falcon's)
    state = f"; {STATE_LAYERS}" if plan.mixers else ""
    return f"yes ({', '.join(kept_on(masks))}{alibi}{state})"


def padded_here(adapter: Adapter, plan: Plan, said: str) -> Optional[str]:
    """Why ``apply(unpad=True)`` keeps every padded call of this class padded (``said``: its
    :func:`support`), or None where it may run one on its real tokens: a decoder-only class that keeps
    packed rows (the attention and the call are checked per call, :mod:`hfpatch.unpad`)."""
    family = adapter.family
    if _seq2seq(family):
        return "an encoder-decoder model (hfpatch unpads decoder-only models)"
    if family.multimodal:
        return "a vision-language model (hfpatch unpads its language model's calls, not its own)"
    if adapter.packed is not None and kept(said):  # declared: by its language model
        return "its language model's calls only (hfpatch unpads those given token ids)"
    if not family.attends and plan.mixers:
        return None  # (its state layers keep each sequence, positions or not)
    return None if kept(said) else NOT_KEPT


def not_kept(model: Any, adapter: Adapter, plan: Plan, said: str, masked: bool) -> Optional[str]:
    """Why a packed row of ``model`` cannot be kept to its sequences in this call, or None where it can;
    "" where transformers' own packed path runs (or its language model keeps it). ``said``: the class's
    :func:`support`; ``masked``: the call has a 2-D mask."""
    if plan.keeps_keys:
        return KEEPS_KEYS
    if adapter.packed is not None:  # declared: kept by its language model (""), or why not
        return "" if kept(said) else why_not(said)
    if _seq2seq(adapter.family):
        return SEQ2SEQ
    return packed_not_kept(model, plan.masks, masked)
