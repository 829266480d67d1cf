"""Layers that carry a state from one token to the next (a causal convolution, an SSM, a gated delta
rule, a linear or lightning attention: "mixers"), run on each sequence alone.

No mask keeps such a layer's sequences apart: a packed row's second sequence starts from the state the
first left, a left pad's input (or a hole of a padded cached prefix) still moves the state on. So where
a call's rows hold pads among their new tokens or pack several sequences, the patched forward computes
the call's :class:`Runs` once (from its one host read) and sets it on the call's context
(``CALL.mixing``, carried into a checkpointed layer's recomputation); each mixer, whose ``forward`` is
wrapped by :func:`by_sequence`, then runs its sequences as a batch of their own (groups of sequences of
one length, or of similar length where no state is kept), every sequence from a fresh state (or, the
first of a row that continues a cache, from that row's cached state), and puts the outputs back in the
row (zeros at the pads). The state each row ends with (its last sequence's, at its last real token) is
written into the cache (:func:`hfpatch.caches.group_cache`, :func:`hfpatch.caches.put_states`), so that a
later call continues it exactly. A layer handed the state itself (RWKV's list, xLSTM's tuple) gets each
group's rows of it and returns the state with every row's end written in; a layer that keeps its state on
itself (RecurrentGemma's) has it set to each group's rows, then to every row's own. A mixer is found by its
code (:func:`hfpatch.sources.state_mixers`): one mechanism for every kind of layer, nothing per model.

Other calls (a decode step, a call without pads among its new tokens) run every mixer as transformers
does, after one read of ``CALL.mixing``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from . import caches
from ._compat import STATE_NAMES, passed
from ._context import CALL, warn_once
from .attention import RUNS, Carrier, carried
from .patches import Patch
from .sources import hands_state, held_states, keeps_state, signature_of, state_mixers

__all__ = ["Group", "Runs", "by_sequence", "mixer_rows", "runs_of"]

# a mixer's cache, by release; or the state itself (RWKV's and xLSTM's layers: a list or tuple of tensors)
CACHE_PARAMETERS = ("cache", "cache_params", "past_key_values", "state")
# what a packed row's caller may hand the layers for kernels that keep its sequences apart: a regrouped
# call holds one sequence a row, and transformers' torch paths raise when given them
LENGTHS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class Group(NamedTuple):
    """Sequences a mixer runs as one batch: ``index`` ``[sequences, longest]``, their tokens' flat numbers
    over the call's ``rows x length``; ``valid`` ``[sequences, longest]`` where they are real (None: every
    sequence is ``longest`` long; a short one is padded at its end, which a causal layer never reads
    back); ``source`` ``[sequences]``, the cache row each continues (None: each starts fresh);
    ``members`` and ``rows``: the sequences whose final state the cache keeps, and in which of its rows;
    ``real``: where ``valid`` is given, the flat numbers of its real entries over ``sequences x longest``
    and the call's tokens they go to (read on the host with the rest: no device sync a layer)."""

    index: Tensor
    valid: Optional[Tensor]
    source: Optional[Tensor]
    members: Tensor
    rows: Tensor
    real: Optional[tuple[Tensor, Tensor]] = None


class Runs(NamedTuple):
    """A call's sequences as its mixers run them: ``shape`` (rows, length) of its token tensors,
    ``states`` (the rows of the cache's states: the call's, or an unpadded call's padded batch), the
    :class:`Group` s, and ``steps``: a sequence that continues a cache runs one token at a time
    (``Adapter.steps``: the model's multi-token path restarts the state)."""

    shape: tuple[int, int]
    states: int
    groups: tuple[Group, ...]
    steps: bool = False


def runs_of(
    real: Tensor,
    segment_ids: Optional[Tensor],
    device: torch.device,
    *,
    continues: bool,
    keeps: bool,
    unpadded: Optional[int] = None,
    steps: bool = False,
) -> Runs:
    """The :class:`Runs` of a call, from what the host read of it.

    Args:
        real: ``[rows, length]`` bool (host), the call's real tokens.
        segment_ids: ``[rows or 1, length]`` (host), each token's sequence in its row
            (:func:`hfpatch.positions.segments`), or None: one sequence a row.
        device: where the call runs.
        continues: the cache holds each row's state before this call: a row's first sequence continues it.
        keeps: the cache keeps each row's final state (groups of one length; else of similar length).
        unpadded: an unpadded call's padded batch size: each sequence is a row of it, whose state it keeps
            (a sequence numbered past it keeps none).
        steps: a sequence that continues a cache runs one token at a time (:attr:`Runs.steps`).

    Example:
        >>> r = runs_of(torch.tensor([[True, True, True, True, True]]), torch.tensor([[0, 0, 0, 1, 1]]),
        ...             torch.device("cpu"), continues=False, keeps=True)
        >>> [g.index.tolist() for g in r.groups]
        [[[0, 1, 2]], [[3, 4]]]
    """
    rows, length = real.shape
    flat = real.reshape(-1).nonzero().squeeze(1)  # the real tokens, in order
    row = torch.div(flat, length, rounding_mode="floor")
    key = row * (length + 1)
    if segment_ids is not None:
        key = key + segment_ids.expand(rows, length).reshape(-1)[flat]
    if not len(flat):
        return Runs((rows, length), unpadded or rows, (), steps)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (key[1:] != key[:-1]).nonzero().squeeze(1) + 1])
    sizes = torch.diff(starts, append=torch.tensor([len(flat)])).tolist()
    seq_rows = row[starts].tolist()
    numbers = (key[starts] - row[starts] * (length + 1)).tolist()  # each sequence's number in its row
    count = len(sizes)
    sources, targets = [-1] * count, [-1] * count
    for i in range(count):
        first = i == 0 or seq_rows[i - 1] != seq_rows[i]
        last = i == count - 1 or seq_rows[i + 1] != seq_rows[i]
        if unpadded is not None:
            targets[i] = numbers[i] if numbers[i] < unpadded else -1
        else:
            sources[i] = seq_rows[i] if continues and first else -1
            targets[i] = seq_rows[i] if last else -1
    by_kind: dict[tuple[int, bool], list[int]] = {}
    for i, size in enumerate(sizes):  # one length where a state is kept, else within a factor of 2
        by_kind.setdefault((size if keeps else 1 << (size - 1).bit_length(), sources[i] >= 0), []).append(i)
    offsets = torch.arange(max(sizes))
    groups = []
    for members in by_kind.values():
        own = torch.tensor([sizes[i] for i in members])
        longest = int(own.max())
        valid = offsets[None, :longest] < own[:, None]
        first = starts[members]
        index = flat[first[:, None] + torch.where(valid, offsets[None, :longest], 0)]
        kept = [j for j, i in enumerate(members) if targets[i] >= 0]
        source = torch.tensor([sources[i] for i in members]) if sources[members[0]] >= 0 else None
        padded = not bool(valid.all())
        to = functools.partial(Tensor.to, device=device, non_blocking=True)
        groups.append(
            Group(
                to(index),
                to(valid) if padded else None,
                None if source is None else to(source),
                to(torch.tensor(kept, dtype=torch.long)),
                to(torch.tensor([targets[members[j]] for j in kept], dtype=torch.long)),
                (to(valid.reshape(-1).nonzero().squeeze(1)), to(index[valid])) if padded else None,
            )
        )
    return Runs((rows, length), unpadded or rows, tuple(groups), steps)


def by_sequence(original: Callable) -> Callable:
    """A mixer's ``forward`` that runs each of the call's sequences alone where ``CALL.mixing`` holds the
    call's :class:`Runs`; any other call (or one whose inputs are not the call's rows) is the original's."""
    if getattr(original, "__hfpatch_mixer__", False):
        return original
    signature = signature_of(original)

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        runs = CALL.mixing
        if runs is None:  # (or the mask carries them: a checkpointed layer recomputed in the backward pass)
            mask = kwargs.get("attention_mask", kwargs.get("conv_mask"))
            if mask.__class__ is not Carrier or mask.__dict__.get(RUNS) is None:
                runs = _one_token_rows(self, args, kwargs.get("state"))
                if runs is None:
                    return original(self, *args, **kwargs)
            else:
                runs = mask.__dict__[RUNS]
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # (the original's own error)
            return original(self, *args, **kwargs)
        return _by_sequence(original, self, bound, runs)

    forward.__hfpatch_mixer__ = True  # type: ignore[attr-defined]
    return forward


def _one_token_rows(module: Any, args: tuple, state: Any) -> Optional[Runs]:
    """A one-token step of several rows handed a state shared by every layer (RWKV's list, whose tensors
    hold each layer's along their last axis): its rows one at a time (RWKV's token shift broadcasts the
    rows' states into each other there, on stock: ``[rows, rows, ...]`` outputs); else None."""
    if state.__class__ is not list or not args or not caches.is_state(state):
        return None
    hidden, layer = args[0], getattr(module, "layer_id", None)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or hidden.shape[1] != 1 or hidden.shape[0] < 2:
        return None
    if not isinstance(layer, int) or state[0].dim() < 3 or state[0].shape[-1] <= layer:
        return None
    rows = hidden.shape[0]
    one = torch.zeros(1, dtype=torch.long, device=hidden.device)
    groups = tuple(Group((one + r)[:, None], None, one + r, one, one + r) for r in range(rows))
    return Runs((rows, 1), rows, groups)


def _by_sequence(original: Callable, module: Any, bound: inspect.BoundArguments, runs: Runs) -> Any:
    """``original`` on each :class:`Group` of ``runs``, the outputs put back in the rows, the states the
    cache keeps written back."""
    rows, length = runs.shape
    named = {k: v for k, v in bound.arguments.items() if k != "self"}
    extra = {}
    for parameter in bound.signature.parameters.values():  # (**kwargs: their entries, by name)
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            extra = named.pop(parameter.name, {})
    named.update((k, v) for k, v in extra.items() if k not in LENGTHS)
    for name in LENGTHS:  # (a parameter of its own: 4.57's Mamba2 layers take seq_idx)
        if name in named:
            named[name] = None
    first = next(iter(named.values()), None)
    layer = getattr(module, "layer_idx", getattr(module, "layer_id", None))
    held = held_states(type(module))  # (a state the layer keeps on itself: a cache it is given is not its)
    cache_name = next((n for n in CACHE_PARAMETERS if named.get(n) is not None and not held), None)
    named = {k: v.as_subclass(Tensor) if v.__class__ is Carrier else v for k, v in named.items()}
    cache = named[cache_name] if cache_name is not None else None
    handed = caches.is_state(cache)  # the state itself, not a cache object
    if not _token_level(first, rows, length) or (
        cache is not None and not handed and not isinstance(layer, int)
    ):
        return original(module, **named)  # (not the call's rows: a layer this does not know)
    before = [_attribute(module, path) for path in held]
    outputs: Optional[list[Any]] = None
    kept, ends = [], []
    for group in runs.groups:
        flat = group.index.reshape(-1)
        args = {
            name: None if "mask" in name else _gathered(value, rows, length, flat, group.index.shape)
            for name, value in named.items()
            if name != cache_name
        }
        slots = named.get("cache_position")
        if (
            isinstance(slots, Tensor) and slots.dim() == 1 and len(slots) == length
        ):  # (4.x: each token's slot)
            args["cache_position"] = _slots_of(slots, group)
        sub = None
        if handed:
            args[cache_name] = caches.group_state(cache, group.source, group.index.shape[0])
        elif cache is not None:
            sub = caches.group_cache(cache, layer, group.source, group.index.shape[0])
            if sub is None:  # a cache this cannot give a group (one recording its past): as transformers does
                return original(module, **named)
            args[cache_name] = sub
        for path, state in zip(held, before):  # fresh: zeros, as its _setup_cache makes them (or None: made
            size = group.index.shape[0]  # at its first call)
            if not isinstance(state, Tensor):
                _set_attribute(module, path, None)
            elif group.source is None:
                _set_attribute(module, path, state.new_zeros(size, *state.shape[1:]))
            else:
                _set_attribute(module, path, state.index_select(0, group.source))
        if runs.steps and group.source is not None and group.index.shape[1] > 1:
            result = _stepped(original, module, args, group.index.shape[1])
        else:
            result = original(module, **args)
        outputs = _scattered(result, outputs, group, rows * length)
        if held and len(group.members):
            ends.append(([_attribute(module, path) for path in held], group.members, group.rows))
        if handed and len(group.members):
            ended = _returned_state(result, len(group.index))
            cache = caches.put_state(cache, ended, group.members, group.rows, layer, runs.states)
        if sub is not None and len(group.members):
            kept.append((caches.layer_states(sub, layer, len(group.index)), group.members, group.rows))
            caches.carry_flags(sub, cache, layer)
    if cache is not None and not handed:
        caches.put_states(cache, layer, kept, runs.states, length)
    for i, path in enumerate(held):  # each row's state at its last sequence's end, the others' as they were
        _set_attribute(module, path, _rows_of(before[i], [(e[i], m, at) for e, m, at in ends], runs.states))
    if outputs is None:  # no real token in the call: its outputs are pads', and no state moves
        if held:
            result = original(module, **named)
            for path, state in zip(held, before):
                _set_attribute(module, path, state)
            return result
        if handed:
            return _with_state(original(module, **{**named, cache_name: caches.copied(cache)}), cache)
        return original(module, **({**named, cache_name: None} if cache_name is not None else named))
    made = [o.view(rows, length, *o.shape[1:]) if isinstance(o, Tensor) else o for o in outputs]
    if handed:  # (the state the layer returns: the caller's, each row's written in)
        made = [cache if caches.is_state(part) else got for part, got in zip(_parts(result), made)]
    return made[0] if len(made) == 1 and not isinstance(result, tuple) else type(result)(made)


def _attribute(module: Any, path: tuple[str, ...]) -> Any:
    """The attribute at ``path`` from ``module`` (``("rg_lru", "recurrent_states")``), None where absent."""
    for name in path:
        module = getattr(module, name, None)
    return module


def _set_attribute(module: Any, path: tuple[str, ...], value: Any) -> None:
    owner = _attribute(module, path[:-1])
    if owner is not None:
        setattr(owner, path[-1], value)


def _rows_of(state: Any, ended: list, rows: int) -> Any:
    """A state a layer keeps on itself, for the call's ``rows``: ``state`` (zeros where it held no such
    rows) with each group's sequences' ends (``ended``: (the group's state, its members, their rows)) in
    the rows they end; ``state`` as it was where no group left one (a call that keeps none)."""
    made = [(e, m, at) for e, m, at in ended if isinstance(e, Tensor)]
    if not made:
        return state if len(ended) == 0 else None
    first = made[0][0]
    fits = isinstance(state, Tensor) and state.shape[0] == rows and state.shape[1:] == first.shape[1:]
    whole = state if fits else first.new_zeros(rows, *first.shape[1:])
    for end, members, at in made:
        whole = whole.index_copy(0, at, end.index_select(0, members).to(whole.dtype))
    return whole


def _parts(result: Any) -> list[Any]:
    """A layer's result as a list of its outputs (one, where it returns no tuple)."""
    return list(result) if isinstance(result, tuple) else [result]


def _returned_state(result: Any, size: int) -> Any:
    """The state a layer handed its state returned for a group of ``size`` sequences (RWKV's the list it was
    given, written; xLSTM's a tuple of its own)."""
    return next((p for p in _parts(result) if caches.is_state(p) and p[0].shape[0] == size), None)


def _with_state(result: Any, state: Any) -> Any:
    """A layer's result with the caller's ``state`` where it returned one (no real token moved it)."""
    made = [state if caches.is_state(part) else part for part in _parts(result)]
    return made[0] if len(made) == 1 and not isinstance(result, tuple) else type(result)(made)


def _slots_of(slots: Tensor, group: Group) -> Tensor:
    """A group's ``cache_position`` (4.x mixers read it): the call's own counted from 0 for sequences that
    start fresh (as long as the call's: 4.x Mamba's layers take a fresh call's by its length, the
    convolution's width, and every layer reads ``[0] == 0`` as fresh), the call's first slots (the cache's
    length on) for those that continue a row."""
    return slots - slots[:1] if group.source is None else slots[: group.index.shape[1]]


def _stepped(original: Callable, module: Any, args: dict, longest: int) -> Any:
    """``original`` on a group's tokens one at a time (the arguments' token-level tensors sliced, the
    stand-in cache carrying the state from one to the next), its outputs put together."""
    results = []
    for t in range(longest):
        sliced = {name: _at(value, longest, t) for name, value in args.items()}
        results.append(original(module, **sliced))
    first = results[0]
    parts = [_parts(r) for r in results]
    joined = [
        torch.cat([p[i] for p in parts], 1)
        if isinstance(p0, Tensor) and _token_level(p0, p0.shape[0], 1)
        else p0
        for i, p0 in enumerate(parts[0])
    ]
    return type(first)(joined) if isinstance(first, tuple) else joined[0]


def _at(value: Any, longest: int, t: int) -> Any:
    """A group's token-level tensor (or tuple of them) at its token ``t``; anything else as it is."""
    if isinstance(value, tuple):
        return tuple(_at(v, longest, t) for v in value)
    if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == longest:
        return value[:, t : t + 1]
    if isinstance(value, Tensor) and value.dim() == 1 and value.shape[0] == longest:  # (4.x cache_position)
        return value[t : t + 1]
    return value


def _token_level(value: Any, rows: int, length: int) -> bool:
    """A tensor ``[rows or 1, length, ...]``: one value a token of the call's rows."""
    return (
        isinstance(value, Tensor)
        and value.dim() >= 2
        and value.shape[1] == length
        and value.shape[0] in (1, rows)
    )


def _gathered(value: Any, rows: int, length: int, flat: Tensor, shape: torch.Size) -> Any:
    """A token-level tensor (or a tuple of them: rope's cos and sin) as the group's ``[sequences,
    longest, ...]``; anything else as it is."""
    if isinstance(value, tuple):
        return tuple(_gathered(v, rows, length, flat, shape) for v in value)
    if not _token_level(value, rows, length):
        return value
    whole = value.expand(rows, length, *value.shape[2:]).reshape(rows * length, *value.shape[2:])
    return whole.index_select(0, flat).view(*shape, *value.shape[2:])


def _scattered(result: Any, outputs: Optional[list[Any]], group: Group, size: int) -> list[Any]:
    """The group's outputs put into the call's flat ``[rows x length, ...]`` ones (zeros where no real
    token is): its token-level tensors; any other output, None."""
    parts = _parts(result)
    sequences, longest = group.index.shape
    if outputs is None:
        outputs = [
            p.new_zeros(size, *p.shape[2:]) if _token_level(p, sequences, longest) and p.shape[0] == sequences
            else None
            for p in parts
        ]  # fmt: skip
    index = group.index.reshape(-1) if group.real is None else group.real[1]
    for i, part in enumerate(parts):
        if outputs[i] is None or not isinstance(part, Tensor):
            continue
        values = part.reshape(sequences * longest, *part.shape[2:])
        if group.real is not None:
            values = values.index_select(0, group.real[0])
        outputs[i].index_copy_(0, index, values.to(outputs[i].dtype))  # (in place: autograd follows it)
    return outputs


AS_STOCK: Any = object()  # the whole call as stock runs it (its state layers cannot keep its sequences)
TORCH_CHECKPOINTED = (
    "hfpatch: {}: its layers that carry a state take no mask that could carry the call's sequences, and "
    "torch's checkpoint_wrapper recomputes them outside the call: this call's sequences are not kept apart "
    "(the call runs as on stock); model.gradient_checkpointing_enable() keeps them"
)


def _carries_runs(model: Any, trims: bool) -> bool:
    """Whether a mask its state layers take can carry a call's runs into a recomputation outside the call:
    the 2-D mask of a model without attention (``trims``: Mamba's layers take it), or the one
    ``create_recurrent_attention_mask`` makes (5.x hybrids); not for layers that take no mask (RWKV, xLSTM,
    RecurrentGemma) nor 4.x hybrids (LFM2, MiniMax: no such function)."""
    if hands_state(model) or keeps_state(model):
        return False
    return trims or callable(vars(sys.modules[type(model).__module__]).get(MASK_FUNCTION))


def _torch_checkpointed(model: Any) -> bool:
    """A layer of ``model`` wrapped by torch's ``checkpoint_wrapper`` (FSDP's activation checkpointing)."""
    return any(type(module).__name__ == "CheckpointWrapper" for module in model.modules())


MASK_FUNCTION = "create_recurrent_attention_mask"  # masking_utils' 2-D mask of the state layers (5.x)


def mixer_rows(module: Any) -> list[Patch]:
    """The rows of a modeling module whose layers carry a state (:func:`hfpatch.sources.state_mixers`):
    each such class's ``forward``, run by sequence where a call's :class:`Runs` say so; and the module's
    ``create_recurrent_attention_mask``, whose mask carries the call's runs into the layers (so that a
    layer checkpointed by any means, torch's ``checkpoint_wrapper`` too, is recomputed with them)."""
    rows = [
        Patch(cls, "forward", cls.__dict__["forward"], by_sequence(cls.__dict__["forward"]))
        for cls in state_mixers(module)
    ]
    namespace = vars(module)
    made = namespace.get(MASK_FUNCTION)
    if rows and callable(made) and not getattr(made, "__hfpatch_mixer__", False):
        rows.append(Patch(namespace, MASK_FUNCTION, made, carrying_runs(made)))
    return rows


def carrying_runs(original: Callable) -> Callable:
    """transformers' mask function of the state layers, whose 2-D mask (all ones where it gives none)
    carries the call's :class:`Runs` where the patched forward set them (``CALL.mixing``)."""

    @functools.wraps(original)
    def create_recurrent_attention_mask(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        runs = CALL.mixing
        if runs is None or torch.compiler.is_compiling():
            return made
        return with_runs(made, runs, kwargs.get("inputs_embeds", args[1] if len(args) > 1 else None))

    create_recurrent_attention_mask.__hfpatch_mixer__ = True  # type: ignore[attr-defined]
    return create_recurrent_attention_mask


def with_runs(mask: Any, runs: Runs, like: Any) -> Any:
    """A state layers' 2-D mask (``mask``, or all ones ``[rows, length]`` on ``like``'s device where there
    is none) carrying ``runs``: the layers' argument, whoever recomputes them."""
    if mask is None:
        if not isinstance(like, Tensor):
            return None
        mask = torch.ones(runs.shape, dtype=torch.bool, device=like.device)
    if mask.__class__ is not Tensor or tuple(mask.shape) != runs.shape:
        return mask
    return carried(mask, runs, RUNS)


def call_runs(
    model: Any,
    given: dict,
    packed: Any,
    derived: Any,
    cache: Any,
    kwargs: dict,
    steps: bool = False,
    trims: bool = False,
) -> Optional[Runs]:
    """The :class:`Runs` of a call of a model whose layers carry a state, or None where they run as
    transformers runs them: a row that packs several sequences (``packed``: its layout, read on the host
    once), or a call whose new tokens hold a pad (the new columns of its 2-D mask, read on the host in one
    copy: where hfpatch derived the positions, ``derived`` says where they are; else the caller's mask,
    ``given``, spans the cache and the new tokens). Not a single new token (a decode step: never a pad).
    ``steps``: a call of several tokens that continues a cache runs one token at a time in those layers,
    pads or not (:attr:`Runs.steps`). ``trims``: a model without attention, whose forward hands its mask
    to the state layers as it is, gets the mask of its new tokens (what transformers' own
    ``create_recurrent_attention_mask`` gives the state layers of every other model)."""
    if cache is None:  # (the states by another name: 4.x-5.23 Mamba's and xLSTM's cache_params, RWKV's state)
        cache = passed(kwargs, STATE_NAMES)
    if model.training and not _carries_runs(model, trims) and _torch_checkpointed(model):
        warn_once(("state handed", type(model).__name__), TORCH_CHECKPOINTED.format(type(model).__name__), 4)
        return AS_STOCK
    wants = kwargs.get("use_cache")
    if wants is None:
        wants = getattr(getattr(model, "config", None), "use_cache", False)
    keeps = cache is not None or bool(wants)  # (a cache the model makes keeps the states too)
    if packed is not None:
        if packed.host is None:  # (compiled code: no host read)
            return None
        real, segment_ids = packed.host
        device = packed.mask.device
        unpadded = packed.padded.batch if packed.padded is not None else None
        return runs_of(real, segment_ids, device, continues=False, keeps=keeps, unpadded=unpadded)
    if derived is not None:
        mask, num_new, where = derived
    else:
        mask, tokens = given.get("attention_mask"), kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if not isinstance(tokens, Tensor) or tokens.dim() < 2:
            return None
        num_new, where = tokens.shape[1], caches.state_length(cache)
        first_step = num_new == 1 and keeps_state(model) and where == 0  # (see fresh_step below)
        if mask is None and ((steps and where and num_new > 1) or first_step):  # (no mask: every token real)
            real = torch.ones(tokens.shape[:2], dtype=torch.bool)
            return runs_of(real, None, tokens.device, continues=bool(where), keeps=keeps, steps=steps)
        if mask.__class__ is not Tensor or mask.dim() != 2 or mask.shape[0] != tokens.shape[0]:
            return None
        if where is None:  # (a cache of state layers alone, seen first here: the mask spans it)
            where = mask.shape[1] - num_new
        caches.count_seen(cache, where, num_new)
        if mask.shape[1] < where + num_new:
            return None  # (a mask that does not span the cache and the new tokens: as transformers runs it)
        if trims and mask.shape[1] > num_new and kwargs.get("attention_mask") is mask:
            kwargs["attention_mask"] = mask[:, where : where + num_new]
    # a first call of one token whose layers keep their state on themselves (RecurrentGemma's: its one-token
    # path continues what they last held, another call's): each row starts afresh
    fresh_step = num_new == 1 and keeps_state(model) and isinstance(where, int) and where == 0
    if num_new < 2 and not fresh_step:
        return None
    if isinstance(where, Tensor) and where.dim() == 0:  # (5.25: a cache of state layers counts in a tensor)
        where = int(where)
    new = mask[:, where : where + num_new] if isinstance(where, int) else mask[:, where.reshape(-1)]
    real = (new != 0).cpu()  # (the call's one host read)
    past = where if isinstance(where, int) else int(where.reshape(-1)[0])
    if bool(real.all()) and not (steps and past > 0) and not fresh_step:
        return None
    return runs_of(real, None, mask.device, continues=past > 0, keeps=keeps, steps=steps)
