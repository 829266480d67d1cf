"""Rows that pack several sequences: positions that restart inside a row (``DataCollatorWithFlattening``,
TRL's ``padding_free``, verl's remove-padding) mark where each sequence starts. Stock transformers lets
every sequence of such a row attend to the ones before it, unless the call has neither a mask nor a
cache (``use_cache=False``, 5.x); a patched forward keeps each one to itself:

1. :func:`packed_rows` finds them: the caller's ``position_ids`` restart at a real token (pads never
   split a row), and nothing is cached before the call (:func:`hfpatch.positions.segments`, the rule
   transformers uses);
2. :func:`hfpatch.layout.grouped` groups their sequences once (from the call's one host read), and
   :func:`hfpatch.windows.apply_masks` hands it to each layer type as its mask
   (:class:`hfpatch.attention.ByLayout`: the windows' one rule, real, causal, in the query's sequence,
   within the window by position), where the forward takes masks by layer type (4.53+); the patched
   module's own attention functions (:mod:`hfpatch.attention`) run SDPA and eager attention on each
   group of sequences alone (``sum(length ** 2)`` of work, no ``row ** 2`` tensor), flex and flash
   attention take it their way (a ``BlockMask``, the lengths). On releases whose mask code takes no
   layout, the mask by sequence is rendered in the form it takes, and for SDPA carries the layout, which
   the module's SDPA function runs by sequence all the same. Compiled code gets the dense masks (no
   branch on tensor values): the same result.

A call that gives its sequences by their lengths (``cu_seq_lens_q``, ``seq_idx``) and no positions gets
positions counting from 0 in each (:func:`positions_from_lengths`). Where a packed row cannot be kept to
its sequences (a recurrent model, a release whose mask code takes no 4-D mask, an attention that reads
no mask), the call runs as stock does and :func:`warn_not_kept` says so, once per model type.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from . import caches
from ._compat import CACHE_NAMES, passed
from ._context import CALL, PACKED, Pin, patched_here, warn_once
from .layout import Layout
from .patches import ABSENT
from .positions import positions_in_segments, restarts, segments, segments_from_lengths
from .sources import forward_tree, pools_by_pad_id, source_of

__all__ = [
    "Head",
    "handing_on",
    "task_heads",
    "packed_rows",
    "positions_from_lengths",
    "warn_not_kept",
]


def packed_rows(kwargs: dict, tokens: Optional[Tensor]) -> Optional[Layout]:
    """The :class:`~hfpatch.layout.Layout` of a call whose caller's ``position_ids`` restart inside a row,
    with nothing cached before it (or the layout an unpadded call hands its packed call: ``CALL.laid``, taken
    as it is); None for any other call. Multimodal rope positions ``[3 or 4, batch, length]`` are read as
    :func:`~hfpatch.positions.segments` says. Shapes first (a decode step has one new token: never packed); in
    eager mode the positions and the mask are then read to the host at once (the call's one read), compiled
    code always gets the masks by sequence (the causal ones where nothing restarts: no branch on tensor
    values)."""
    positions = kwargs["position_ids"]
    if tokens is None or positions.__class__ is not Tensor:
        return None
    handed = CALL.laid
    if handed is not None and handed.positions is positions:  # an unpadded call's packed row
        CALL.laid = None
        return handed
    rows = positions.dim() == 3 and positions.shape[0] in (3, 4)  # multimodal rope: [(text;) t; h; w]
    if positions.dim() != 2 and not rows:
        return None
    batch, num_new = tokens.shape[0], tokens.shape[1]
    if num_new < 2 or positions.shape[-1] != num_new or positions.shape[-2] not in (1, batch):
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and (
        mask.__class__ is not Tensor or mask.dim() != 2 or tuple(mask.shape) != (batch, num_new)
    ):
        return None  # a 4-D mask (the caller's), a mask past a cached prefix, a BlockMask
    cache = passed(kwargs, CACHE_NAMES)
    if cache is not None and (caches.capacity(cache) is not None or caches.past_length(cache)):
        return None  # continues a cache
    first = positions[0] if rows else positions  # (windows count the text or t row)
    if torch.compiler.is_compiling():
        segment_ids = segments(positions, mask)
        mask = torch.ones(batch, num_new, dtype=torch.bool, device=tokens.device) if mask is None else mask
        return Layout(mask, first, segment_ids)
    host_positions, host_mask = _on_host(positions, mask)
    if not restarts(host_positions, host_mask):
        return None
    host_segments = segments(host_positions, host_mask)
    if mask is None:
        mask = torch.ones(batch, num_new, dtype=torch.bool, device=tokens.device)
    real = host_positions.new_ones(batch, num_new, dtype=torch.bool) if host_mask is None else host_mask != 0
    segment_ids = host_segments.to(tokens.device, non_blocking=True)
    return Layout(mask, first, segment_ids, (real, host_segments))


def _on_host(positions: Tensor, mask: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """The positions and the mask, read to the host in one copy (on the CPU too: the same path)."""
    flat = positions.reshape(-1, positions.shape[-1]).long()
    both = torch.cat([flat, mask.long()]) if mask is not None else flat
    host = both.cpu()
    host_positions = host[: flat.shape[0]].reshape(positions.shape)
    return host_positions, host[flat.shape[0] :] if mask is not None else None


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


SPANS = ("start_positions", "end_positions")  # a question-answering head's targets
TARGETS = ("labels", *SPANS)  # what a head's loss reads: under unpad=True a head taking one is gated
NOT_KEPT = "its packed rows are not kept"  # (apply(unpad=True): why a padded call stays padded)


class Head(NamedTuple):
    """A task head of a patched module (``GPT2LMHeadModel`` ...): its class and ``forward`` (its own, or
    the one it inherits from a mixin: 5.x's ``GenericForTokenClassification`` ...), what its class holds
    under that name (``ABSENT`` for an inherited one), whether it hands its ``**kwargs`` to no call of its
    base model (a packed row's lengths stop there), whether it takes ``position_ids`` itself (or they stop
    there too: 5.x's BLOOM heads), whether it takes a target its loss reads (``labels``,
    ``start_positions``, ``end_positions``), whether it pools the token it picks by the pad id, and where
    it takes an ``attention_mask`` it hands to no call of its base model (RWKV's), the mask's place among
    its positional parameters (else None)."""

    cls: type
    forward: Callable
    own: Any
    drops: bool
    takes_positions: bool
    targets: bool
    pools: bool = False
    drops_mask: Optional[int] = None


def task_heads(module: Any, owner: type) -> list[Head]:
    """The model classes of ``module`` besides ``owner`` whose ``forward`` (their own, or a mixin's they
    inherit) calls their base model (``self.<base_model_prefix>(...)``, or ``getattr(self,
    self.base_model_prefix)(...)``), read from their code."""
    found = []
    for value in vars(module).values():
        if not isinstance(value, type) or value is owner or value.__module__ != module.__name__:
            continue
        own = value.__dict__.get("forward", ABSENT)
        forward = own if own is not ABSENT else _mixin_forward(value)
        base = getattr(value, "base_model_prefix", None)
        if forward is None or not base:
            continue
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):
            continue
        tree = forward_tree(forward)
        if tree is None:
            continue
        var = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _calls_base(n.func, base)]
        if not calls:
            continue
        hands_on = any(
            k.arg is None and isinstance(k.value, ast.Name) and k.value.id == var
            for call in calls
            for k in call.keywords
        )
        drops = var is not None and not hands_on
        targets = any(name in params for name in TARGETS)
        pools = pools_by_pad_id(source_of(forward) or "")
        passed = {k.arg for call in calls for k in call.keywords} | {
            a.id for call in calls for a in call.args if isinstance(a, ast.Name)
        }
        names = [name for name in params if name != "self"]
        mask_at = (
            names.index("attention_mask")
            if "attention_mask" in names and "attention_mask" not in passed
            else None
        )
        found.append(Head(value, forward, own, drops, "position_ids" in params, targets, pools, mask_at))
    return found


def _mixin_forward(cls: type) -> Optional[Callable]:
    """The ``forward`` ``cls`` inherits from a mixin that is no module (transformers' ``Generic*`` heads),
    or None (its own, none, or a model class's: that class is patched, or not, where it is defined)."""
    for parent in cls.__mro__[1:]:
        forward = parent.__dict__.get("forward")
        if forward is not None:
            return None if issubclass(parent, torch.nn.Module) else forward
    return None


def _calls_base(func: ast.expr, base: str) -> bool:
    """``self.<base>`` or ``getattr(self, self.base_model_prefix)``: the callee of a call of the base."""
    if isinstance(func, ast.Attribute):
        return func.attr == base and isinstance(func.value, ast.Name) and func.value.id == "self"
    return (
        isinstance(func, ast.Call)
        and isinstance(func.func, ast.Name)
        and func.func.id == "getattr"
        and len(func.args) == 2
        and isinstance(func.args[0], ast.Name)
        and func.args[0].id == "self"
        and isinstance(func.args[1], ast.Attribute)
        and func.args[1].attr == "base_model_prefix"
    )


def handing_on(
    original: Callable, pin: Pin, takes_positions: bool, mask_at: Optional[int] = None
) -> Callable:
    """The ``forward`` of a task head that drops its kwargs (:func:`task_heads`), made to keep a packed row
    reaching its base model: its lengths become positions (counting from 0 in each sequence) where the
    caller gives none, and positions the head would drop go to the base model's patched forward through
    the call's context (``CALL.handed``, taken by the first patched forward that runs inside). ``mask_at``:
    the head drops its ``attention_mask`` (this place among its positional parameters), which goes on the
    same way (``CALL.handed_mask``: RWKV's, whose layers then keep each row's pads out of its state)."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if mask_at is not None and patched_here(pin):
            mask = args[mask_at] if len(args) > mask_at else kwargs.get("attention_mask")
            if isinstance(mask, Tensor):
                before, CALL.handed_mask = CALL.handed_mask, mask
                try:
                    return handing(self, *args, **kwargs)
                finally:
                    CALL.handed_mask = before
        return handing(self, *args, **kwargs)

    def handing(self: Any, *args: Any, **kwargs: Any) -> Any:
        lengths = "cu_seq_lens_q" in kwargs or "seq_idx" in kwargs
        dropped = not takes_positions and kwargs.get("position_ids") is not None
        if not (lengths or dropped) or not PACKED[0] or not patched_here(pin):
            return original(self, *args, **kwargs)
        if kwargs.get("position_ids") is None:
            tokens = kwargs.get("input_ids")
            if tokens is None:
                tokens = args[0] if args else kwargs.get("inputs_embeds")
            positions_from_lengths(kwargs, tokens if isinstance(tokens, Tensor) else None)
        if takes_positions or kwargs.get("position_ids") is None:
            return original(self, *args, **kwargs)
        before, CALL.handed = CALL.handed, kwargs.pop("position_ids")
        try:
            return original(self, *args, **kwargs)
        finally:
            CALL.handed = before

    return forward


def warn_not_kept(arch: str, why: str) -> None:
    """Once per model type and reason: a packed row left as stock runs it."""
    message = (
        f"hfpatch: a packed row of {arch} (position_ids that restart) is not kept to its sequences: {why}; "
        "each sequence sees the ones before it, as on stock (hfpatch.status() says where packed rows are "
        "kept)"
    )
    warn_once(("packed row", arch, why), message, stacklevel=5)
