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
   - ``relative bias``: each row's bias from its own positions, ``bias(key position - query
     position)``, gathered from one call of the release's own ``compute_bias`` over every offset the
     call can have (``1 x (2 * keys - 1)``), so that buckets and directions stay the release's; a
     static cache's columns past the mask (unwritten slots, masked by the model) count as padding.

Elsewhere (no slot, another module, a shape that does not match), the original runs unchanged.
Compile-safe: a thread-local read, an identity test and shapes; no ``.item()``, no branch on tensor
values (dynamo traces the slot as a Python object: one graph, guarded on the slot being empty at entry).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple, Optional

import torch

from ._context import CALL
from .declarations import PADDED_TABLE, RELATIVE_BIAS, SINUSOID, TABLE
from .positions import positions_from_mask

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
    module = getattr(model, family.position_module) if family.position_module is not None else None
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


class Receiver(NamedTuple):
    """Where a family's positions are taken: the method of the receiver class that is patched, how its
    replacement is made from the original, and whether it runs inside a layer (then activation
    checkpointing must carry the hand-off into the layer's recomputation)."""

    method: str
    make: Callable[[Callable], Callable]
    inside_layers: bool = False


HANDS_TO: dict[str, Receiver] = {
    TABLE: Receiver("forward", _table),
    SINUSOID: Receiver("forward", _sinusoid),
    PADDED_TABLE: Receiver("forward", _padded_table),
    RELATIVE_BIAS: Receiver("compute_bias", _relative_bias, inside_layers=True),  # in the first layer
}


def receiver(owner: type, hands_to: str) -> Optional[tuple[str, Callable, Callable]]:
    """The method of ``owner`` (a receiver class) that takes handed positions: (name, original,
    replacement); None where the class has no such method of its own; ``TypeError`` where the method
    is not the one the family's replacement calls."""
    name, make, _ = HANDS_TO[hands_to]
    original = owner.__dict__.get(name)
    if original is None:
        return None
    return name, original, functools.wraps(original)(make(original))
