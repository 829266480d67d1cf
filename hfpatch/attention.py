"""A packed row's attention at its sequences' own cost, through the patched module's own attention
functions (transformers' documented per-model override), never the process-wide registry.

A call whose rows pack several sequences (or an unpadded call's packed row) hands its attention layers
the row's layout, :class:`hfpatch.layout.Layout` (its real tokens grouped by sequence, once a call by
:func:`hfpatch.layout.grouped`), on each layer type's mask (a :class:`ByLayout` riding on a
:class:`Carrier`, the tensor subclass that keeps it through the ops a mask goes through): a placeholder
of ``-inf`` that holds nothing (:func:`carrier`: a ``[batch, 1, length, length]`` view of one element, so
that an attention that ignored the layout would give NaN, never a quiet wrong number), which the mask
code hands on as given (masking_utils' functions, 4.53+; before, an ``_update_causal_mask`` hfpatch
patches to do so). Each patched modeling module with attention functions (4.48+) gets two rows
(:func:`module_rows`):

- its ``ALL_ATTENTION_FUNCTIONS`` name: an attention interface of its own (a new ``AttentionInterface``,
  as transformers documents for a module that overrides an attention), whose ``sdpa`` entry is by layout
  (:func:`by_layout`) over the SDPA function registered at each call; every other entry is transformers';
- its ``eager_attention_forward`` (the eager default its attention classes fall back on), by layout too.

A module whose attention classes call SDPA themselves (4.39-4.47, and a few after) meets the carrier in
``scaled_dot_product_attention``, which the carrier takes over (:class:`Carrier`: by sequence, a plain
tensor out). A function by layout given a carrier runs SDPA or eager attention on each group of
sequences of similar length alone (a ``[sequences, heads, longest, dim]`` batch; its mask the one rule's,
:func:`hfpatch.positions.window_mask`, over the group's own tokens and positions: causal, windows and
chunks by position, none at all for plain SDPA), and puts the outputs back in the row. Attention weights
asked for, or shapes that are not the row's: the dense mask the layout stands for. Given any other mask
it is the function it wraps after one class test: a call without a packed row runs as without hfpatch,
and a model of a module hfpatch does not patch never meets it.
"""

from __future__ import annotations

import functools
from collections import ChainMap
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from .backends import BACKENDS, EAGER, SDPA, Backend, by_sequence_on
from .layout import Group, Layout
from .patches import Patch
from .positions import window_mask

__all__ = [
    "LAYOUT",
    "LAID_DTYPE",
    "RUNS",
    "ByLayout",
    "Carrier",
    "carried",
    "by_layout",
    "by_sequence",
    "carrier",
    "compiled_layout",
    "module_rows",
]

LAYOUT = "_hfpatch_layout"  # on a layer type's mask: its ByLayout
RUNS = "_hfpatch_runs"  # on the 2-D mask of layers that carry a state: the call's sequences (hfpatch.mixers)


class ByLayout(NamedTuple):
    """A layer type's mask, given as the call's layout: its sequences, and the layer's window and chunk
    (None: full attention). ``dense`` renders it as a 4-D mask (for an attention that takes no layout)."""

    layout: Layout
    window: Optional[int] = None
    chunk: Optional[int] = None

    def dense(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The ``[batch, 1, length, length]`` mask it stands for (bool; additive float of ``dtype``)."""
        laid = self.layout
        batch, length = laid.shape
        real = laid.mask != 0
        slots = torch.arange(length, device=real.device)
        positions = laid.positions.expand(batch, length)
        allowed = window_mask(
            real, slots, slots, self.window, self.chunk, positions=positions, segment_ids=laid.segment_ids
        )
        return allowed if dtype is None else _additive(allowed, dtype)


def by_layout(original: Callable, kind: str, registry: Any = None) -> Callable:
    """``original`` (an attention function of transformers' signature; with ``registry``, the function
    registered there under ``kind`` at each call: a dict, or transformers' interface, read through its
    two dicts, no Python call), which runs a mask carrying a layout (:class:`Carrier`) one group of
    sequences at a time where ``kind`` is SDPA or eager, else on its dense mask. Any other mask: the
    function as it is, after one class test (the cost of every other call: its one frame)."""
    if getattr(original, "__hfpatch_by_layout__", False):
        return original
    row = by_sequence_on(kind)  # (its row of hfpatch.backends: by sequence on a dense mask, or None)
    as_data = row is not None and row.as_data  # (compiled: the layout as data, the custom op)
    if registry is None:
        own, shared = {}, {kind: original}
    elif isinstance(registry, dict):
        own, shared = {}, registry
    else:  # (an interface: its own entries, then its class's, as GeneralInterface.__getitem__ reads them)
        own, shared = registry._local_mapping, type(registry)._global_mapping

    @functools.wraps(original)
    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any,
                  **kwargs: Any) -> Any:  # fmt: skip
        function = own[kind] if kind in own else shared[kind]
        if attention_mask.__class__ is not Carrier:  # (never under compile: no carrier is made there)
            laid = (
                attention_mask.__class__ is Tensor and attention_mask.dtype is LAID_DTYPE
            )  # (else: one test)
            if laid and as_data and _is_layout(attention_mask, query):
                return _compiled_by_sequence(
                    function, module, query, key, value, attention_mask, args, kwargs
                )
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        return _laid_out(function, row, module, query, key, value, attention_mask, args, kwargs)

    attention.__hfpatch_by_layout__ = True  # type: ignore[attr-defined]
    return attention


def _laid_out(
    function: Callable, row: Optional[Backend], module: Any, query: Tensor, key: Tensor, value: Tensor,
    mask: Tensor, args: tuple, kwargs: dict,
) -> Any:  # fmt: skip
    """An attention call whose mask carries a layout: by sequence, or on the dense mask it stands for."""
    layout = mask.__dict__.get(LAYOUT)
    if layout is None:  # (a carrier an op made from no carrier: a dense mask, as it is)
        return function(module, query, key, value, mask.as_subclass(Tensor), *args, **kwargs)
    batch, length = layout.layout.shape
    fits = query.shape[0] == batch and query.shape[2] == length and key.shape[2] == length
    asked = kwargs.get("output_attentions") or kwargs.get("position_bias") is not None
    if row is None or args or not fits or asked or torch.compiler.is_compiling():
        dense = _dense(mask, layout, query.dtype if row is not None and row.additive else None)
        return function(module, query, key, value, dense, *args, **kwargs)
    return by_sequence(function, row, module, query, key, value, layout, kwargs)


# --- compiled code: the layout as one tensor, and the kernels by sequence as one custom op ---------------

# a compiled layer type's mask: its layout, [batch, 5, 1, length] of this dtype (SDPA takes no such mask)
LAID_DTYPE = torch.int64


def _is_layout(mask: Tensor, query: Tensor) -> bool:
    """An integer mask that is a compiled layout (:func:`compiled_layout`) of ``query``'s tokens."""
    shape = mask.shape
    return len(shape) == 4 and shape[1] == 5 and shape[2] == 1 and shape[3] == query.shape[2] > 1


def compiled_layout(
    real: Tensor, segment_ids: Tensor, positions: Tensor, window: Optional[int], chunk: Optional[int]
) -> Tensor:
    """A compiled packed row's mask for one layer type: its layout in one ``[batch, 5, 1, length]`` integer
    tensor (the real tokens, each token's sequence, its position, the window, the chunk; -1: none), which
    the module's SDPA by layout hands to :func:`hfpatch.compiled.sdpa_by_sequence` (a custom op, so that a
    traced graph neither breaks nor depends on the lengths). Any attention that took it for a mask fails
    loudly: SDPA takes no integer mask, and eager attention cannot index it as ``[batch, heads, queries,
    keys]``."""
    batch, length = real.shape
    parts = [
        real.long(),
        segment_ids.expand(batch, length),
        positions.reshape(-1, length).expand(batch, length),
    ]
    for size in (window, chunk):
        parts.append(torch.full_like(parts[0], -1 if size is None else size))
    return torch.stack(parts, 1).to(LAID_DTYPE)[:, :, None]  # (4-D: the mask functions hand it on as given)


def _compiled_by_sequence(
    function: Callable, module: Any, query: Tensor, key: Tensor, value: Tensor, layout: Tensor,
    args: tuple, kwargs: dict,
) -> Any:  # fmt: skip
    """A compiled packed row's SDPA call: :func:`hfpatch.compiled.sdpa_by_sequence`; attention weights
    asked for, dropout or positional extras: SDPA on the dense mask the layout stands for."""
    if (
        args
        or kwargs.get("output_attentions")
        or kwargs.get("dropout", 0.0)
        or kwargs.get("s_aux") is not None
    ):
        return function(module, query, key, value, _dense_of(layout), *args, **kwargs)
    return torch.ops.hfpatch.sdpa_by_sequence(query, key, value, layout, kwargs.get("scaling")), None


def _dense_of(layout: Tensor) -> Tensor:
    """The ``[batch, 1, length, length]`` boolean mask a compiled layout stands for (tensor ops only)."""
    real, segment_ids, positions, window, chunk = layout[:, :, 0].unbind(1)
    slots = torch.arange(real.shape[1], device=real.device)
    allowed = window_mask(real != 0, slots, slots, None, None, positions=positions, segment_ids=segment_ids)
    width = window[:, :, None]  # (-1: no window; the same in every slot)
    inside = (width < 0) | (positions[:, :, None] - positions[:, None, :] < width)
    size = chunk[:, :, None]
    same = (size < 0) | (
        positions[:, :, None] // size.clamp(min=1) == positions[:, None, :] // size.clamp(min=1)
    )
    return allowed & (inside & same)[:, None]


def by_sequence(
    original: Callable, row: Backend, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: ByLayout,
    kwargs: dict,
) -> tuple[Tensor, None]:  # fmt: skip
    """``original`` (an attention function of ``row``'s backend) on each group of sequences alone; the
    outputs put back in place, ``[batch, length, heads, dim]`` (the layout of transformers' attention
    functions' output)."""
    seq = mask.layout
    batch, length = seq.shape
    plain = mask.window is None and mask.chunk is None and row.causal
    kwargs = {**kwargs, "is_causal": plain} if row.causal else kwargs  # (a model may pass False)
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]) for t in (query, key, value)]
    out: Optional[Tensor] = None
    for group in seq.parts:
        q, k, v = (t[group.index].transpose(1, 2) for t in flat)  # [sequences, heads, longest, dim]
        part = None if plain else _part_mask(mask, group, q.dtype if row.additive else None)
        attended, _ = original(module, q, k, v, part, **kwargs)  # [sequences, longest, heads, dim]
        if out is None:  # in the attention's output dtype: autocast's, not the query's
            out = attended.new_zeros(batch * length, query.shape[1], value.shape[3])
        real = attended.reshape(-1, *attended.shape[2:]).index_select(0, group.taken)
        out.index_copy_(0, group.into, real)  # (in place: a copy a group would cost T x dim)
    assert out is not None  # (a packed row has a sequence)
    return out.reshape(batch, length, *out.shape[1:]), None


def _part_mask(mask: ByLayout, group: Group, dtype: Optional[torch.dtype]) -> Tensor:
    """A group's ``[sequences, 1, longest, longest]`` mask by the one rule, over its own tokens: causal,
    real, the layer's window or chunk by position (bool; additive float of ``dtype``)."""
    slots = torch.arange(group.index.shape[1], device=group.index.device)
    positions = mask.layout.flat_positions[group.index]
    allowed = window_mask(group.valid, slots, slots, mask.window, mask.chunk, positions=positions)
    return allowed if dtype is None else _additive(allowed, dtype)


def _dense(mask: Tensor, layout: ByLayout, dtype: Optional[torch.dtype]) -> Tensor:
    """A carrier as a plain mask for an attention that takes no layout: a placeholder's the mask it stands
    for (bool; additive float of ``dtype``), any other carrier's its own values."""
    if mask.stride()[-2:] == (0, 0):
        return layout.dense(dtype)
    return mask.as_subclass(Tensor)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask as eager attention adds it: 0 where attended, the dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class Carrier(Tensor):
    """A mask whose rider (a placeholder's layout, :func:`carrier`; a state layers' sequences,
    :data:`RUNS`) follows it through the tensor ops a mask may go through on its way to a layer: a
    reentrant checkpoint's ``detach()`` of the layer's inputs (torch's ``checkpoint_wrapper``), a hook's
    ``.to(device)`` (accelerate's), a slice. ``scaled_dot_product_attention`` given a layout runs by
    sequence (:func:`_inline`)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:  # a module that calls SDPA itself, handed a layout (4.39-4.47's attention classes)
            return _inline(args, kwargs)
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(out, Carrier):
            for key in (LAYOUT, RUNS):
                if out.__dict__.get(key) is None:
                    rider = next((a.__dict__.get(key) for a in args if isinstance(a, Carrier)), None)
                    if rider is not None:
                        out.__dict__[key] = rider
        return out


_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_SDPA_TAKEN = {"dropout_p", "is_causal", "scale", "enable_gqa"}  # (a call by sequence takes these)


def _inline(args: tuple, kwargs: dict) -> Tensor:
    """``scaled_dot_product_attention`` called by a module's own code with a mask that carries a layout:
    by sequence where the call is the row's (``[batch, heads, length, dim]`` in and out, as SDPA's), else
    SDPA on the dense mask it stands for. The output is a plain tensor."""
    given = dict(zip(_SDPA_NAMES, args), **kwargs)
    query, key, value = (given.pop(name) for name in ("query", "key", "value"))
    mask = given.pop("attn_mask")
    layout = mask.__dict__.get(LAYOUT) if mask.__class__ is Carrier else None
    if layout is not None:
        batch, length = layout.layout.shape
        fits = query.shape[0] == batch and query.shape[2] == length and key.shape[2] == length
        if fits and not given.get("is_causal") and set(given) <= _SDPA_TAKEN:  # (grouped keys: repeated)
            extra = {"dropout": given.get("dropout_p", 0.0), "scaling": given.get("scale")}
            out, _ = by_sequence(sdpa_call, BACKENDS[SDPA], None, query, key, value, layout, extra)
            return out.transpose(1, 2)
        mask = _dense(mask, layout, None)
    plain = [t.as_subclass(Tensor) if isinstance(t, Tensor) else t for t in (query, key, value, mask)]
    with torch._C.DisableTorchFunctionSubclass():
        return _SDPA(*plain, **given)


def sdpa_call(
    module: Any, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor],
    dropout: float = 0.0, scaling: Optional[float] = None, is_causal: bool = False, **_: Any,
) -> tuple[Tensor, None]:  # fmt: skip
    """Torch's SDPA in transformers' attention-function form (what :func:`by_sequence` runs each group on
    where no transformers function is at hand: a module's own SDPA call, the compiled op):
    ``[batch, heads, length, dim]`` in, ``[batch, length, heads, dim]`` out, key and value heads repeated
    to the query's."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    causal = is_causal and mask is None
    out = _SDPA(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=causal)
    return out.transpose(1, 2).contiguous(), None


def carried(mask: Tensor, rider: Any, key: str = LAYOUT) -> Tensor:
    """``mask`` (a dense mask by sequence; a state layers' 2-D mask) carrying ``rider`` under ``key``: a
    :class:`Carrier` view of it."""
    made = mask.as_subclass(Carrier)
    made.__dict__[key] = rider
    return made


def carrier(layout: ByLayout, dtype: torch.dtype) -> Tensor:
    """A layer type's mask that is its layout alone: ``-inf`` everywhere, ``[batch, 1, length, length]``,
    one element of memory, ``layout`` on it (:data:`LAYOUT`), kept by the ops a mask goes through
    (:class:`Carrier`)."""
    batch, length = layout.layout.shape
    device = layout.layout.mask.device
    placeholder = torch.full((), float("-inf"), dtype=dtype, device=device).expand(batch, 1, length, length)
    return carried(placeholder, layout)


MAPPING, EAGER_FUNCTION = "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"


def module_rows(module: Any) -> list[Patch]:
    """The rows of a patched modeling module (releases with attention functions, 4.48+): its
    ``ALL_ATTENTION_FUNCTIONS`` made an attention interface of its own (transformers' documented
    per-module override: a new ``AttentionInterface`` with the module's own entries, and ``sdpa`` by
    layout, the function registered for SDPA read at each call; 4.48-4.51's dict: a ``ChainMap`` over it),
    and its ``eager_attention_forward`` wrapped by layout. Every other entry is transformers' as
    registered: nothing of another module changes."""
    namespace = vars(module)
    rows = []
    mapping = namespace.get(MAPPING)
    if mapping is not None and not getattr(mapping, "__hfpatch_by_layout__", False):
        local = _own_interface(mapping)
        if local is not None:
            rows.append(Patch(namespace, MAPPING, mapping, local, late=True))
    eager = namespace.get(EAGER_FUNCTION)
    if callable(eager) and not getattr(eager, "__hfpatch_by_layout__", False):
        rows.append(Patch(namespace, EAGER_FUNCTION, eager, by_layout(eager, EAGER), late=True))
    return rows


def _own_interface(mapping: Any) -> Any:
    """A module's own attention mapping over ``mapping`` (what it had: transformers' interface, or
    4.48-4.51's dict), whose ``sdpa`` runs by layout over ``mapping["sdpa"]`` as it is at each call; every
    other entry read from ``mapping`` at each call too (a function a program registers, or sets on it,
    after ``apply()`` reaches the module as without hfpatch)."""
    try:
        sdpa = by_layout(mapping[SDPA], SDPA, mapping)
    except (KeyError, TypeError):  # (no SDPA entry: nothing to run by layout)
        return None
    if isinstance(mapping, dict):  # 4.48-4.51: the registry is a dict its modules read by key
        made: Any = ChainMap({SDPA: sdpa}, mapping)
    elif isinstance(getattr(mapping, "_local_mapping", None), dict):
        made = _interface_over(mapping, sdpa)
    else:
        return None
    try:
        made.__hfpatch_by_layout__ = True
    except AttributeError:  # (a ChainMap takes attributes: this is for an interface that does not)
        pass
    return made


def _interface_over(mapping: Any, sdpa: Callable) -> Any:
    """An interface of ``mapping``'s class whose ``sdpa`` is ``sdpa`` and whose every other entry is
    ``mapping``'s at each call (what a program sets on it goes to ``mapping``), looked up in no more Python
    calls than transformers' own lookup makes (a decode step pays nothing per layer for it)."""
    base = type(mapping)

    class Own(base):  # type: ignore[misc, valid-type]
        def __getitem__(self, key: str) -> Any:
            return sdpa if key == SDPA else mapping[key]

        def __contains__(self, key: object) -> bool:
            return key == SDPA or key in mapping

        def __setitem__(self, key: str, value: Any) -> None:
            mapping[key] = value

        def __delitem__(self, key: str) -> None:
            del mapping[key]

        def __iter__(self) -> Any:
            return iter(mapping)

        def __len__(self) -> int:
            return len(mapping)

    if hasattr(base, "get_interface"):  # (5.x: the attention classes look an entry up by it)

        def get_interface(self: Any, implementation: str, default: Callable) -> Callable:
            return sdpa if implementation == SDPA else mapping.get_interface(implementation, default)

        Own.get_interface = get_interface  # type: ignore[attr-defined]
    return Own()
