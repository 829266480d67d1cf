"""The attention backends, one table: what each takes a call's masks as, how its windows are decided,
and how it runs a packed row's sequences (a new backend is a row; no other module names one).

A backend that takes a dense 4-D mask (eager, SDPA) runs a packed row by sequence through the patched
module's attention functions (:mod:`hfpatch.attention`): its row says whether its mask is added (a float
mask of the query's dtype) or boolean, whether it takes ``is_causal`` (a group with no window then runs
with no mask at all), and whether compiled code hands it the layout as data (a custom op runs it by
sequence, :mod:`hfpatch.compiled`). Flex takes a ``BlockMask``, flash the sequences' lengths.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

__all__ = ["BACKENDS", "EAGER", "SDPA", "Backend", "backend_of", "by_sequence_on"]

DENSE, BLOCK_MASK, LENGTHS = "a 4-D mask", "a BlockMask", "sequence lengths"  # what a backend takes
BY_MASK, OWN, BY_COLUMN = "by hfpatch's masks", "its own, over a sequence's keys", "transformers'"  # windows
SDPA, EAGER = "sdpa", "eager"  # the names of the two a packed row's groups run on where no kernel is given


class Backend(NamedTuple):
    """An attention backend as hfpatch renders a call's masks for it: ``label`` (``status()``'s word),
    what a mask by position reaches it as (``takes``: a dense 4-D mask, which a packed row's layout rides
    on where the module's attention functions run by sequence; a ``BlockMask``; the sequences' lengths),
    how its sliding windows are decided where hfpatch keeps the cache whole (``windows``), whether
    transformers' own code keeps a packed row given no mask (by the positions: ``own_packing``); for a
    dense mask, whether it is added (``additive``: 0 or the dtype's minimum; else boolean), whether the
    attention takes ``is_causal`` (``causal``), and whether compiled code hands it the layout as data
    (``as_data``)."""

    label: str
    takes: str
    windows: str
    own_packing: bool = False
    additive: bool = False
    causal: bool = False
    as_data: bool = False

    def keeps(self, plan: Any) -> bool:
        """Whether a class of this plan (a ``MaskPlan``) takes a packed row's masks on this backend: any
        4-D mask form; a ``BlockMask`` where masking_utils' functions take one (4.53+); lengths where the
        release's flash attention takes them and the forward hands its ``**kwargs`` on (4.47+)."""
        if self.takes == BLOCK_MASK:
            return plan.block_masks
        if self.takes == LENGTHS:
            return plan.flash_lengths
        return True


BACKENDS = {  # by the name of ``config._attn_implementation``
    EAGER: Backend("eager", DENSE, BY_MASK, additive=True),
    SDPA: Backend("SDPA", DENSE, BY_MASK, causal=True, as_data=True),
    "flex_attention": Backend("flex", BLOCK_MASK, BY_COLUMN),
    # flash attention (2, 3, 4, hub kernels): it unpads by the 2-D mask and applies its own window over the
    # unpadded keys (by position, every key kept); a packed row reaches it by the sequences' lengths
    "flash": Backend("flash", LENGTHS, OWN, own_packing=True),
}


def backend_of(attention: Any) -> Optional[Backend]:
    """The :class:`Backend` of an attention implementation's name (``paged|`` aside; any flash kernel,
    ``flash_attention_2`` or a hub kernel's ``kernels-community/flash-attn3``, is flash), or None for one
    hfpatch renders no mask for."""
    if not isinstance(attention, str):
        return None
    name = attention.removeprefix("paged|")
    found = BACKENDS.get(name)
    if found is None and "flash" in name:
        return BACKENDS["flash"]
    return found


def by_sequence_on(name: Any) -> Optional[Backend]:
    """The row of an attention function's name (an attention interface's key, as registered: ``paged|``
    ones are not, their functions read a paged cache) that runs a packed row's groups of sequences on a
    dense mask, or None."""
    found = BACKENDS.get(name) if isinstance(name, str) else None
    return found if found is not None and found.takes == DENSE else None
