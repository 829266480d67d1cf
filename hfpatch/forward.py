"""The patched ``forward``: fill in what the caller left out, then call the original with keywords.

Rules, the same for every architecture and release (the target's :class:`~hfpatch.gates.Plan`
says which apply):

1. The cache may be passed as ``cache=`` or ``past_key_values=`` (or by position); it is handed on
   under the name the release uses, or under the caller's old name where the release still takes it
   (5.24's ``past_key_values``: transformers then gives its own deprecation warning). Both at once is
   a ``ValueError`` unless they are the same object.
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
from .gates import CACHE_NAMES, Adapter, Plan
from .positions import cache_positions, new_token_positions

__all__ = ["make_forward"]

Past = Union[int, torch.Tensor]  # cached tokens before this call: an int, or a 0-d tensor (static caches)


def make_forward(adapter: Adapter, original: Callable, plan: Plan) -> Callable:
    """Build the plain function installed as ``adapter``'s ``forward`` (no wrapt proxy: dynamo needs it).

    What the signature says is in ``plan``, read once at install time; the per-call path binds
    positional arguments, renames the cache, exits early when there is nothing to fill in, and fills in.
    """
    cache_kw, slots_param, swallows = plan.cache_kw, plan.has_cache_position, plan.swallows_cache_position
    eager_mask_attr, old_cache_kw = plan.eager_mask_attr, plan.old_cache_kw

    @functools.wraps(original)  # keeps __wrapped__, so inspect.signature shows the original parameters
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            _bind_positional(adapter, plan, args, kwargs)
        cache = _take_cache(cache_kw, old_cache_kw, kwargs) if cache_kw is not None else None
        mask = kwargs.get("attention_mask")
        # a 4-D mask, or a non-tensor one (a flex-attention BlockMask), is the caller's own: untouched
        derive_positions = (
            kwargs.get("position_ids") is None and isinstance(mask, torch.Tensor) and mask.dim() != 4
        )
        given_slots = kwargs.get("cache_position")
        swallowed = swallows and given_slots is not None
        if swallowed:
            del kwargs["cache_position"]
        # slots_param: the 4.38-5.3 era, where a static cache's slots are derived (missing) or counted
        if derive_positions or slots_param or swallowed:
            _fill(self, adapter, kwargs, cache, given_slots, derive_positions, slots_param, swallowed)
        if eager_mask_attr is not None and derive_positions and _continues_a_prefix(kwargs, mask):
            return _with_eager_mask(self, eager_mask_attr, original, kwargs)
        return original(self, **kwargs)

    forward.__hfpatch_adapter__ = adapter.arch  # type: ignore[attr-defined]
    return forward


def _continues_a_prefix(kwargs: dict, mask: torch.Tensor) -> bool:
    """Several new tokens after a cached prefix (the calls 4.36-4.37's SDPA mask code gets wrong)."""
    tokens = kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    return tokens is not None and mask.dim() == 2 and 1 < tokens.shape[1] < mask.shape[1]


def _with_eager_mask(model: Any, attribute: str, original: Callable, kwargs: dict) -> Any:
    """Call ``original`` with the model's SDPA mask switch off (see ``Adapter.eager_mask``)."""
    if not getattr(model, attribute, False):
        return original(model, **kwargs)
    setattr(model, attribute, False)
    try:
        return original(model, **kwargs)
    finally:
        setattr(model, attribute, True)


def _bind_positional(adapter: Adapter, plan: Plan, args: tuple, kwargs: dict) -> None:
    if len(args) > len(plan.positional):
        raise TypeError(
            f"{adapter.cls}.forward() takes {len(plan.positional)} positional arguments after self "
            f"but {len(args)} were given"
        )
    for name, value in zip(plan.positional, args):
        if name in kwargs:
            raise TypeError(f"{adapter.cls}.forward() got multiple values for argument '{name}'")
        kwargs[name] = value


def _take_cache(cache_kw: str, old_cache_kw: Optional[str], kwargs: dict) -> Any:
    """Pop the cache from either name and put it back under the release's name, or under the old
    name the caller used where the release still takes it (so that its own warning reaches them)."""
    new, old = kwargs.pop(CACHE_NAMES[0], None), kwargs.pop(CACHE_NAMES[1], None)
    if new is not None and old is not None and new is not old:
        raise ValueError(
            "got two different caches, `cache=` and `past_key_values=`: pass one "
            f"(this release calls it `{cache_kw}`)"
        )
    cache = new if new is not None else old
    if cache is not None:
        kwargs[old_cache_kw if new is None and old_cache_kw == CACHE_NAMES[1] else cache_kw] = cache
    return cache


def _fill(
    model: Any,
    adapter: Adapter,
    kwargs: dict,
    cache: Any,
    given_slots: Optional[torch.Tensor],
    derive_positions: bool,
    slots_param: bool,
    swallowed: bool,
) -> None:
    """Fill ``kwargs`` in place, following the rules in this module's docstring."""
    static = cache if cache is not None else _attached_cache(model, adapter.family.attached_cache)
    capacity = caches.capacity(static)
    counted = slots_param and capacity is not None and caches.exact_fill_level(static) is None
    derive_slots = counted and given_slots is None  # growing caches: transformers' own slots are right
    if not (derive_positions or counted or swallowed):
        return
    if derive_slots and cache is not None and caches.one_buffer_for_all_layers(cache):
        raise ValueError(
            "past_key_values: transformers < 4.41 cannot run a StaticCache passed as the cache argument "
            "(all layers write one buffer; it fails or gives wrong logits even with cache_position). "
            "Attach it with model._setup_cache(StaticCache, batch_size, max_cache_len) and pass no cache, "
            "or use transformers >= 4.41"
        )
    tokens, rank = kwargs.get("input_ids"), 2
    if tokens is None:
        tokens, rank = kwargs.get("inputs_embeds"), 3
    if tokens is None or tokens.dim() != rank:
        return  # no inputs (transformers raises its own error), or GPT-2's [batch, choices, tokens]: stock
    mask = kwargs.get("attention_mask")
    batch, num_new = tokens.shape[0], tokens.shape[1]
    if derive_positions:
        _check_mask(mask, batch)
    mask_len = mask.shape[1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    slots: Union[int, torch.Tensor]
    if given_slots is not None and not swallowed:
        slots = given_slots  # the caller's, forwarded unchanged
        if counted:
            caches.count_written(static, given_slots.reshape(-1)[-1] + 1, tokens.device)
    else:
        if capacity is None:
            past: Past = _growing_past(static, num_new, mask_len if derive_positions else None)
        else:
            past = _static_past(static, capacity, num_new, mask_len, derive_positions)
        if isinstance(past, int):
            slots = past
        else:  # a static cache's fill level, a 0-d tensor: one new token's slot is the level itself
            slots = past.reshape(1) if num_new == 1 else cache_positions(num_new, past)
        if derive_slots:
            kwargs["cache_position"] = cache_positions(num_new, past, tokens.device)
        if counted:
            caches.count_written(static, past + num_new, tokens.device)
        if swallowed:
            if not torch.compiler.is_compiling():
                _check_swallowed(given_slots, cache_positions(num_new, past, tokens.device))
            slots = given_slots
            if mask is None and kwargs.get("position_ids") is None:
                kwargs["position_ids"] = given_slots.reshape(1, -1)
    if derive_positions:
        kwargs["position_ids"] = new_token_positions(mask, num_new, slots)


def _attached_cache(model: Any, path: Optional[str]) -> Any:
    """The static cache at ``path`` on the model (4.38-4.40 ``_setup_cache``), if any."""
    if path is None:
        return None
    obj = model
    for part in path.split("."):
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


def _growing_past(cache: Any, num_new: int, mask_len: Optional[int]) -> int:
    """Tokens in a growing cache (or a tuple, or none); ``mask_len`` given: it must be past + new."""
    past = caches.past_length(cache)
    if mask_len is not None and mask_len != past + num_new:
        raise ValueError(
            f"attention_mask has {mask_len} columns, but the cache holds {past} tokens and {num_new} "
            f"are new: expected {past + num_new} (past + new tokens)"
        )
    return past


def _static_past(cache: Any, capacity: int, num_new: int, mask_len: Optional[int], strict: bool) -> Past:
    """Where a static cache writes next. A mask of past + new tokens says it exactly; with a full-length
    mask or none, the cache's own fill level does. ``strict`` (positions are read from the mask): any
    other mask length is a ``ValueError``; otherwise the mask is only used when it says past + new."""
    if mask_len is None or mask_len == capacity:
        return caches.fill_level(cache)
    if num_new <= mask_len < capacity:
        past = mask_len - num_new
        _check_counter(cache, capacity, past, num_new, mask_len)
        return past
    if strict:
        raise ValueError(
            f"attention_mask has {mask_len} columns, but the static cache has {capacity} slots and "
            f"{num_new} tokens are new: expected past + new tokens (at most {capacity}) or {capacity}"
        )
    return caches.fill_level(cache)


def _check_counter(cache: Any, capacity: int, past: int, num_new: int, mask_len: int) -> None:
    """Eager mode, where the cache keeps an exact counter (5.4+): the mask must agree with it."""
    counter = caches.exact_fill_level(cache)
    if counter is not None and not torch.compiler.is_compiling() and int(counter) != past:
        raise ValueError(
            f"attention_mask has {mask_len} columns for {num_new} new tokens, so {past} cached ones, "
            f"but the static cache holds {int(counter)}: expected {int(counter) + num_new} columns "
            f"(past + new tokens) or {capacity} (the cache's full length)"
        )


def _check_swallowed(cache_position: torch.Tensor, expected: torch.Tensor) -> None:
    given = cache_position.reshape(-1).to(expected.device)
    if given.shape != expected.shape or not torch.equal(given, expected):
        raise ValueError(
            f"cache_position {given.tolist()} contradicts the cache, which writes these tokens at "
            f"{expected.tolist()}; this transformers release has no cache_position parameter and "
            "places new tokens after the cached ones, so pass the slots it uses or leave it out"
        )
