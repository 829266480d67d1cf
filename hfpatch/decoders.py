"""Positions for decoders (and encoders) whose ``forward`` takes none: the BART, M2M100 and T5 families.

Their forward counts ``arange(past, past + new)`` (or, M2M100-style, non-pad ids plus the past length,
which counts a padded prefix's holes) and hands that to its position module, or builds T5's relative
bias from cache columns. No argument reaches it, so the patched ``forward`` derives the positions from
the 2-D mask as for every other model (:mod:`hfpatch.forward`), then hands them to the one module that
uses them, for the duration of the call:

1. the patched ``forward`` puts ``Pending(module, positions, mask)`` in the calling thread's context
   (``hfpatch._context.CALL.pending``) and calls the original; the slot is restored when it returns or
   raises (and carried into a layer's recomputation by activation checkpointing: :mod:`hfpatch._context`);
2. the receiver class (``Adapter.receiver``) is patched with the adapter: its method looks at the
   slot, and where it holds positions for this very module (``module is self``; for the relative bias,
   any layer of the call with at least the mask's keys), returns what it would return for them, by its
   family's ``hands_to``:

   - ``table``: the position table's rows ``weight[positions + offset]`` (BART's learned table with its
     offset of 2, Blenderbot's, Marian's and Pegasus's fixed sinusoids);
   - ``sinusoid``: the module's own sinusoid computed at the positions (Pegasus-X), called with the
     batch's positions as one row;
   - ``padded table``: ``weights[positions + padding_idx + 1]`` (M2M100, NLLB-MoE, SeamlessM4T,
     Speech2Text: the table starts past the pad id; the original still runs first, for the table's
     growth);
   - ``alibi``: the 2-D mask the positions come from, where the model (BLOOM) builds ALiBi from the mask
     it is given and hfpatch gives it a 4-D mask by sequence (a packed row);
   - ``relative bias``: each row's bias from its own positions, ``bias(key position - query
     position)``, gathered from one call of the release's own ``compute_bias`` over every offset the
     call can have (``1 x (2 * keys - 1)``), so that buckets and directions stay the release's; a
     static cache's columns past the mask (unwritten slots, masked by the model) count as padding.

A layer recomputed in the backward pass by activation checkpointing runs after the call that set the
slot has returned. transformers' own checkpoint function carries the slot into the recomputation
(:class:`hfpatch._context.CarryContext`); any other (torch's ``checkpoint_wrapper``, as FSDP and
accelerate apply it, a plain ``torch.utils.checkpoint`` of a block, DeepSpeed's) recomputes the layer
with its arguments only. So the relative-bias layer makes its bias from its arguments alone wherever
a recomputation could differ: with no slot in training mode (eager, the adapter patched in this
thread) it takes the hand-off from its own 4-D mask, whose last query row sees exactly the real keys
of the 2-D mask it was made from (causal or not; a row of pads only is masked whole), the same
positions the slot would hold; with a slot but no mask (no padding) it runs stock. Either way the
forward pass and any recomputation compute the same bias.

Elsewhere (no slot, another module, a shape that does not match), the original runs unchanged.
Compile-safe: a thread-local read, an identity test and shapes; no ``.item()``, no branch on tensor
values (dynamo traces the slot as a Python object: one graph, guarded on the slot being empty at entry).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch

from ._context import CALL, Pin, patched_here
from .declarations import ALIBI, PADDED_TABLE, RELATIVE_BIAS, SINUSOID, TABLE
from .patches import Patch
from .positions import new_token_positions, positions_from_mask

__all__ = ["HANDS_TO", "Pending", "Receiver", "call_with_positions", "receiver"]


class Pending(NamedTuple):
    """Positions derived by a patched forward, waiting for the module that uses them."""

    module: Any  # the position module that takes them; None: any relative-bias layer of the call
    positions: torch.Tensor  # [batch, new] int64: the new tokens' positions
    mask: torch.Tensor  # [batch, past + new]: the 2-D mask they come from (the relative bias reads keys')


def call_with_positions(
    model: Any, family: Any, original: Callable, kwargs: dict, mask: Optional[torch.Tensor]
) -> Any:
    """Call ``original`` with the positions the filler put in ``kwargs["position_ids"]`` handed to the
    model's position module (or relative bias) instead of passed: its forward takes none."""
    positions = kwargs.pop("position_ids", None) if mask is not None else None
    if positions is None:  # nothing derived (explicit position_ids, no mask, a 4-D mask): stock
        return original(model, **kwargs)
    where = family.position_module
    module = None if where is None else model if where == "" else getattr(model, where)
    before = CALL.pending
    CALL.pending = Pending(module, positions, mask)
    try:
        return original(model, **kwargs)
    finally:
        CALL.pending = before


# --- the receivers: one per ``Family.hands_to`` --------------------------------------------------


def _table(original: Callable) -> Callable:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        pending = CALL.pending
        if pending is None or pending.module is not self:
            return original(self, *args, **kwargs)
        return torch.nn.functional.embedding(pending.positions + getattr(self, "offset", 0), self.weight)

    return forward


def _sinusoid(original: Callable) -> Callable:
    def forward(self: Any, embeds: Any, *args: Any, **kwargs: Any) -> Any:
        pending = CALL.pending
        if pending is None or pending.module is not self:
            return original(self, embeds, *args, **kwargs)
        batch, new = pending.positions.shape
        row = embeds.reshape(1, batch * new, embeds.shape[-1])  # the batch's tokens as one row
        table = original(self, row, 0, pending.positions.reshape(-1, 1))
        return table.reshape(batch, new, -1)

    return forward


def _padded_table(original: Callable) -> Callable:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        pending = CALL.pending
        if pending is None or pending.module is not self:
            return original(self, *args, **kwargs)
        stock = original(self, *args, **kwargs)  # grows the table where the call needs it
        index = (pending.positions + (self.padding_idx + 1)).reshape(-1)
        return self.weights.index_select(0, index).view(*pending.positions.shape, -1).to(stock.dtype)

    return forward


def _alibi(original: Callable) -> Callable:
    def build_alibi_tensor(self: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        pending = CALL.pending
        if pending is None or pending.module is not self:
            return original(self, attention_mask, *args, **kwargs)
        return original(self, pending.mask, *args, **kwargs)  # (the model has a 4-D mask by sequence)

    return build_alibi_tensor


def _relative_bias(original: Callable) -> Callable:
    parameters = list(inspect.signature(original).parameters)
    if len(parameters) < 5:  # before 4.46: compute_bias(self, query_length, key_length, device)
        raise TypeError(f"{original.__qualname__} takes no offset of the first query (4.46+)")
    offset_name = parameters[4]  # past_seen_tokens (5.x), cache_position

    def compute_bias(
        self: Any, query_length: Any, key_length: Any, device: Any = None, *args: Any, **kw: Any
    ) -> Any:
        pending = CALL.pending
        if pending is None or pending.module is not None or key_length < pending.mask.shape[1]:
            return original(self, query_length, key_length, device, *args, **kw)
        keys, mask = key_length, pending.mask
        if keys > mask.shape[1]:  # a static cache's columns past a mask of past + new: unwritten slots
            mask = torch.nn.functional.pad(mask, (0, keys - mask.shape[1]))
        device = device if device is not None else self.relative_attention_bias.weight.device
        # one query at position keys - 1 against keys 0 .. 2 * keys - 2: the bias of every offset
        # -(keys - 1) .. keys - 1, by the release's own buckets
        at = keys - 1 if offset_name != "cache_position" else torch.full((1,), keys - 1, device=device)
        every = original(self, 1, 2 * keys - 1, device, **{offset_name: at})[0, :, 0]  # [heads, 2 * keys - 1]
        columns = positions_from_mask(mask).to(device)  # [batch, keys]
        queries = pending.positions.to(device)  # [batch, new]
        offsets = columns[:, None, :] - queries[:, :, None] + (keys - 1)  # [batch, new, keys]
        return every[:, offsets].permute(1, 0, 2, 3)  # [batch, heads, new, keys]

    return compute_bias


def _real_keys(mask: Any) -> Optional[torch.Tensor]:
    """The keys the last query of a layer's 4-D mask sees, ``[batch, keys]`` bool: the real tokens of the
    2-D mask it was made from (a causal row's last query sees every real key before it; a bidirectional
    row's every query does). None for no mask (no padding: the stock bias is the row's own)."""
    if type(mask).__name__ == "BlockMask":  # flex attention: its mask function at the last query
        batch, _, queries, keys = mask.shape
        rows = torch.arange(batch, device=mask.kv_num_blocks.device)[:, None]
        columns = torch.arange(keys, device=rows.device)[None, :]
        return mask.mask_mod(rows, torch.zeros_like(rows), torch.full_like(rows, queries - 1), columns)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    last = mask[:, 0, -1, :]
    return last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2  # additive


def _relative_bias_layer(original: Callable, pin: Pin) -> Callable:
    """The attention's ``forward``, so that a layer takes the same bias whether it runs in the forward
    pass or is recomputed with its arguments only (see the module's docstring):

    - the call's hand-off, where the layer's mask shows padding (none: the stock bias is the row's own,
      and the layer runs stock, as its recomputation will);
    - no hand-off, in training mode (eager) where the model is patched: the hand-off taken from the
      layer's own 4-D mask, in the forward pass as in a recomputation (reentrant checkpointing runs the
      forward pass without grad, so that is no sign).
    """
    parameters = list(inspect.signature(original).parameters)
    where = next((i for i, name in enumerate(parameters) if name in ("mask", "attention_mask")), None)
    if where is None:
        raise TypeError(f"{original.__qualname__} takes no mask")
    name = parameters[where]

    def forward(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        pending = CALL.pending
        if not self.has_relative_attention_bias or (pending is not None and pending.module is not None):
            return original(self, hidden_states, *args, **kwargs)
        training = self.training and not torch.compiler.is_compiling()
        if pending is None and not (training and patched_here(pin)):
            return original(self, hidden_states, *args, **kwargs)
        mask = args[where - 2] if len(args) > where - 2 else kwargs.get(name)  # after self, hidden_states
        if pending is not None and mask is not None:
            return original(self, hidden_states, *args, **kwargs)
        real = _real_keys(mask) if pending is None else None
        new = hidden_states.shape[1]
        CALL.pending = Pending(None, new_token_positions(real, new), real) if real is not None else None
        try:
            return original(self, hidden_states, *args, **kwargs)
        finally:
            CALL.pending = pending

    return forward


class Receiver(NamedTuple):
    """Where a family's positions are taken: the methods of the receiver class that are patched, each
    with how its replacement is made from the original and the adapter's pin, and whether they run
    inside a layer (then activation checkpointing must carry the hand-off into the layer's
    recomputation)."""

    methods: tuple[tuple[str, Callable[[Callable, Pin], Callable]], ...]
    inside_layers: bool = False


def _positions_only(make: Callable[[Callable], Callable]) -> Callable[[Callable, Pin], Callable]:
    return lambda original, pin: make(original)


HANDS_TO: dict[str, Receiver] = {
    TABLE: Receiver((("forward", _positions_only(_table)),)),
    SINUSOID: Receiver((("forward", _positions_only(_sinusoid)),)),
    PADDED_TABLE: Receiver((("forward", _positions_only(_padded_table)),)),
    ALIBI: Receiver((("build_alibi_tensor", _positions_only(_alibi)),)),
    RELATIVE_BIAS: Receiver(  # in the first layer (every layer: UMT5)
        (("compute_bias", _positions_only(_relative_bias)), ("forward", _relative_bias_layer)),
        inside_layers=True,
    ),
}


def receiver(owner: type, hands_to: str, pin: Pin) -> Optional[list[Patch]]:
    """The rows of ``owner`` (a receiver class): its methods that take handed positions; None where the
    class lacks one of its own; ``TypeError`` where a method is not the one the family's replacement
    calls."""
    found = []
    for name, make in HANDS_TO[hands_to].methods:
        original = owner.__dict__.get(name)
        if original is None:
            return None
        found.append(Patch(owner, name, original, functools.wraps(original)(make(original, pin))))
    return found
