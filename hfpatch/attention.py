"""A packed row's attention at its sequences' own cost, through the patched module's own attention
functions (transformers' documented per-model override), never the process-wide registry.

A call whose rows pack several sequences (or an unpadded call's packed row) hands its attention layers
the row's layout, :class:`Sequences` (its real tokens grouped by sequence, computed once a call by
:func:`hfpatch.packed.sequences`), on each layer type's mask (:class:`ByLayout`, as an attribute): where
the mask code takes a mask as it is given (4.53+), the mask is a placeholder of ``-inf`` that holds
nothing (:func:`carrier`: a ``[batch, 1, length, length]`` view of one element, so that an attention
that ignored the layout would give NaN, never a quiet wrong number); elsewhere the mask by sequence
itself carries it. Each patched modeling module gets two rows (:func:`module_rows`):

- its ``ALL_ATTENTION_FUNCTIONS`` name: a :class:`LocalAttention` over transformers' mapping, which hands
  out each function as it is registered at call time, wrapped (:func:`by_layout`);
- its ``eager_attention_forward`` (the eager default its attention classes fall back on), wrapped alike.

A wrapped function given a mask with a layout runs SDPA or eager attention on each group of sequences of
similar length alone (a ``[sequences, heads, longest, dim]`` batch; its mask the one rule's,
:func:`hfpatch.positions.window_mask`, over the group's own tokens and positions: causal, windows and
chunks by position, none at all for plain SDPA), and puts the outputs back in the row; any other
attention given a placeholder (a kernel's) gets the dense mask the layout stands for. Given anything else it
is the function it wraps, unchanged: a model of another module, or a call without a packed row, runs as
without hfpatch. Attention weights asked for: the dense mask too (they are ``length x length``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from .patches import Patch
from .positions import window_mask

__all__ = [
    "LAYOUT",
    "ByLayout",
    "Carrier",
    "LocalAttention",
    "Sequences",
    "by_layout",
    "carrier",
    "module_rows",
]

BY_SEQUENCE = ("sdpa", "eager")  # the attentions run one group of sequences at a time
LAYOUT = "_hfpatch_layout"  # on a layer type's mask: its ByLayout


class Sequences(NamedTuple):
    """A call's packed rows as their sequences: ``shape`` (batch, length) of the rows; per group of
    sequences of similar length, ``index`` ``[sequences, longest]`` (flat token numbers over ``batch x
    length``; a short sequence padded with its own first token, which comes after its real ones and so is
    never attended causally) and ``valid`` (the real entries); ``positions`` ``[batch * length]``, each
    token's position (windows are decided by it); ``real`` ``[batch, length]``, the 2-D mask (bool);
    ``segment_ids`` ``[batch or 1, length]``, each token's sequence in its row
    (:func:`hfpatch.positions.segments`)."""

    shape: tuple[int, int]
    parts: tuple[tuple[Tensor, Tensor], ...]
    positions: Tensor
    real: Tensor
    segment_ids: Tensor

    def longest(self) -> int:
        return max(index.shape[1] for index, _ in self.parts)


class ByLayout(NamedTuple):
    """A layer type's mask, given as the call's layout: its sequences, and the layer's window and chunk
    (None: full attention). ``dense`` renders it as a 4-D mask (for an attention that takes no layout)."""

    sequences: Sequences
    window: Optional[int] = None
    chunk: Optional[int] = None

    def dense(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The ``[batch, 1, length, length]`` mask it stands for (bool; additive float of ``dtype``)."""
        seq = self.sequences
        batch, length = seq.shape
        slots = torch.arange(length, device=seq.real.device)
        positions = seq.positions.view(batch, length)
        allowed = window_mask(
            seq.real, slots, slots, self.window, self.chunk, positions=positions, segment_ids=seq.segment_ids
        )
        return allowed if dtype is None else _additive(allowed, dtype)


def by_layout(original: Callable, kind: str) -> Callable:
    """``original`` (an attention function of transformers' signature), which runs a :class:`ByLayout`
    mask one group of sequences at a time where ``kind`` is SDPA or eager, else on its dense mask."""
    if getattr(original, "__hfpatch_by_layout__", False):
        return original

    @functools.wraps(original)
    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any,
                  **kwargs: Any) -> Any:  # fmt: skip
        layout = getattr(attention_mask, LAYOUT, None) if attention_mask is not None else None
        if layout is None or torch.compiler.is_compiling():
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        batch, length = layout.sequences.shape
        fits = query.shape[0] == batch and query.shape[2] == length and key.shape[2] == length
        asked = kwargs.get("output_attentions") or kwargs.get("position_bias") is not None
        if kind not in BY_SEQUENCE or args or not fits or asked:
            if attention_mask.stride()[-2:] == (0, 0):  # a placeholder: the mask it stands for
                attention_mask = layout.dense(None if kind == "sdpa" else query.dtype)
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        return _by_sequence(original, kind, module, query, key, value, layout, kwargs)

    attention.__hfpatch_by_layout__ = True  # type: ignore[attr-defined]
    return attention


def _by_sequence(
    original: Callable, kind: str, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: ByLayout,
    kwargs: dict,
) -> tuple[Tensor, None]:  # fmt: skip
    """``original`` on each group of sequences alone; the outputs put back in place, ``[batch, length,
    heads, dim]`` (the layout of transformers' attention functions' output)."""
    seq = mask.sequences
    batch, length = seq.shape
    plain = mask.window is None and mask.chunk is None and kind == "sdpa"
    kwargs = {**kwargs, "is_causal": plain} if kind == "sdpa" else kwargs  # (a model may pass False)
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value)]
    out: Optional[Tensor] = None
    for index, valid in seq.parts:
        q, k, v = (t[index].transpose(1, 2) for t in flat)  # [sequences, heads, longest, dim]
        part = None if plain else _part_mask(mask, index, valid, None if kind == "sdpa" else q.dtype)
        attended, _ = original(module, q, k, v, part, **kwargs)  # [sequences, longest, heads, dim]
        if out is None:  # in the attention's output dtype: autocast's, not the query's
            out = attended.new_zeros(batch * length, query.shape[1], value.shape[3])
        out.index_copy_(0, index[valid], attended[valid])  # (in place: a copy a group would cost T x dim)
    assert out is not None  # (a packed row has a sequence)
    return out.reshape(batch, length, *out.shape[1:]), None


def _part_mask(mask: ByLayout, index: Tensor, valid: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    """A group's ``[sequences, 1, longest, longest]`` mask by the one rule, over its own tokens: causal,
    real, the layer's window or chunk by position (bool; additive float of ``dtype``)."""
    slots = torch.arange(index.shape[1], device=index.device)
    positions = mask.sequences.positions[index]
    allowed = window_mask(valid, slots, slots, mask.window, mask.chunk, positions=positions)
    return allowed if dtype is None else _additive(allowed, dtype)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask as eager attention adds it: 0 where attended, the dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class Carrier(Tensor):
    """A placeholder mask (:func:`carrier`) whose layout follows it through the tensor ops a mask may go
    through on its way to an attention layer: a reentrant checkpoint's ``detach()`` of the layer's inputs
    (torch's ``checkpoint_wrapper``), a hook's ``.to(device)`` (accelerate's), a slice."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, Carrier) and out.__dict__.get(LAYOUT) is None:
            layout = next((a.__dict__.get(LAYOUT) for a in args if isinstance(a, Carrier)), None)
            if layout is not None:
                out.__dict__[LAYOUT] = layout
        return out


def carrier(layout: ByLayout, dtype: torch.dtype) -> Tensor:
    """A layer type's mask that is its layout alone: ``-inf`` everywhere, ``[batch, 1, length, length]``,
    one element of memory, ``layout`` on it (:data:`LAYOUT`), kept by the ops a mask goes through
    (:class:`Carrier`)."""
    batch, length = layout.sequences.shape
    device = layout.sequences.real.device
    placeholder = torch.full((), float("-inf"), dtype=dtype, device=device).expand(batch, 1, length, length)
    made = placeholder.as_subclass(Carrier)
    made.__dict__[LAYOUT] = layout
    return made


class LocalAttention(Mapping):
    """A modeling module's ``ALL_ATTENTION_FUNCTIONS`` while it is patched: transformers' mapping (an
    ``AttentionInterface``, or 4.48-4.51's dict) read at each call, its functions handed out wrapped
    (:func:`by_layout`; each wrapped once); the default ``get_interface`` falls back on (the module's eager
    function) alike. Everything else is the mapping's own."""

    def __init__(self, mapping: Any) -> None:
        self._mapping = mapping
        self._wrapped: dict[tuple[str, int], Callable] = {}

    def _wrap(self, name: Any, function: Any) -> Any:
        if not callable(function):
            return function
        made = self._wrapped.get((name, id(function)))
        if made is None or made.__wrapped__ is not function:  # type: ignore[attr-defined]
            made = self._wrapped[(name, id(function))] = by_layout(function, _kind(name))
        return made

    def __getitem__(self, name: str) -> Any:
        return self._wrap(name, self._mapping[name])

    def get(self, name: str, default: Any = None) -> Any:
        found = self._mapping.get(name, default)
        return self._wrap(name, found) if found is not None else found

    def get_interface(self, name: str, default: Callable) -> Callable:
        return self._wrap(name, self._mapping.get_interface(name, default))

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)

    def __contains__(self, name: object) -> bool:
        return name in self._mapping

    def __getattr__(self, name: str) -> Any:  # valid_keys, register ...: the mapping's
        return getattr(self._mapping, name)


def _kind(name: Any) -> str:
    """The attention a registry name runs (``paged|sdpa`` and hub kernels aside: as named)."""
    return name.removeprefix("paged|") if isinstance(name, str) else ""


MAPPING, EAGER = "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"


def module_rows(module: Any) -> list[Patch]:
    """The rows of a patched modeling module: its ``ALL_ATTENTION_FUNCTIONS`` made a
    :class:`LocalAttention`, its ``eager_attention_forward`` wrapped (where it has them: releases with
    attention functions, 4.48+)."""
    namespace = vars(module)
    rows = []
    mapping = namespace.get(MAPPING)
    if mapping is not None and not isinstance(mapping, LocalAttention) and hasattr(mapping, "__getitem__"):
        rows.append(Patch(namespace, MAPPING, mapping, LocalAttention(mapping)))
    eager = namespace.get(EAGER)
    if callable(eager) and not getattr(eager, "__hfpatch_by_layout__", False):
        rows.append(Patch(namespace, EAGER, eager, by_layout(eager, "eager")))
    return rows
