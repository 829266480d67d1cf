"""Rows that pack several sequences: positions that restart inside a row (``DataCollatorWithFlattening``,
TRL's ``padding_free``, verl's remove-padding) mark where each sequence starts. Stock transformers lets
every sequence of such a row attend to the ones before it, unless the call has neither a mask nor a
cache (``use_cache=False``, 5.x); a patched forward keeps each one to itself:

1. :func:`packed_rows` finds them: the caller's ``position_ids`` restart at a real token (pads never
   split a row), and nothing is cached before the call (:func:`hfpatch.positions.segments`, the rule
   transformers uses);
2. :func:`hfpatch.windows.apply_masks` hands the model a mask by sequence (the windows' one rule: real,
   causal, in the query's sequence, within the window by position), in the form its mask code takes;
3. with SDPA (eager mode), that mask carries the sequences' layout (:class:`Groups`), and the SDPA
   function of transformers' attention registry (installed while hfpatch is, :func:`by_sequence_sdpa`)
   runs each sequence on its own (causal, grouped by length) instead of the whole row under the mask:
   ``sum(length ** 2)`` of work instead of ``row ** 2``. Where the layout does not reach it (a model
   that rebuilds the mask, compiled code, reentrant checkpointing's recomputation), the mask itself is
   applied: the same result.

A call that gives its sequences by their lengths (``cu_seq_lens_q``, ``seq_idx``) and no positions gets
positions counting from 0 in each (:func:`positions_from_lengths`). Where a packed row cannot be kept to
its sequences (a recurrent model, a release whose mask code takes no 4-D mask, an attention that reads
no mask), the call runs as stock does and :func:`warn_not_kept` says so, once per model type.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from . import caches
from .positions import positions_in_segments, restarts, segments, segments_from_lengths

__all__ = [
    "Groups",
    "by_sequence_sdpa",
    "groups",
    "packed_rows",
    "positions_from_lengths",
    "warn_not_kept",
]

GROUPS = "_hfpatch_groups"  # on a mask by sequence handed to SDPA: its Groups


def packed_rows(kwargs: dict, tokens: Optional[Tensor]) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """(the 2-D mask, the positions, :func:`hfpatch.positions.segments`) of a call whose caller's
    ``position_ids`` restart inside a row, with nothing cached before it; None for any other call.
    Shapes first (a decode step has one new token: never packed); in eager mode the positions are then
    read once, compiled code always gets the masks by sequence (the causal ones where nothing restarts:
    no branch on tensor values)."""
    positions = kwargs["position_ids"]
    if tokens is None or positions.__class__ is not Tensor or positions.dim() != 2:
        return None
    batch, num_new = tokens.shape[0], tokens.shape[1]
    if num_new < 2 or positions.shape[1] != num_new or positions.shape[0] not in (1, batch):
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and (
        mask.__class__ is not Tensor or mask.dim() != 2 or tuple(mask.shape) != (batch, num_new)
    ):
        return None  # a 4-D mask (the caller's), a mask past a cached prefix, a BlockMask
    cache = next(
        (kwargs[name] for name in ("cache", "past_key_values") if kwargs.get(name) is not None), None
    )
    if cache is not None and (caches.capacity(cache) is not None or caches.past_length(cache)):
        return None  # continues a cache
    if not torch.compiler.is_compiling() and not restarts(positions, mask):
        return None
    segment_ids = segments(positions, mask)
    if mask is None:
        mask = torch.ones(batch, num_new, dtype=torch.bool, device=tokens.device)
    return mask, positions, segment_ids


def positions_from_lengths(kwargs: dict, tokens: Optional[Tensor]) -> None:
    """A packed row whose sequences the caller gives by their lengths (``cu_seq_lens_q``, as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` returns them, or ``seq_idx``) and no
    ``position_ids``: each sequence's positions count from 0 (stock counts over the whole row)."""
    if kwargs.get("position_ids") is not None or tokens is None:
        return
    lengths, seq_idx = kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx")
    if isinstance(seq_idx, Tensor) and tuple(seq_idx.shape) == tuple(tokens.shape[:2]):
        kwargs["position_ids"] = positions_in_segments(seq_idx.long())
    elif isinstance(lengths, Tensor) and lengths.dim() == 1:
        kwargs["position_ids"] = positions_in_segments(segments_from_lengths(lengths, *tokens.shape[:2]))


def warn_not_kept(arch: str, why: str) -> None:
    """Once per model type and reason: a packed row left as stock runs it."""
    key = (arch, why)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"hfpatch: a packed row of {arch} (position_ids that restart) is not kept to its sequences: {why}; "
        "each sequence attends to the ones before it, as on stock (hfpatch.status() says where packed rows "
        "are kept)",
        RuntimeWarning,
        stacklevel=5,
    )


_WARNED: set[tuple[str, str]] = set()


# --- SDPA, one sequence at a time -----------------------------------------------------------------


class Groups(NamedTuple):
    """The real tokens of a packed batch, grouped by sequence for SDPA: per group of sequences of
    similar length, ``index`` ``[sequences, longest]`` (flat token numbers over ``batch x length``, a
    short sequence padded with its own first token, which comes after its real ones and so is never
    attended causally) and ``valid`` (the real entries)."""

    shape: tuple[int, int]  # (batch, length)
    parts: tuple[tuple[Tensor, Tensor], ...]  # (index, valid) per group

    def longest(self) -> int:
        return max(index.shape[1] for index, _ in self.parts)


def groups(mask: Tensor, segment_ids: Tensor) -> Groups:
    """:class:`Groups` of a packed batch (eager mode: reads the sequences' lengths once)."""
    batch, length = mask.shape
    real = (mask != 0).reshape(-1)
    flat = real.nonzero().squeeze(1)  # the real tokens, in order
    rows = torch.arange(batch, device=mask.device)[:, None] * (length + 1)
    sequence = (segment_ids.expand(batch, length) + rows).reshape(-1)[flat]  # nondecreasing
    counts = torch.unique_consecutive(sequence, return_counts=True)[1]
    starts = counts.cumsum(0) - counts
    sizes = counts.tolist()
    by_size: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):  # groups of sizes within a factor of 2: little work on padding
        by_size.setdefault(1 << (size - 1).bit_length(), []).append(i)
    parts = []
    for members in by_size.values():
        chosen = torch.tensor(members, device=mask.device)
        own, first = counts[chosen], starts[chosen]
        longest = int(max(sizes[i] for i in members))
        offsets = torch.arange(longest, device=mask.device)
        valid = offsets[None, :] < own[:, None]
        index = flat[first[:, None] + torch.where(valid, offsets[None, :], 0)]
        parts.append((index, valid))
    return Groups((batch, length), tuple(parts))


def by_sequence_sdpa() -> Optional[tuple[dict, str, Callable, Callable]]:
    """While hfpatch is installed, transformers' SDPA attention function (its registry's ``"sdpa"``,
    4.48+) runs a mask by sequence that carries its :class:`Groups` one sequence at a time: (the
    registry's mapping, the key, the function, the replacement), or None before the registry."""
    mapping = _attention_registry()
    original = mapping.get("sdpa") if mapping is not None else None
    if original is None:
        return None

    @functools.wraps(original)
    def sdpa_attention_forward(
        module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        grouped = getattr(attention_mask, GROUPS, None) if attention_mask is not None else None
        if (
            grouped is None
            or args
            or kwargs.get("position_bias") is not None
            or torch.compiler.is_compiling()
        ):
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        batch, length = grouped.shape
        if query.shape[0] != batch or query.shape[2] != length or key.shape[2] != length:
            return original(module, query, key, value, attention_mask, **kwargs)  # (not a row it describes)
        return _by_sequence(original, module, query, key, value, grouped, kwargs)

    return mapping, "sdpa", original, sdpa_attention_forward


def _by_sequence(
    original: Callable, module: Any, query: Tensor, key: Tensor, value: Tensor, grouped: Groups, kwargs: dict
) -> tuple[Tensor, None]:
    """``original`` (SDPA) on each group of sequences alone, causal; the outputs put back in place."""
    batch, length = grouped.shape
    kwargs = {**kwargs, "is_causal": True}  # (a model may pass False: it computed that for the mask it has)
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value)]
    out = flat[0].new_zeros(batch * length, query.shape[1], value.shape[3])
    for index, valid in grouped.parts:
        q, k, v = (t[index].transpose(1, 2) for t in flat)  # [sequences, heads, longest, dim]
        attended, _ = original(module, q, k, v, None, **kwargs)  # [sequences, longest, heads, dim]
        out = out.index_copy(0, index[valid], attended[valid])
    return out.reshape(batch, length, *out.shape[1:]), None


def _attention_registry() -> Optional[dict]:
    """transformers' mapping of attention functions: ``AttentionInterface._global_mapping`` (4.52+), the
    ``ALL_ATTENTION_FUNCTIONS`` dict (4.48-4.51), or None."""
    import sys

    modeling_utils = sys.modules.get("transformers.modeling_utils")
    interface = getattr(modeling_utils, "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict):
        return mapping
    mapping = getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None)
    return mapping if isinstance(mapping, dict) else None
