"""The patched ``forward``: fill in what the caller left out, then call the original with keywords.

Rules, the same for every architecture and release (the target's :class:`~hfpatch.gates.Signature`
says which apply):

1. The cache may be passed as ``cache=`` or ``past_key_values=`` (or by position); it is handed on
   under the name the release uses. Both at once is a ``ValueError`` unless they are the same object.
2. ``position_ids`` missing and a 2-D ``attention_mask`` given: positions come from the mask
   (:func:`hfpatch.positions.new_token_positions`), over past + new tokens, so pads and the holes of a
   padded cached prefix are skipped. No mask or a 4-D mask: untouched.
3. ``cache_position`` missing on a release that has the parameter and a static cache: derived from
   the mask (mask length - new tokens) or the cache's fill level, never from the buggy
   ``.any()`` guess (transformers #30377) and without the 4.39-4.40 "required" error. Growing caches
   and tuples keep transformers' own (correct) derivation.
4. ``cache_position`` passed to a release that removed it (5.4+): it must name the slots the cache
   is about to write (checked in eager mode, ``ValueError`` otherwise); it locates the new tokens in a
   full-length mask, and with no mask it sets ``position_ids = cache_position[None]`` as 4.x did.
   It is not forwarded: those releases would swallow and ignore it.
5. Whatever the caller passed explicitly (``position_ids``, ``cache_position`` where the release has
   it) is forwarded unchanged.

Only shapes, Python facts about the arguments and tensor ops are used: the function traces under
``torch.compile(fullgraph=True)``. Value checks that need a device sync run in eager mode only.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from . import caches
from .gates import CACHE_NAMES, Adapter, Signature
from .positions import cache_positions, new_token_positions

__all__ = ["make_forward"]

Past = Union[int, torch.Tensor]  # cached tokens before this call: an int, or a 0-d tensor (static caches)


def make_forward(adapter: Adapter, original: Callable, sig: Signature) -> Callable:
    """Build the plain function installed as ``adapter``'s ``forward`` (no wrapt proxy: dynamo needs it)."""

    @functools.wraps(original)  # keeps __wrapped__, so inspect.signature shows the original parameters
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            _bind_positional(adapter, sig, args, kwargs)
        _complete(self, adapter, sig, kwargs)
        return original(self, **kwargs)

    forward.__hfpatch_adapter__ = adapter.arch  # type: ignore[attr-defined]
    return forward


def _bind_positional(adapter: Adapter, sig: Signature, args: tuple, kwargs: dict) -> None:
    if len(args) > len(sig.positional):
        raise TypeError(
            f"{adapter.cls}.forward() takes {len(sig.positional)} positional arguments after self "
            f"but {len(args)} were given"
        )
    for name, value in zip(sig.positional, args):
        if name in kwargs:
            raise TypeError(f"{adapter.cls}.forward() got multiple values for argument '{name}'")
        kwargs[name] = value


def _complete(model: Any, adapter: Adapter, sig: Signature, kwargs: dict) -> None:
    """Fill ``kwargs`` in place, following the rules in this module's docstring."""
    cache = _take_cache(sig, kwargs)
    mask = kwargs.get("attention_mask")
    cache_position = kwargs.get("cache_position")
    swallowed = cache_position is not None and not sig.has_cache_position and sig.has_var_kw
    if swallowed:
        del kwargs["cache_position"]
    # a 4-D mask, or a non-tensor one (a flex-attention BlockMask), is the caller's own: untouched
    derive_positions = (
        kwargs.get("position_ids") is None and isinstance(mask, torch.Tensor) and mask.dim() != 4
    )
    may_derive_slots = sig.has_cache_position and cache_position is None
    if not (derive_positions or may_derive_slots or swallowed):
        return
    static = cache if cache is not None else _attached_cache(model, adapter)
    capacity = caches.capacity(static)
    derive_slots = may_derive_slots and capacity is not None  # growing caches: transformers' own is right
    if not (derive_positions or derive_slots or swallowed):
        return
    if derive_slots and cache is not None and caches.one_buffer_for_all_layers(cache):
        raise ValueError(
            f"{sig.cache_kw}: transformers < 4.41 cannot run a StaticCache passed as the cache argument "
            "(all layers write one buffer; it fails or gives wrong logits even with cache_position). "
            "Attach it with model._setup_cache(StaticCache, batch_size, max_cache_len) and pass no cache, "
            "or use transformers >= 4.41"
        )
    tokens, rank = kwargs.get("input_ids"), 2
    if tokens is None:
        tokens, rank = kwargs.get("inputs_embeds"), 3
    if tokens is None or tokens.dim() != rank:
        return  # no inputs (transformers raises its own error), or GPT-2's [batch, choices, tokens]: stock
    batch, num_new = tokens.shape[0], tokens.shape[1]
    if derive_positions:
        _check_mask(mask, batch)
    mask_len = mask.shape[1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    if cache_position is not None and not swallowed:
        slots: Union[int, torch.Tensor] = cache_position  # the caller's, forwarded unchanged
    else:
        past = _past(static, capacity, num_new, mask_len, strict=derive_positions)
        slots = past if isinstance(past, int) else cache_positions(num_new, past)
        if derive_slots:
            kwargs["cache_position"] = cache_positions(num_new, past, tokens.device)
        if swallowed:
            if not torch.compiler.is_compiling():
                _check_swallowed(cache_position, cache_positions(num_new, past, tokens.device))
            slots = cache_position
            if mask is None and kwargs.get("position_ids") is None:
                kwargs["position_ids"] = cache_position.reshape(1, -1)
    if derive_positions:
        kwargs["position_ids"] = new_token_positions(mask, num_new, slots)


def _take_cache(sig: Signature, kwargs: dict) -> Any:
    """Pop the cache from either name and put it back under the release's name."""
    caches_given = [kwargs.pop(name) for name in CACHE_NAMES if name in kwargs]
    caches_given = [c for c in caches_given if c is not None]
    if len(caches_given) == 2 and caches_given[0] is not caches_given[1]:
        raise ValueError(
            "got two different caches, `cache=` and `past_key_values=`: pass one "
            f"(this release calls it `{sig.cache_kw}`)"
        )
    cache = caches_given[0] if caches_given else None
    if cache is not None:
        kwargs[sig.cache_kw] = cache
    return cache


def _attached_cache(model: Any, adapter: Adapter) -> Any:
    """The static cache at ``adapter.attached_cache`` on the model (4.38-4.40 ``_setup_cache``), if any."""
    if adapter.attached_cache is None:
        return None
    obj = model
    for part in adapter.attached_cache.split("."):
        obj = getattr(obj, part, None) if not part.isdigit() else _index(obj, int(part))
        if obj is None:
            return None
    return obj


def _index(seq: Any, i: int) -> Any:
    try:
        return seq[i]
    except (TypeError, IndexError, KeyError):
        return None


def _check_mask(mask: torch.Tensor, batch: int) -> None:
    if mask.dim() != 2:
        raise ValueError(
            "attention_mask must be 2-D [batch, past + new tokens] (or a 4-D custom mask), "
            f"got shape {tuple(mask.shape)}"
        )
    if mask.shape[0] != batch:
        raise ValueError(f"attention_mask has batch size {mask.shape[0]}, but the inputs have {batch}")


def _past(cache: Any, capacity: Optional[int], num_new: int, mask_len: Optional[int], strict: bool) -> Past:
    """Cached tokens before this call, as the cache will see them when it writes.

    ``strict``: positions will be read from the mask, so its length must be one that transformers
    accepts: past + new tokens, or a static cache's full capacity.
    """
    if capacity is None:  # no cache, a tuple or a growing cache: an exact Python int
        past = caches.past_length(cache)
        if strict and mask_len != past + num_new:
            raise ValueError(
                f"attention_mask has {mask_len} columns, but the cache holds {past} tokens and {num_new} "
                f"are new: expected {past + num_new} (past + new tokens)"
            )
        return past
    if mask_len is not None and mask_len != capacity:
        if not num_new <= mask_len <= capacity:
            if not strict:
                return caches.fill_level(cache)
            raise ValueError(
                f"attention_mask has {mask_len} columns, but the static cache has {capacity} slots and "
                f"{num_new} tokens are new: expected past + new tokens (at most {capacity}) or {capacity}"
            )
        past = mask_len - num_new  # a mask of past + new tokens says exactly where the new ones go
        counter = caches.exact_fill_level(cache)
        if counter is not None and not torch.compiler.is_compiling() and int(counter) != past:
            raise ValueError(
                f"attention_mask has {mask_len} columns for {num_new} new tokens, so {past} cached ones, "
                f"but the static cache holds {int(counter)}: expected {int(counter) + num_new} columns "
                f"(past + new tokens) or {capacity} (the cache's full length)"
            )
        return past
    return caches.fill_level(cache)


def _check_swallowed(cache_position: torch.Tensor, expected: torch.Tensor) -> None:
    given = cache_position.reshape(-1).to(expected.device)
    if given.shape != expected.shape or not torch.equal(given, expected):
        raise ValueError(
            f"cache_position {given.tolist()} contradicts the cache, which writes these tokens at "
            f"{expected.tolist()}; this transformers release has no cache_position parameter and "
            "places new tokens after the cached ones, so pass the slots it uses or leave it out"
        )
