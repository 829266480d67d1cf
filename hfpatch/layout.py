"""A call's packed rows as one value, from where they are found to the kernels: :class:`Layout`.

:func:`hfpatch.packed.packed_rows` finds it (the call's one host read), or an unpadded call makes it
(:mod:`hfpatch.unpad`: each padded row a sequence, and :class:`Padded`, where its real tokens were);
:func:`grouped` adds its sequences grouped by length once a call (:class:`Group`: every index a layer
uses, made on the host and copied to the device without waiting); each layer type's mask carries it
(:class:`hfpatch.attention.ByLayout`), and the attention functions run each group alone.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["Group", "Layout", "Padded", "grouped"]


class Group(NamedTuple):
    """Sequences of similar length, batched: ``index`` ``[sequences, longest]`` (flat token numbers over
    ``batch x length``; a short sequence padded with its own first token, which comes after its real ones
    and so is never attended causally), ``valid`` (its real entries), and, for putting the outputs back
    without a boolean index (a device sync), ``into`` (the row's flat token numbers of the real entries)
    and ``taken`` (theirs in the group's flattened ``[sequences * longest]``)."""

    index: Tensor
    valid: Tensor
    into: Tensor
    taken: Tensor


class Padded(NamedTuple):
    """Where an unpadded call's real tokens were in its padded batch: ``index`` ``[real tokens]``, their
    flat numbers over ``batch x length``, row by row."""

    index: Tensor
    batch: int
    length: int

    def gather(self, tensor: Tensor) -> Tensor:
        """``[batch, length, ...]`` -> ``[1, real tokens, ...]``."""
        return tensor.reshape(self.batch * self.length, *tensor.shape[2:]).index_select(0, self.index)[None]

    def scatter(self, tensor: Tensor) -> Tensor:
        """``[1, real tokens, ...]`` -> ``[batch, length, ...]``, zeros at the pads."""
        flat = tensor[0, : len(self.index)]
        out = flat.new_zeros(self.batch * self.length, *flat.shape[1:])
        out.index_copy_(0, self.index, flat)  # (in place: autograd follows it; one padded output, not two)
        return out.view(self.batch, self.length, *flat.shape[1:])


class Layout(NamedTuple):
    """A call's packed rows: ``mask`` ``[batch, length]`` (the 2-D mask, the device's), ``positions``
    ``[batch or 1, length]`` (a multimodal form's text or ``t`` row), ``segment_ids`` ``[batch or 1,
    length]`` (each token's sequence in its row, :func:`hfpatch.positions.segments`); ``host``: the real
    tokens and the segments as the host read them (eager mode; None in compiled code); ``padded``: an
    unpadded call's :class:`Padded` (its sequences are that batch's rows); ``parts`` and
    ``flat_positions`` (each token's position, ``[batch * length]``): its :class:`Group` s, made once a
    call by :func:`grouped` (empty until then)."""

    mask: Tensor
    positions: Tensor
    segment_ids: Tensor
    host: Optional[tuple[Tensor, Tensor]] = None
    padded: Optional[Padded] = None
    parts: tuple[Group, ...] = ()
    flat_positions: Optional[Tensor] = None

    @property
    def shape(self) -> tuple[int, int]:
        """(batch, length) of its rows."""
        return self.mask.shape[0], self.mask.shape[1]


def grouped(layout: Layout) -> Layout:
    """``layout`` with its real tokens grouped by sequence, in groups of sequences of similar length,
    computed on the host from what it read (``layout.host``; where there is none, from the device: eager
    code only). Every index a layer uses is made here, once a call, and copied to the device without
    waiting: no layer reads the device."""
    mask = layout.mask
    batch, length = mask.shape
    real, segment_ids = layout.host if layout.host is not None else (mask != 0, layout.segment_ids)
    flat = real.reshape(-1).nonzero().squeeze(1)  # the real tokens, in order
    rows = torch.arange(batch, device=flat.device)[:, None] * (length + 1)
    sequence = (segment_ids.expand(batch, length) + rows).reshape(-1)[flat]  # nondecreasing
    counts = torch.unique_consecutive(sequence, return_counts=True)[1]
    starts = counts.cumsum(0) - counts
    sizes = counts.tolist()
    by_size: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):  # groups of sizes within a factor of 2: little work on padding
        by_size.setdefault(1 << (size - 1).bit_length(), []).append(i)
    groups = []
    offsets = torch.arange(max(sizes), device=flat.device)
    for members in by_size.values():
        chosen = torch.tensor(members, device=flat.device)
        own, first = counts[chosen], starts[chosen]
        longest = max(sizes[i] for i in members)
        valid = offsets[None, :longest] < own[:, None]
        # a short sequence padded with its own first token (after its real ones: never attended causally)
        index = flat[first[:, None] + torch.where(valid, offsets[None, :longest], 0)]
        # where each real entry comes from in the group's flattened batch, and where it goes in the row
        total = sum(sizes[i] for i in members)
        taken = torch.arange(total, device=flat.device) + torch.repeat_interleave(
            torch.arange(len(members), device=flat.device) * longest - own.cumsum(0) + own, own,
            output_size=total,
        )  # fmt: skip
        into = index.reshape(-1)[taken]
        groups.append(Group(*(t.to(mask.device, non_blocking=True) for t in (index, valid, into, taken))))
    flat_positions = layout.positions.expand(batch, length).reshape(-1)
    return layout._replace(parts=tuple(groups), flat_positions=flat_positions)
