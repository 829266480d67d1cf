"""What a KV cache object says about its length, on every transformers release from 4.20 on.

Three families, told apart by what the object has, never by the release number:

- legacy tuples ``((k, v), ...)`` (all releases up to 4.47 for Llama/Gemma, 4.57 for GPT-2): the length
  is the key's sequence dimension, a Python int;
- growing ``Cache`` objects (``DynamicCache`` and friends, 4.36+): ``get_seq_length()``, a Python int;
- static caches (``StaticCache``, 4.38+): a fixed capacity (a Python int, read once per cache) and a
  fill level that is a tensor. 5.4+ keeps an exact counter (``cumulative_length``); 4.38-5.3 guessed
  it from the key contents, wrong when the newest keys are zero. There hfpatch keeps a counter of its
  own on the cache object (:func:`count_written`), which the cache's ``reset()`` clears; only a cache
  it has never seen written has its keys read (:func:`hfpatch.positions.static_fill_level`).
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any, Optional, Union

import torch

from ._compat import cache_utils
from .patches import Patch
from .positions import static_fill_level

__all__ = [
    "MaskDoesNotFit",
    "attends",
    "capacity",
    "growing_past",
    "count_written",
    "exact_fill_level",
    "fill_level",
    "first_layer_keys",
    "keep_whole_window",
    "lay_back",
    "may_read",
    "padded_states",
    "one_buffer_for_all_layers",
    "own",
    "past",
    "past_length",
    "recount",
    "recording_requested_lengths",
]

COUNTER = "_hfpatch_written"  # on a 4.38-5.3 static cache: one past the last slot hfpatch saw written
CAPACITY = "_hfpatch_capacity"  # on a cache object: its number of slots, or 0 for a cache that grows
REQUESTED = "_hfpatch_requested"  # on a static sliding-window layer: the cache's length it was asked for


def past_length(cache: Any) -> int:
    """Tokens held by a legacy tuple or a growing cache (not a static one); 0 for ``None``."""
    if cache is None:
        return 0
    if isinstance(cache, (tuple, list)):
        if len(cache) == 0 or cache[0] is None or cache[0][0] is None:
            return 0
        return int(cache[0][0].shape[-2])
    try:
        return int(seen(cache))
    except ValueError:  # (5.24: a cache of state layers alone counts no tokens: hfpatch.mixers)
        held = _state_only(cache)
        return 1 if held is None else held  # (holding a state, of a length not known: not empty)


def seen(cache: Any) -> Any:
    """Tokens a growing ``Cache`` object holds, as transformers counted them up to 5.24: its first
    attention layer's count where it has layers and its first is a state layer's (5.25 counts on that
    one: a 0-d tensor, a host read for hfpatch; and 0 for RecurrentGemma's, whose layers keep their
    states on themselves), else ``get_seq_length()``."""
    layers = getattr(cache, "layers", None)
    if layers and not attends(layers[0]):
        counted = next((layer.get_seq_length() for layer in layers if attends(layer)), None)
        if counted is not None:
            return counted
    return cache.get_seq_length()


def recount_unwritten(cache: Any) -> None:
    """5.18-5.22 and 5.25 read a cache's count (the positions of a call without them, its attention mask's
    size and offset) on its first layer: where that is a layer the model never writes (RecurrentGemma keeps
    its states on its own layers), it counts 0 and every continued call is taken as a first. 5.18-5.22 make
    it an attention layer: it reads its count on a written one (5.12-5.17's model had the cache do so
    itself); 5.25 a state layer: its count set to what the attention layers hold (an int: no host read)."""
    layers = getattr(cache, "layers", None)
    if not layers or torch.compiler.is_compiling():
        return
    if attends(layers[0]):
        _recount_unwritten_attention(layers)
        return
    counted = seen(cache)
    if not isinstance(counted, int):
        return
    for layer in layers:
        count = getattr(layer, "cumulative_length_linear", None)
        written = (
            getattr(layer, flag, None) for flag in ("is_conv_states_initialized", "has_previous_state")
        )
        if isinstance(count, torch.Tensor) and not any(
            any(f.values()) for f in written if isinstance(f, dict)
        ):
            count.fill_(counted)


def _recount_unwritten_attention(layers: Any) -> None:
    """5.18-5.22: each attention layer no call writes (its keys never set) reads its count and mask sizes
    on the first written one, as 5.12-5.17's model had the cache read them."""
    written = next((layer for layer in layers if attends(layer) and layer.keys is not None), None)
    if written is None:
        return
    for layer in layers:
        if attends(layer) and layer.keys is None and "get_seq_length" not in vars(layer):
            layer.get_seq_length, layer.get_mask_sizes = written.get_seq_length, written.get_mask_sizes


def growing_past(cache: Any) -> Optional[int]:
    """Tokens held by no cache (0), a legacy tuple or a growing cache (one :func:`capacity` has read:
    every call after the first); None for any other (a static cache, or one not read yet)."""
    if cache is None:
        return 0
    if cache.__class__ is tuple or cache.__class__ is list:
        return past_length(cache)
    try:
        grows = cache.__dict__[CAPACITY] == 0
    except (AttributeError, KeyError):
        return None
    return int(seen(cache)) if grows else None


def capacity(cache: Any) -> Optional[int]:
    """Fixed number of slots of a static cache; ``None`` for a cache that grows (or no cache). Read from
    the cache's layers once, then kept on the cache object (eager mode)."""
    if cache is None or isinstance(cache, (tuple, list)):
        return None
    size = getattr(cache, CAPACITY, None)
    if size is None:
        size = _read_capacity(cache)
        if not torch.compiler.is_compiling():
            setattr(cache, CAPACITY, size)
    return size or None


def _read_capacity(cache: Any) -> int:
    cache = own(cache)
    layers = _layers(cache)
    if layers is not None:  # sliding-window layers hold fewer slots: the cache's length is the longest
        layers = [layer for layer in layers if attends(layer)]  # (not a state layer's, nor a dummy)
        if not len(layers) or getattr(layers[0], "max_cache_len", None) is None:
            return 0  # growing layers (DynamicCache, whose layers may be added later)
        size = 0
        for layer in layers:  # a plain loop: dynamo cannot trace max() over a generator
            layer_size = getattr(layer, REQUESTED, getattr(layer, "max_cache_len", None))
            size = layer_size if isinstance(layer_size, int) and layer_size > size else size
    else:
        size = getattr(cache, "max_cache_len", None)  # StaticCache 4.38-4.53
    return size if isinstance(size, int) and size > 0 else 0


def exact_fill_level(cache: Any) -> Optional[Union[int, torch.Tensor]]:
    """The static cache's own counter (``cumulative_length``, 5.4+), or ``None`` where it keeps none."""
    layers = _layers(cache)
    counter = _first_layer_attr(layers, "cumulative_length") if layers is not None else None
    return cache.get_seq_length() if isinstance(counter, torch.Tensor) else None


def fill_level(cache: Any) -> Union[int, torch.Tensor]:
    """Filled slots of a static cache, in one call: its own counter (5.4+); on 4.38-5.3 hfpatch's count
    (a 0-d tensor) where it keeps one, and for a cache it has never seen written, one past the last slot
    written in the first layer's keys (0 before the first write). Only that first read costs time
    proportional to the cache's length."""
    level = exact_fill_level(cache)
    if level is not None:
        return level
    counter = getattr(cache, COUNTER, None)
    if counter is not None:
        return counter
    keys = first_layer_keys(cache)
    return 0 if keys is None else static_fill_level(keys)


class MaskDoesNotFit(ValueError):
    """A 2-D mask whose length fits neither the cache's tokens plus the new ones nor a static cache's
    full length (the patched forward leaves such a call to stock, saying why)."""


def past(cache: Any, num_new: int, mask_len: Optional[int], strict: bool) -> Union[int, torch.Tensor]:
    """The one read of a cache's fill level for a call: tokens cached before it (an int), or where a
    static cache writes next (an int, or a 0-d tensor). For a static cache a mask of past + new tokens
    says it exactly (checked against the cache's own counter where it keeps one, 5.4+, and may be read);
    a full-length mask or none leaves it to :func:`fill_level`. ``strict`` (positions are read from
    the mask): any other mask length is a :class:`MaskDoesNotFit`; otherwise the mask is only used where
    it says past + new."""
    size = capacity(cache)
    if size is None:
        held = past_length(cache)
        if strict and mask_len != held + num_new:
            new = "1 is" if num_new == 1 else f"{num_new} are"
            raise MaskDoesNotFit(
                f"attention_mask has {mask_len} columns, but the cache holds {held} tokens and {new} new: "
                f"expected {held + num_new} (past + new tokens)"
            )
        return held
    if mask_len is not None and mask_len != size:
        if num_new <= mask_len < size:
            held = mask_len - num_new
            counter = exact_fill_level(cache)
            if counter is not None and may_read(counter) and int(counter) != held:
                raise MaskDoesNotFit(
                    f"attention_mask has {mask_len} columns for {num_new} new tokens, so {held} cached ones, "
                    f"but the static cache holds {int(counter)}: expected {int(counter) + num_new} columns "
                    f"(past + new tokens) or {size} (the cache's full length)"
                )
            return held
        if strict:
            raise MaskDoesNotFit(
                f"attention_mask has {mask_len} columns, but the static cache has {size} slots and "
                f"{num_new} tokens are new: expected past + new tokens (at most {size}) or {size}"
            )
    return fill_level(cache)


def may_read(tensor: Any) -> bool:
    """Whether an eager check may read ``tensor``'s values: on the CPU, where that is free. On an
    accelerator it would wait for the device at every call, so the check is left out there (and in
    traced code)."""
    if torch.compiler.is_compiling():
        return False
    return not isinstance(tensor, torch.Tensor) or tensor.device.type == "cpu"


def count_written(cache: Any, end: Union[int, torch.Tensor], device: torch.device) -> None:
    """Record that a 4.38-5.3 static cache is filled up to slot ``end`` (exclusive) after this call.

    The counter is a 0-d tensor made in eager mode, updated in place (so a compiled decode loop
    keeps one graph), and cleared by the cache's ``reset()``: the cache gets a ``reset`` of its own
    that clears it, then runs its class's."""
    counter = getattr(cache, COUNTER, None)
    if counter is None:
        if torch.compiler.is_compiling():
            return  # started by an eager call: the first one with this cache (a prefill, usually)
        counter = torch.zeros((), dtype=torch.long, device=device)
        torch._dynamo.mark_static_address(counter)  # updated in place: CUDA graphs keep its address
        setattr(cache, COUNTER, counter)
        if callable(getattr(type(cache), "reset", None)):
            cache.reset = types.MethodType(_reset_and_clear, cache)
    if isinstance(end, torch.Tensor):
        counter.copy_(end.reshape(()))
    else:
        counter.fill_(end)


def recount(cache: Any, cache_position: torch.Tensor) -> None:
    """A call that passed its own ``cache_position`` (and ``position_ids``): a count hfpatch keeps on
    this cache follows it; a cache it does not count costs nothing."""
    counter = getattr(cache, COUNTER, None)
    if counter is not None:
        counter.copy_(cache_position.reshape(-1)[-1] + 1)


def _reset_and_clear(self: Any) -> Any:
    """The ``reset`` of a cache hfpatch counts: clear the count, then the class's own reset. A bound
    method (not a closure), so that a deep copy of the cache resets its own count."""
    counter = self.__dict__.get(COUNTER)
    if counter is not None:
        counter.zero_()
    return type(self).reset(self)


_reset_and_clear.__name__ = "reset"  # what the instance attribute is called (pickling looks it up)


def keep_whole_window(cache: Any) -> bool:
    """Swap a cache's sliding (and chunked) layers for full ones while they have dropped nothing, so
    that every key inside a window by position stays (see :mod:`hfpatch.windows`). Python checks of
    object types only. False for a cache whose sliding layers this does not handle (4.45-4.53's
    ``SlidingWindowCache``, ``HybridCache``...); a layer that has already dropped keys stays as it is."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # 4.53 and older: a growing or static cache keeps every column
        return isinstance(cache, (tuple, list)) or type(cache).__name__ in ("DynamicCache", "StaticCache")
    dynamic = getattr(cache_utils, "DynamicSlidingWindowLayer", None)
    static = _static_sliding_layer()
    for i, layer in enumerate(layers):
        if dynamic is not None and type(layer) is dynamic and layer.cumulative_length < layer.sliding_window:
            whole = cache_utils.DynamicLayer()
            whole.__dict__.update((k, v) for k, v in vars(layer).items() if k in vars(whole) or k in _SETUP)
            layers[i] = whole
        elif static is not None and isinstance(layer, static) and not _initialized(layer):
            requested = getattr(layer, REQUESTED, layer.max_cache_len)
            if requested > layer.max_cache_len:
                layers[i] = cache_utils.StaticLayer(max_cache_len=requested)
    return True


def padded_states(states: torch.Tensor, index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """One layer's keys or values of a packed row ``[1, heads, tokens, dim]`` (``index``: where each token
    sits in the padded batch) as the batch's ``[batch, heads, length, dim]``, zeros at the pads."""
    flat = states[0, :, : len(index)].transpose(0, 1)
    out = flat.new_zeros(batch * length, *flat.shape[1:]).index_copy(0, index, flat)
    return out.view(batch, length, *flat.shape[1:]).transpose(1, 2)


def lay_back(cache: Any, index: torch.Tensor, batch: int, length: int) -> None:
    """A growing cache filled by one packed row of a padded batch's real tokens (``index``: their flat
    numbers over ``batch x length``; a packed row may hold one token more, after them) laid back into the
    batch's rows, in place, zeros at the pads: a later call continues it with the padded 2-D mask. Its
    layers' keys and values (4.54+), or its lists of them (4.36-4.53, and the hybrid caches of 5.2-5.4,
    whose lists hold None at a linear-attention layer)."""

    def padded(states: Any) -> Any:  # a layer without keys (None, or a state layer's) as it is
        if isinstance(states, torch.Tensor) and states.dim() == 4 and states.shape[0] == 1:
            return padded_states(states, index, batch, length)
        return states

    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            if isinstance(getattr(layer, "keys", None), torch.Tensor):
                layer.keys, layer.values = padded(layer.keys), padded(layer.values)
    elif isinstance(getattr(cache, "key_cache", None), list):
        cache.key_cache[:] = [padded(k) for k in cache.key_cache]
        cache.value_cache[:] = [padded(v) for v in cache.value_cache]
    if isinstance(getattr(cache, "_seen_tokens", None), int):
        cache._seen_tokens = length
    for layer in layers or ():  # state layers (hfpatch.mixers wrote their rows already): the padded count
        count = getattr(layer, "cumulative_length_linear", None)
        if isinstance(count, torch.Tensor):
            count.fill_(length)
    if getattr(cache, SEEN, None) is not None:
        setattr(cache, SEEN, length)


def _static_sliding_layer() -> Optional[type]:
    """The static cache's sliding layer class: ``StaticSlidingWindowLayer`` (4.57+), before it
    ``SlidingWindowLayer``, a ``StaticLayer`` (4.54-4.56; chunked layers subclass it)."""
    layer = getattr(cache_utils, "StaticSlidingWindowLayer", None) or getattr(
        cache_utils, "SlidingWindowLayer", None
    )
    static = getattr(cache_utils, "StaticLayer", None)
    return layer if static is not None and layer is not None and issubclass(layer, static) else None


def _initialized(layer: Any) -> bool:
    return getattr(layer, "is_initialized", getattr(layer, "keys", None) is not None)


_SETUP = ("dtype", "device")  # what a layer's lazy initialization sets besides keys and values


def recording_requested_lengths() -> Optional[Patch]:
    """While hfpatch is installed, a static cache's sliding layer (4.54+) records the cache length it was
    asked for (it keeps only ``min(window, length)`` slots and forgets it): the cache's capacity, and
    the full layer :func:`keep_whole_window` puts in its place. The row replacing the layer's
    ``__init__``, or None on releases without such a layer."""
    layer = _static_sliding_layer()
    if layer is None or "__init__" not in layer.__dict__:
        return None
    init = layer.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self: Any, max_cache_len: int, *args: Any, **kwargs: Any) -> None:
        init(self, max_cache_len, *args, **kwargs)
        setattr(self, REQUESTED, max_cache_len)

    return Patch(layer, "__init__", init, __init__)


def one_buffer_for_all_layers(cache: Any) -> bool:
    """A 4.38-4.40 ``StaticCache``: a single key tensor, meant to be attached to one layer by
    ``model._setup_cache``. Passed as the model's cache argument, every layer writes the same buffer."""
    return _layers(cache) is None and isinstance(getattr(cache, "key_cache", None), torch.Tensor)


def first_layer_keys(cache: Any) -> Optional[torch.Tensor]:
    """The first layer's key tensor ``[batch, heads, slots, dim]`` of any cache (a legacy tuple's too), or
    None."""
    if isinstance(cache, (tuple, list)):
        keys = cache[0][0] if len(cache) and cache[0] is not None else None
        return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None
    layers = _layers(cache)
    if layers is not None:
        return _first_layer_attr(layers, "keys")
    keys = getattr(cache, "key_cache", None)  # a tensor in 4.38-4.40, a list of tensors in 4.41-4.53
    if isinstance(keys, (list, tuple)):
        keys = keys[0] if len(keys) else None
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None


def _layers(cache: Any) -> Any:
    """A 4.54+ cache's per-layer objects, or ``None`` for an older cache. Where they exist, hfpatch
    reads only them: those releases keep cache-level properties (``key_cache`` in 4.54-4.55,
    ``max_cache_len`` in 5.13-5.19) that log a deprecation warning, which dynamo cannot trace."""
    return getattr(own(cache), "layers", None)


def own(cache: Any) -> Any:
    """A decoder's own cache: an ``EncoderDecoderCache``'s self-attention cache (its cross-attention one
    holds the encoder's keys). It has no ``layers`` itself, and 5.13-5.19 give it Cache's deprecated
    ``max_cache_len`` property, whose warning dynamo cannot trace."""
    inner = getattr(cache, "self_attention_cache", None)
    return inner if inner is not None else cache


def _first_layer_attr(layers: Any, name: str) -> Any:
    """``name`` of the first layer that holds keys (5.x's linear-attention layers hold a state alone)."""
    for layer in layers:  # (the first, but where a model's first layers carry a state or hold none)
        if attends(layer):
            return getattr(layer, name, None)
    return None


def attends(layer: Any) -> bool:
    """A cache layer that holds an attention's keys (not a state layer's states alone, nor a dummy)."""
    return hasattr(layer, "keys") and hasattr(layer, "get_seq_length")


# --- the states of layers that carry one from token to token (hfpatch.mixers) -------------------------

# a 5.x linear-attention cache layer's states: dicts ``{state index: tensor}`` (5.11+), single tensors
# before (5.5-5.10); and its flags (dicts or bools alike)
LAYER_STATES = ("conv_states", "recurrent_states")
LAYER_FLAGS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state")


def _linear_layer(cache: Any, layer: int) -> Any:
    """A 5.x cache's linear-attention layer object at ``layer`` (its states on it), or None."""
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list) and layer < len(layers):
        found = layers[layer]
        if hasattr(found, "conv_states") and hasattr(found, "has_previous_state"):
            return found
    return None


def _slots(holder: Any) -> list[Any]:
    """The keys of a layer's states or flags: a dict's (its state indices), or None for a single one."""
    return list(holder) if isinstance(holder, dict) else [None]


def _get(owner: Any, name: str, key: Any) -> Any:
    value = getattr(owner, name)
    return value[key] if isinstance(value, dict) else value


def _set(owner: Any, name: str, key: Any, value: Any) -> None:
    if isinstance(getattr(owner, name), dict):
        getattr(owner, name)[key] = value
    else:
        setattr(owner, name, value)


def group_cache(cache: Any, layer: int, source: Optional[torch.Tensor], size: int) -> Any:
    """A stand-in for ``cache`` that a mixer of layer ``layer`` reads and writes for one group of ``size``
    sequences (:mod:`hfpatch.mixers`): the same object but for that layer's states, which are the rows
    ``source`` of the cache's (each sequence continues its row) or fresh ones (None: each starts anew).
    None for a cache whose layer records its past (speculative decoding's rollback: its states grow)."""
    proxy = copy.copy(cache)
    own = _linear_layer(cache, layer)
    if own is not None:
        if getattr(own, "record_past", False):
            return None
        mine = copy.copy(own)
        mine.__dict__.update(
            (
                k,
                dict(v)
                if isinstance(v, dict)
                else v.clone()
                if isinstance(v, torch.Tensor) and not v.dim()
                else v,
            )
            for k, v in vars(own).items()
        )  # (its dicts, its 0-d count: its own)
        for name in LAYER_STATES:
            for key in _slots(getattr(mine, name, None)):
                state = _get(mine, name, key)
                fresh = source is None or not isinstance(state, torch.Tensor)
                _set(mine, name, key, None if fresh else state.index_select(0, source))
        if source is None:
            for name in LAYER_FLAGS:
                if hasattr(mine, name):
                    for key in _slots(getattr(mine, name)):
                        _set(mine, name, key, False)
        proxy.layers = [*cache.layers[:layer], mine, *cache.layers[layer + 1 :]]
        return proxy
    for name, states in _containers(cache, layer):
        state = states[layer]
        if isinstance(state, torch.Tensor) and state.dim() and state.shape[0]:  # (else: made at first use)
            fresh = source is None
            state = state.new_zeros(size, *state.shape[1:]) if fresh else state.index_select(0, source)
        if isinstance(states, torch.Tensor):  # (one tensor for every layer: only this layer's is read)
            mine = state.new_zeros(1, *state.shape).expand(len(states), *state.shape)  # (aliased: one layer)
        else:
            mine = dict(states) if isinstance(states, dict) else list(states)
        mine[layer] = state
        setattr(proxy, name, mine)
    if isinstance(vars(cache).get("has_previous_state"), bool):  # 4.x: one flag for the cache's states
        proxy.has_previous_state = source is not None
    return proxy


def is_state(value: Any) -> bool:
    """A state handed to a layer itself (RWKV's list of tensors, xLSTM's tuple): tensors, batch first."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(t, torch.Tensor) and t.dim() for t in value)
    )


def uncounted(cache: Any) -> bool:
    """A state handed on (RWKV's) or a cache that counts no tokens (xLSTM's): how much it holds not known."""
    return is_state(cache) or not hasattr(cache, "get_seq_length") and not isinstance(cache, (tuple, list))


def group_state(state: Any, source: Optional[torch.Tensor], size: int) -> Any:
    """A group's own copy of a handed ``state``: the rows ``source`` (each sequence continues its row), or
    fresh (None): zeros, what xLSTM's cache starts from; RWKV starts its running maximum at -1e30 instead, the
    same state up to rounding (its numerator and denominator are 0: the maximum only scales them)."""
    return type(state)(
        t.new_zeros(size, *t.shape[1:]) if source is None else t.index_select(0, source) for t in state
    )


def put_state(
    state: Any, final: Any, members: torch.Tensor, at: torch.Tensor, layer: Optional[int], rows: int
) -> Any:
    """The handed ``state`` (of ``rows`` rows: an unpadded call's padded batch, zeros where it had fewer)
    with the states a group's sequences ``members`` ended with (``final``) in its rows ``at``: of a tensor
    whose last axis holds every layer's (RWKV's), layer ``layer``'s. New tensors (autograd may hold the
    old ones), in the same list where it is one (RWKV's model goes on with the list it handed its layers)."""
    if final is None:
        return state
    made = []
    for current, ended in zip(state, final):
        chosen = ended.index_select(0, members).to(current.dtype)
        if current.shape[0] != rows:
            current = current.new_zeros(rows, *current.shape[1:])
        if isinstance(layer, int) and current.dim() >= 3 and layer < current.shape[-1] == ended.shape[-1]:
            current = current.clone()
            current[..., layer].index_copy_(0, at, chosen[..., layer])
        else:
            current = current.index_copy(0, at, chosen)
        made.append(current)
    if isinstance(state, list):
        state[:] = made
        return state
    return type(state)(made)


def copied(state: Any) -> Any:
    """A handed ``state``'s copy (a call without a real token: its pads move no state)."""
    return type(state)(t.clone() for t in state)


def _containers(cache: Any, layer: int) -> list[tuple[str, Any]]:
    """A 4.x (or early 5.x) cache's per-layer containers that hold an entry for ``layer``: its lists and
    dicts by layer index, or one tensor ``[layers, batch, ...]`` (4.45-4.48's Mamba caches) (``conv_states``,
    ``ssm_states``, ``recurrent_states``, ``conv_cache``,
    ``linear_cache`` ...: whichever the release's class keeps), not its attention's keys and values (a
    Zamba layer holds both: its shared attention's and its Mamba's)."""
    found = []
    for name, states in vars(cache).items():
        if name.startswith("_") or name in ("key_cache", "value_cache"):
            continue
        listed = isinstance(states, list) and layer < len(states)
        stacked = isinstance(states, torch.Tensor) and states.dim() >= 3 and layer < len(states)
        if listed or stacked or (isinstance(states, dict) and layer in states):
            found.append((name, states))
    return found


def layer_states(cache: Any, layer: int, size: int) -> dict[tuple[str, Any], torch.Tensor]:
    """The states of layer ``layer`` a (stand-in) cache holds for a group of ``size`` sequences, by where
    they go: ``(state name, state index or None)`` of a 5.x linear-attention layer, ``(container name,
    None)`` of an older cache's lists or dicts (what holds no row of the group, an attention's empty entry,
    is left)."""
    own = _linear_layer(cache, layer)
    found = {}
    if own is not None:
        for name in LAYER_STATES:
            for key in _slots(getattr(own, name, None)):
                state = _get(own, name, key)
                if isinstance(state, torch.Tensor) and state.dim() and state.shape[0] == size:
                    found[(name, key)] = state
        return found
    for name, states in _containers(cache, layer):
        state = states[layer]
        if isinstance(state, torch.Tensor) and state.dim() and state.shape[0] == size and state.numel():
            found[(name, None)] = state
    return found


def carry_flags(proxy: Any, cache: Any, layer: int) -> None:
    """What a layer set up on the stand-in of a cache that the cache lacks: a flag it raised where the cache
    keeps one for all its states (4.x and early 5.x: LFM2's conv layer says ``has_previous_state``
    itself); a 5.x linear-attention layer's settings its lazy initialization made (5.5-5.10's
    ``conv_kernel_size``, ``dtype``, ``device``: not its states, which :func:`put_states` writes)."""
    if vars(proxy).get("has_previous_state") is True and vars(cache).get("has_previous_state") is False:
        cache.has_previous_state = True
    mine, own = _linear_layer(proxy, layer), _linear_layer(cache, layer)
    if mine is not None and own is not None and mine is not own:
        for name, value in vars(mine).items():
            settled = not isinstance(value, (torch.Tensor, dict, list)) and value is not None
            if settled and name not in LAYER_STATES + LAYER_FLAGS and vars(own).get(name) is None:
                setattr(own, name, value)


def put_states(cache: Any, layer: int, kept: list, rows: int, tokens: int) -> None:
    """Write the states each group of sequences ended with (``kept``: ``(layer_states(...), members,
    cache rows)``) into ``cache``'s rows of layer ``layer`` (``rows`` of them: a state the cache has not
    made yet is made, zeros elsewhere), as the layer would have written them running the rows itself;
    a 5.x layer's flags, its kernel sizes, its count of tokens (``tokens`` more) too."""
    own = _linear_layer(cache, layer)
    for states, members, at in kept:
        for (name, key), state in states.items():
            chosen = state.index_select(0, members)
            if own is not None:
                current = _get(own, name, key)
            else:
                whole = getattr(cache, name)
                if isinstance(whole, torch.Tensor) and tuple(whole.shape[1:]) != (rows, *state.shape[1:]):
                    # (4.4x's MambaCache: every layer's in one tensor, made at an unpadded call's batch)
                    whole = whole.new_zeros(whole.shape[0], rows, *state.shape[1:])
                    setattr(cache, name, whole)
                current = whole[layer]
            if not isinstance(current, torch.Tensor) or tuple(current.shape) != (rows, *state.shape[1:]):
                current = state.new_zeros(rows, *state.shape[1:])
                if own is not None:
                    _set(own, name, key, current)
                else:
                    getattr(cache, name)[layer] = current
            current.index_copy_(0, at, chosen.to(current.dtype))
            if own is not None:
                for flag in LAYER_FLAGS:
                    if hasattr(own, flag) and (name[:4] in flag or flag == "has_previous_state"):
                        _set(own, flag, key, True)
    if own is None:
        return
    if isinstance(getattr(own, "cumulative_length_linear", None), torch.Tensor):
        own.cumulative_length_linear.add_(tokens)
    made = [(name, key, state) for states, _, _ in kept for (name, key), state in states.items()]
    if made and hasattr(own, "dtype") and getattr(own, "dtype", None) is None:
        own.dtype, own.device = made[0][2].dtype, made[0][2].device
    sizes = getattr(own, "conv_kernel_size", None)
    for name, key, state in made:
        if name == "conv_states" and isinstance(sizes, dict) and sizes.get(key) is None:
            sizes[key] = state.shape[-1]
        elif name == "conv_states" and hasattr(own, "conv_kernel_size") and sizes is None:
            own.conv_kernel_size = state.shape[-1]


SEEN = "_hfpatch_seen"  # on a cache of state layers alone (5.24): the tokens hfpatch saw it take


def state_length(cache: Any) -> Optional[int]:
    """Tokens a growing cache of a model with state layers holds before a call (0 for none): its attention
    layers' count, its state layers' (5.25), or where they keep none (5.24) hfpatch's
    (:func:`count_seen`), 0 where they hold no state; None: not known."""
    if cache is None:
        return 0
    if uncounted(cache):
        return None
    try:
        return int(seen(cache)) if not isinstance(cache, (tuple, list)) else past_length(cache)
    except ValueError:  # (5.24: a cache of state layers alone)
        return _state_only(cache)


def _state_only(cache: Any) -> Optional[int]:
    """A 5.24 cache of state layers alone: 0 where they hold no state, else hfpatch's count, or None."""
    for layer in getattr(cache, "layers", None) or ():
        flags = getattr(layer, "has_previous_state", None)
        if isinstance(flags, dict):
            return getattr(cache, SEEN, None) if any(flags.values()) else 0
    return None


def count_seen(cache: Any, past: Optional[int], num_new: int) -> None:
    """Keep on a cache of state layers alone that counts no tokens of its own (5.24) how many it holds
    after a call of ``num_new`` tokens, ``past`` before them (eager mode; a reset cache's states say 0)."""
    if cache is None or past is None or torch.compiler.is_compiling():
        return
    layers = getattr(cache, "layers", None) or ()
    if layers and not any(attends(layer) or hasattr(layer, "cumulative_length_linear") for layer in layers):
        setattr(cache, SEEN, past + num_new)
