"""The patched ``forward``: fill in what the caller left out, then call the original with keywords.

Rules, the same for every architecture and release (the target's :class:`~hfpatch.plans.Plan` picks
the filler that applies, once, when the class is patched):

1. The cache may be passed as ``cache=`` or ``past_key_values=`` (or by position); it is handed on
   under the name the release uses, or under the caller's old name where the release still takes it
   (5.24's ``past_key_values``: transformers then gives its own deprecation warning). Both at once is
   a ``ValueError`` unless they are the same object.
2. ``position_ids`` missing and a 2-D ``attention_mask`` given: positions come from the mask
   (:func:`hfpatch.positions.new_token_positions`), over past + new tokens, so pads and the holes of a
   padded cached prefix are skipped. No mask, or a 4-D mask: untouched.
3. ``cache_position`` missing on a release that has the parameter (4.38-5.3) and a static cache:
   derived from the mask (mask length - new tokens) or hfpatch's count of the slots written, never
   from the buggy ``.any()`` guess (transformers #30377) and without the 4.39-4.40 "required" error.
   Growing caches and tuples keep transformers' own (correct) derivation.
4. ``cache_position`` passed to a release that removed it (5.4+): it must name the slots the cache
   is about to write (``ValueError`` otherwise); it locates the new tokens in a full-length mask, and
   with no mask it sets ``position_ids = cache_position[None]`` as 4.x did. It is not forwarded:
   those releases would swallow and ignore it.
5. Whatever the caller passed explicitly (``position_ids``, ``cache_position`` where the release has
   it) is forwarded unchanged; with both, hfpatch derives nothing.

Only shapes, Python facts about the arguments and tensor ops are used: the function traces under
``torch.compile(fullgraph=True)``. The two checks that read a tensor's values (a passed
``cache_position``, a mask against a 5.4+ static cache's counter) run in eager mode on CPU tensors
only: on an accelerator, reading a value waits for the device.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import caches
from ._compat import CACHE_NAMES, STATE_NAMES, at_trace_time, passed
from ._context import CALL, PACKED, UNPAD, Pin, count_unpadded, patched_here, warn_once
from .caches import CAPACITY
from .declarations import Adapter
from .decoders import call_with_positions
from .layout import Layout
from .mixers import AS_STOCK, Runs, call_runs, with_runs
from .observers import WATCHERS, run_watched
from .packed import packed_rows, positions_from_lengths, warn_not_kept
from .patches import ABSENT, Patch
from .plans import NO_SLOTS, SLOTS, SLOTS_REMOVED, Plan
from .positions import cache_positions, call_inputs, has_holes, new_token_positions
from .sources import forward_tree, keeps_state
from .unpad import PADDED, causal_lm_head, read_host, unpadding
from .verdict import not_kept, padded_here, support
from .windows import MIXED, MaskPlan, apply_masks, configured_window

__all__ = [
    "LeaveToStock",
    "drops_the_mask",
    "handing_generated_masks",
    "make_forward",
    "recording_generated_masks",
    "warn_left_to_stock",
    "watched",
]

Past = Union[int, torch.Tensor]  # cached tokens before this call: an int, or a 0-d tensor (static caches)
# what a filler derived positions from: (the 2-D mask, new tokens, where they start: an int (the mask's
# last columns), or their slots, 1-D), for the window masks; None where it derived none
Derived = Optional[tuple[torch.Tensor, int, Union[int, torch.Tensor]]]


def make_forward(adapter: Adapter, original: Callable, plan: Plan, pin: Pin) -> Callable:
    """Build the plain function installed as ``adapter``'s ``forward`` (no wrapt proxy: dynamo needs it).

    ``pin.pinned``: whether ``apply()`` holds the patch process-wide; a thread's own ``patched()`` /
    ``unpatched()`` blocks decide for that thread (:data:`hfpatch._context.CALL`), in compiled code too
    (dynamo guards on the pin and the thread's choice: a change retraces once)."""
    arch, fill, cache_kw, eager_mask, masks = (
        adapter.arch,
        FILLERS[plan.era],
        plan.cache_kw,
        plan.eager_mask_attr,
        plan.masks,
    )
    # windows decided by position (a multimodal model's stay transformers': see Family.multimodal)
    windowed = masks is not None and masks.windowed and not adapter.family.multimodal
    family = adapter.family if adapter.family.hands_to is not None else None  # its forward takes no positions
    # its own positions from the mask are right, or it takes none (no attention): packed rows only
    from_mask = adapter.family.from_mask or not adapter.family.attends
    handed = plan.handed  # a task head of its module hands it positions through CALL.handed
    mixes = plan.mixers  # layers that carry a state: by sequence (hfpatch.mixers)
    steps = plan.steps  # ... one token at a time in a cached call (Adapter.steps)
    trims = not adapter.family.attends  # ... the mask of the new tokens alone (no attention to take more)
    # positions its task head handed on (CALL.handed) that a forward without attention does not take (4.x
    # Mamba's): they found the call's sequences, and go no further
    drops_positions = trims and not takes_keyword(original, "position_ids")
    prepare_states = _preparing_states(plan, original)  # a cache of states made right for the call
    said = support(adapter, plan)  # whether its packed rows are kept (status()'s answer); apply(unpad=True):
    stays_padded = padded_here(adapter, plan, said)  # None where its padded calls may run on real tokens
    # explicit position_ids leave nothing to derive (4.38-5.3: unless a static cache's slots are missing)
    passes_explicit = plan.era != SLOTS
    other = next((name for name in CACHE_NAMES if name != cache_kw), None)  # the cache's other name
    # the filler of a call without cache_position (5.4+: positions only, as before 4.38)
    plain = fill_positions if plan.era != SLOTS else fill
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(original)  # keeps __wrapped__, so inspect.signature shows the original parameters
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # every step runs this: attribute reads, membership tests and subscripts first, few calls
        if not pin.fast:
            if not is_compiling():
                if pin.awaiting is not None:  # a class defined after apply(): checked at its first call
                    pin.awaiting()
                if WATCHERS[0] and not CALL.watching:  # hfpatch.audit, hfpatch.shadow: theirs first
                    return watched(forward, self, adapter, plan, pin, args, kwargs)
            # (compiled code too: dynamo guards on the pin and this thread's choice, so a graph traced
            # inside unpatched(), the audit or the shadow, or before a class's check, runs stock)
            if not patched_here(pin):
                return original(self, *args, **kwargs)
        if args:
            _bind_positional(adapter, plan, args, kwargs)
        if UNPAD[0] and CALL.unpad is not False and not CALL.unpadding:
            host = read_host(kwargs)  # (the call's one host read: None without padding)
            if host is not None:
                if stays_padded is None:
                    result = unpadding(functools.partial(forward, self), self, kwargs, masks, cache_kw, host)
                    if result is not PADDED:  # (hfpatch.unpad: the call on its real tokens, padded back)
                        return result
                else:
                    count_unpadded(stays_padded)
                return padded(forward, self, kwargs)  # (counted once: nothing inside unpadded or counted)
        given = kwargs.copy()  # what stock gets where hfpatch cannot derive from the call (LeaveToStock)
        try:
            cache = None
            if cache_kw is not None:
                if other in kwargs:  # passed by its other name (or by both)
                    cache = _take_cache(plan, kwargs)
                elif cache_kw in kwargs:
                    cache = kwargs[cache_kw]
            if prepare_states is not None:
                prepare_states(self, kwargs, cache, plan.ids_rank)
            if handed:  # positions (RWKV's: the mask) its task head drops: taken once, here
                _take_handed(kwargs, given)
            if ("cu_seq_lens_q" in kwargs or "seq_idx" in kwargs) and PACKED[0]:  # sequences given by length
                positions_from_lengths(kwargs, call_inputs(kwargs, plan.ids_rank))
            eager, packed = False, None
            if from_mask:
                derived = None  # nothing to derive: stock's own positions are right
            elif "cache_position" in kwargs:
                derived = fill(self, plan, kwargs, cache)
            elif passes_explicit and "position_ids" in kwargs and kwargs["position_ids"] is not None:
                derived = None  # nothing to derive
            elif eager_mask is not None and not is_compiling() and _continues_a_prefix(kwargs):
                fill(self, plan, kwargs, cache)
                derived, eager = None, True
            else:
                derived = plain(self, plan, kwargs, cache)
            if derived is not None:
                if windowed and family is None:
                    apply_masks(self, masks, cache_kw, kwargs, cache, *derived)
            elif (
                not eager
                and (given_positions := kwargs.get("position_ids")) is not None
                and (family is None or from_mask)
            ):  # (one new token and no window, every generate() step: no packed row, no hole to look at)
                if windowed or given_positions.__class__ is not Tensor or given_positions.shape[-1] > 1:
                    packed = given_masks(self, adapter, plan, said, kwargs, cache, pin)
        except (LeaveToStock, caches.MaskDoesNotFit) as exc:
            warn_left_to_stock(arch, str(exc))
            return original(self, **given)
        if packed is AS_STOCK:  # (a packed row not kept, its state layers too: the whole call as stock's)
            return original(self, **given)
        if family is not None:  # handed to the position module instead (hfpatch.decoders)
            laid = packed.mask if packed is not None else None
            return call_with_positions(self, family, original, kwargs, derived[0] if derived else laid)
        if eager:
            return _with_eager_mask(original, self, kwargs)
        if mixes and not is_compiling():
            runs = call_runs(self, given, packed, derived, cache, kwargs, steps, trims)
            if runs is AS_STOCK:
                return original(self, **given)
            if drops_positions:
                kwargs.pop("position_ids", None)
            if runs is not None:  # its layers that carry a state run each sequence alone (hfpatch.mixers)
                _runs_on_masks(kwargs, runs, trims, call_inputs(kwargs, plan.ids_rank))
                return _mixing(original, self, kwargs, runs)
        return original(self, **kwargs)

    forward.__hfpatch_adapter__ = arch  # type: ignore[attr-defined]
    forward.__hfpatch_packed__ = said  # type: ignore[attr-defined]
    return forward


def _preparing_states(plan: Plan, original: Callable) -> Optional[Callable]:
    """What makes a cache of states right for a call of a model with state layers: 4.38-5.3's slots of
    4.x Mamba's ``cache_params``, which stock refuses to make; 5.18-5.22's and 5.25's count of a cache
    whose first layer the model never writes (RecurrentGemma's); None for any other."""
    if plan.mixers and plan.era == SLOTS and takes_keyword(original, "cache_position"):
        return _fill_state_slots
    return _recount_unwritten if plan.mixers and plan.era == SLOTS_REMOVED else None


def _recount_unwritten(model: Any, kwargs: dict, cache: Any, rank: int) -> None:
    """5.18-5.22, 5.25: a cache whose first layer the model never writes, counted
    (:func:`caches.recount_unwritten`)."""
    if cache is not None and keeps_state(model):
        caches.recount_unwritten(cache)


def _fill_state_slots(model: Any, kwargs: dict, cache: Any, rank: int) -> None:
    """``cache_position`` of a call continuing a cache of states without it (4.x Mamba's ``cache_params``,
    which counts no tokens: the 2-D mask, past + new tokens, says how many it holds), counted as
    generate() counts them: a fresh call's are its convolution's width (``config.conv_kernel``, what
    the model makes for one; 4.x Mamba writes a continued token's window at its slot, clamped to the
    width: a count below it puts it at the wrong end). As stock where the call has no such cache or mask,
    or nothing is cached."""
    if kwargs.get("cache_position") is not None:
        return
    state = passed(kwargs, STATE_NAMES)
    mask, tokens = kwargs.get("attention_mask"), call_inputs(kwargs, rank)
    if state is None or caches.is_state(state) or mask.__class__ is not Tensor or tokens is None:
        return
    past = mask.shape[-1] - tokens.shape[1]
    if mask.dim() == 2 and past > 0:
        width = getattr(getattr(model, "config", None), "conv_kernel", 0)
        past = max(past, width if isinstance(width, int) else 0)
        kwargs["cache_position"] = cache_positions(tokens.shape[1], past, tokens.device)


def _take_handed(kwargs: dict, given: dict) -> None:
    """What a task head dropped and handed on through the call's context (``CALL.handed``: positions;
    ``CALL.handed_mask``: RWKV's mask, stock's to see too), into the call where it gives none."""
    if CALL.handed is not None:
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = CALL.handed
        CALL.handed = None
    if CALL.handed_mask is not None:
        if kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = given["attention_mask"] = CALL.handed_mask
        CALL.handed_mask = None


class LeaveToStock(ValueError):
    """A call hfpatch cannot derive positions for (a mask that does not fit it, a ``cache_position``
    that contradicts the cache): the patched forward runs it as stock transformers does, unchanged, and
    says why once (:func:`warn_left_to_stock`). Stock's own errors are stock's: a call stock runs never raises
    because of hfpatch."""


def warn_left_to_stock(arch: str, why: str) -> None:
    """A ``RuntimeWarning`` once per model type and kind of call left to stock (the argument it names)."""
    message = (
        f"hfpatch: {arch}: {why}; this call runs as stock transformers runs it (positions by cache column), "
        "and later ones like it without a word"
    )
    warn_once(("left to stock", arch, why.split()[0]), message, stacklevel=4)


def padded(forward: Callable, model: Any, kwargs: dict) -> Any:
    """The call on the padded path: ``forward`` again, with ``CALL.unpad`` False inside (so that no patched
    call inside it, a vision-language model's language model, is unpadded or counted again)."""
    before, CALL.unpad = CALL.unpad, False
    try:
        return forward(model, **kwargs)
    finally:
        CALL.unpad = before


def watched(
    forward: Callable, model: Any, adapter: Adapter, plan: Plan, pin: Pin, args: tuple, kwargs: dict
) -> Any:
    """The outermost call of a patched forward while an observer is registered (eager mode): its
    arguments by name (positional ones bound) and the call, handed to the observers."""
    named = dict(kwargs)
    if args:
        with contextlib.suppress(TypeError):  # arguments the call itself rejects, saying so
            _bind_positional(adapter, plan, args, named)
    if plan.handed and CALL.handed is not None and named.get("position_ids") is None:
        named["position_ids"] = (
            CALL.handed
        )  # (positions its task head drops: the call packs its rows by them)
    if plan.handed and CALL.handed_mask is not None and named.get("attention_mask") is None:
        named["attention_mask"] = CALL.handed_mask  # (the mask it drops: RWKV's)
    call = functools.partial(forward, model, *args, **kwargs)
    return run_watched(model, adapter, named, patched_here(pin), plan.ids_rank, call)


def given_masks(
    model: Any, adapter: Adapter, plan: Plan, said: str, kwargs: dict, cache: Any, pin: Pin
) -> Optional[Layout]:
    """A call with the caller's positions: a row whose positions restart is kept to the sequences it
    packs (:mod:`hfpatch.packed`; its layout returned: its 2-D mask, for a position module that reads it,
    its sequences, for the layers that carry a state); else, where the model has windows, they are
    decided by position in a mask with holes (:func:`given_windows`). The positions stay the caller's.
    :data:`~hfpatch.mixers.AS_STOCK` for a packed row not kept of a model whose state layers would run it
    by sequence: the whole call is stock's."""
    masks = plan.masks
    if PACKED[0]:
        found = packed_rows(kwargs, call_inputs(kwargs, plan.ids_rank))
        if found is not None and plan.mixers and torch.compiler.is_compiling():
            _states_not_kept_compiled(
                adapter.arch
            )  # (said while traced: a graph cannot run them by sequence)
        if found is not None and not adapter.family.attends and plan.mixers:
            return found  # (no attention: its state layers alone keep it, hfpatch.mixers)
        if found is not None:
            mask = found.mask
            why = not_kept(model, adapter, plan, said, kwargs.get("attention_mask") is not None)
            if why is None:
                if torch.compiler.is_compiling():
                    _install_while_tracing(pin)  # (at trace time, outside the graph: no guard on it)
                elif pin.late is not None:
                    pin.late()  # (the module's attention by sequence: in from its first packed call)
                why = apply_masks(model, masks, plan.cache_kw, kwargs, cache, mask, mask.shape[1], 0, found)
                if why is None:
                    return found
            if why != "" and not torch.compiler.is_compiling():  # (""): transformers' own path, exact
                # (compiled code treats every such call as packed, restarting or not: no word there)
                warn_not_kept(adapter.arch, why)
            return AS_STOCK if why != "" and plan.mixers else None
    if masks is not None and masks.windowed and not adapter.family.multimodal:
        given_windows(model, plan, masks, kwargs, cache)
    return None


STATES_COMPILED = "compiled (its state layers run each sequence alone in eager mode only)"


@at_trace_time
def _states_not_kept_compiled(arch: str) -> bool:
    warn_not_kept(arch, STATES_COMPILED)
    return True


@at_trace_time
def _install_while_tracing(pin: Pin) -> bool:
    """A packed call being traced: the rows its module's attention needs (hfpatch.attention) go in now,
    before the graph reads the module's attention functions (compiled code cannot install them later)."""
    late = pin.late
    if late is not None:
        late()
    return True


def given_windows(model: Any, plan: Plan, masks: MaskPlan, kwargs: dict, cache: Any) -> None:
    """A call with the caller's positions (``generate()`` passes its own): where its 2-D mask has a hole
    (a padded cached prefix continued), the windows are decided by position, as for derived positions;
    the positions stay the caller's. A mask without holes is left to stock (bit-identical): its windows
    by cache column are right. In eager mode only (the check reads the mask; traced code is stock's)."""
    mask, tokens = kwargs.get("attention_mask"), call_inputs(kwargs, plan.ids_rank)
    if mask.__class__ is not Tensor or mask.dim() != 2 or tokens is None or torch.compiler.is_compiling():
        return
    num_new, mask_len = tokens.shape[1], mask.shape[1]
    smallest = configured_window(model)
    if smallest is None or mask_len <= smallest:
        return  # every key inside every window, by column and by position alike
    slots = kwargs.get("cache_position")
    if slots is not None:
        start: Union[int, Tensor] = slots.reshape(-1)
    elif caches.capacity(cache) is None and caches.past_length(cache) + num_new == mask_len:
        start = mask_len - num_new  # a growing cache (or none) and a mask of past + new tokens
    else:
        return
    if has_holes(mask):
        apply_masks(model, masks, plan.cache_kw, kwargs, cache, mask, num_new, start)


def _continues_a_prefix(kwargs: dict) -> bool:
    """Positions to derive for several new tokens after a cached prefix: the calls 4.36-4.37's SDPA
    mask code (``_unmask_unattended``) gets wrong (``Adapter.eager_mask``)."""
    mask, tokens = _mask_to_read(kwargs), call_inputs(kwargs)
    return mask is not None and mask.dim() == 2 and tokens is not None and 1 < tokens.shape[1] < mask.shape[1]


def _runs_on_masks(kwargs: dict, runs: Runs, trims: bool, inputs: Any) -> None:
    """The masks a call hands its state layers carry its sequences, so that a layer recomputed by any
    checkpointing (outside this call's context) runs them alike: the 2-D mask of a model without attention
    (``trims``), the state layer types' entries of the masks dict hfpatch made (a packed row's); the others
    get theirs from transformers' mask function (:func:`hfpatch.mixers.carrying_runs`)."""
    masks = kwargs.get("attention_mask")
    if trims:
        kwargs["attention_mask"] = with_runs(masks, runs, inputs)
    elif isinstance(masks, dict):
        for kind in MIXED:
            if kind in masks:
                masks[kind] = with_runs(masks[kind], runs, inputs)


def _mixing(original: Callable, model: Any, kwargs: dict, runs: Runs) -> Any:
    """Call ``original`` with the call's sequences on its context, for the layers that carry a state."""
    before, CALL.mixing = CALL.mixing, runs
    try:
        return original(model, **kwargs)
    finally:
        CALL.mixing = before


def _with_eager_mask(original: Callable, model: Any, kwargs: dict) -> Any:
    """Call ``original`` with the model's SDPA switch reading False in this thread (see
    :class:`hfpatch._context.SdpaSwitch`), so that transformers builds its eager 4-D mask."""
    CALL.eager_mask = True
    try:
        return original(model, **kwargs)
    finally:
        CALL.eager_mask = False


def takes_keyword(function: Callable, name: str) -> bool:
    """Whether ``function`` takes the keyword ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


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


def _take_cache(plan: Plan, kwargs: dict) -> Any:
    """Pop the cache from either name and put it back under the release's name, or under the old
    name the caller used where the release still takes it (so that its own warning reaches them)."""
    new, old = kwargs.pop(CACHE_NAMES[0], None), kwargs.pop(CACHE_NAMES[1], None)
    if new is not None and old is not None and new is not old:
        raise LeaveToStock(
            "got two different caches, `cache=` and `past_key_values=`: pass one "
            f"(this release calls it `{plan.cache_kw}`)"
        )
    cache = new if new is not None else old
    if cache is not None:
        renamed = new is None and plan.old_cache_kw == CACHE_NAMES[1]
        kwargs[plan.old_cache_kw if renamed else plan.cache_kw] = cache
    return cache


# --- the fillers: one per era, chosen by the plan ---------------------------------------------------


def fill_positions(model: Any, plan: Plan, kwargs: dict, cache: Any) -> Derived:
    """Releases without ``cache_position`` (and the growing caches of every release): positions only.
    The checks of :func:`_mask_to_read` and :func:`_checked_length` are written out, each tensor's
    shape read once: this runs at every decode step (the inputs read by
    :func:`hfpatch.positions.call_inputs`)."""
    mask = kwargs["attention_mask"] if "attention_mask" in kwargs else None
    if mask is None or ("position_ids" in kwargs and kwargs["position_ids"] is not None):
        return None
    if mask.__class__ is not Tensor and not isinstance(mask, Tensor):
        return None  # not a tensor (a flex-attention BlockMask): the caller's
    shape = mask.shape
    if len(shape) == 4:
        mask = _generated_from(mask)
        if mask is None:
            return None  # a 4-D mask: the caller's
        shape = mask.shape
    tokens = call_inputs(kwargs, plan.ids_rank)
    if tokens is None:
        return None
    inputs = tokens.shape
    if len(shape) != 2 or shape[0] != inputs[0]:
        _checked_length(mask, tokens)  # raises, saying which
    num_new, mask_len = inputs[1], shape[1]
    if cache is None:
        past = 0
    elif cache.__class__ not in _SEQUENCES and not cache.__dict__.get(CAPACITY, 1):  # a growing cache
        past = caches.seen(cache)
    else:  # a legacy tuple, a static cache, a cache not read yet
        past = caches.growing_past(cache)
    if past is not None and mask_len == past + num_new:  # the usual mask: past + new tokens
        kwargs["position_ids"] = new_token_positions(mask, num_new)
        return mask, num_new, past
    past = caches.past(cache, num_new, mask_len, strict=True)  # a static cache, or a mask that is wrong
    where = _where_new(num_new, past, mask_len)
    kwargs["position_ids"] = new_token_positions(mask, num_new, where)
    return mask, num_new, past if where is None else where


_SEQUENCES = (tuple, list)  # legacy caches


def fill_slots(model: Any, plan: Plan, kwargs: dict, cache: Any) -> Derived:
    """4.38-5.3, where ``cache_position`` is a parameter: positions, and with a static cache the slots
    the caller left out (kept exact by hfpatch's count of the slots written)."""
    static = cache
    if static is None and plan.attached_cache is not None:
        static = _attached_cache(model, plan.attached_cache)
    given = kwargs.get("cache_position")
    if given is not None and kwargs.get("position_ids") is not None:
        caches.recount(static, given)  # nothing to derive; a count hfpatch keeps stays current
        return None
    size = caches.capacity(static)
    if size is None:  # a growing cache (or none): transformers' own slots are right
        return fill_positions(model, plan, kwargs, cache)
    call = _call_inputs(kwargs, plan.ids_rank)
    if call is None:
        return None
    tokens, num_new, mask = call
    if given is not None:  # the caller's slots, forwarded unchanged
        caches.count_written(static, given.reshape(-1)[-1] + 1, tokens.device)
        if mask is None:
            return None
        kwargs["position_ids"] = new_token_positions(mask, num_new, given)
        return mask, num_new, given.reshape(-1)
    if cache is not None and caches.one_buffer_for_all_layers(cache):
        raise LeaveToStock(
            f"{plan.cache_kw}: transformers < 4.41 cannot run a StaticCache passed as the cache argument "
            "(all layers write one buffer; it fails or gives wrong logits even with cache_position). "
            "Attach it with model._setup_cache(StaticCache, batch_size, max_cache_len) and pass no cache, "
            "or use transformers >= 4.41"
        )
    mask_len = _mask_length(kwargs)
    past = caches.past(static, num_new, mask_len, strict=mask is not None)
    kwargs["cache_position"] = cache_positions(num_new, past, tokens.device)
    if mask is not None:
        kwargs["position_ids"] = new_token_positions(mask, num_new, _where_new(num_new, past, mask_len))
    derived = (mask, num_new, kwargs["cache_position"]) if mask is not None else None
    caches.count_written(static, past + num_new, tokens.device)  # last: ``past`` may be the count itself
    return derived


def fill_removed_slots(model: Any, plan: Plan, kwargs: dict, cache: Any) -> Derived:
    """5.4+, where ``cache_position`` is gone (``**kwargs`` would swallow it): positions, and a passed
    ``cache_position`` checked and used to locate the new tokens instead of ignored."""
    given = kwargs.pop("cache_position", None)
    if given is None:
        return fill_positions(model, plan, kwargs, cache)
    call = _call_inputs(kwargs, plan.ids_rank)
    if call is None:
        return None
    _, num_new, mask = call
    past = caches.past(cache, num_new, _mask_length(kwargs), strict=mask is not None)
    if caches.may_read(given):
        _check_given_slots(given, cache_positions(num_new, past))
    if mask is not None:
        kwargs["position_ids"] = new_token_positions(mask, num_new, given)
        return mask, num_new, given.reshape(-1)
    if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is None:
        kwargs["position_ids"] = given.reshape(1, -1)
    return None


FILLERS: dict[str, Callable[[Any, Plan, dict, Any], Derived]] = {
    NO_SLOTS: fill_positions,
    SLOTS: fill_slots,
    SLOTS_REMOVED: fill_removed_slots,
}


# --- helpers -----------------------------------------------------------------------------------------


def _mask_to_read(kwargs: dict) -> Optional[torch.Tensor]:
    """The mask positions are derived from: ``None`` when the caller passed ``position_ids``, or no
    mask, or a 4-D mask or a non-tensor one (a flex-attention ``BlockMask``): those are the caller's."""
    if kwargs.get("position_ids") is not None:
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        mask = _generated_from(mask)
    return mask if isinstance(mask, torch.Tensor) and mask.dim() != 4 else None


def _call_inputs(kwargs: dict, rank: int = 2) -> Optional[tuple[torch.Tensor, int, Optional[torch.Tensor]]]:
    """(the inputs, how many new tokens, the mask positions are derived from: checked, or None), or
    None for a call without inputs hfpatch reads (see :func:`hfpatch.positions.call_inputs`)."""
    tokens = call_inputs(kwargs, rank)
    if tokens is None:
        return None
    mask = _mask_to_read(kwargs)
    if mask is not None:
        _checked_length(mask, tokens)
    return tokens, tokens.shape[1], mask


def _mask_length(kwargs: dict) -> Optional[int]:
    """The number of columns of a 2-D mask, passed for positions or not (it may locate the new tokens)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        mask = _generated_from(mask)
    return mask.shape[1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def _generated_from(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """The 2-D mask ``generate()`` made the 4-D ``mask`` from (with a static cache, for the call it is
    about to make), or None for any other 4-D mask (the caller's own)."""
    generated = CALL.generated
    return generated[1] if generated is not None and generated[0] is mask else None


def recording_generated_masks() -> Optional[Patch]:
    """While hfpatch is installed, ``generate()``'s input preparation (transformers' own, which models
    that do not override it use) records, in the calling thread, the 2-D mask it turns into a 4-D one
    for a static cache: the next call reads its positions from that mask, as it would from the 2-D
    mask with a dynamic cache. The row replacing the method, or None before the method."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return None
    prepare = GenerationMixin.__dict__.get("prepare_inputs_for_generation")
    if prepare is None:
        return None

    @functools.wraps(prepare)
    def prepare_inputs_for_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = prepare(self, *args, **kwargs)
        key = (
            "decoder_attention_mask"
            if getattr(self.config, "is_encoder_decoder", False)
            else "attention_mask"
        )
        flat, made = kwargs.get(key), inputs.get(key) if isinstance(inputs, dict) else None
        if UNPAD[0]:  # (the mask of the call it prepares, by identity: a right-padded prompt stays padded)
            CALL.generating = made
        if isinstance(flat, Tensor) and flat.dim() == 2 and isinstance(made, Tensor) and made.dim() == 4:
            if made.shape[-1] > flat.shape[1]:  # as wide as the static cache: one shape every step (compile)
                flat = torch.nn.functional.pad(flat, (0, made.shape[-1] - flat.shape[1]))
            CALL.generated = (made, flat)
        elif CALL.generated is not None:
            CALL.generated = None
        return inputs

    return Patch(GenerationMixin, "prepare_inputs_for_generation", prepare, prepare_inputs_for_generation)


def handing_generated_masks(heads: Any, pin: Pin) -> list[Patch]:
    """Rows for the causal LM heads of a patched module whose ``prepare_inputs_for_generation`` (their
    own, a module class's they inherit, or ``GenerationMixin``'s) drops ``generate()``'s mask: 4.x's RWKV,
    CTRL and OpenAI GPT, and every model that kept the mixin's own before 4.46. Their forward then never
    sees the pads of a left-padded batch (stock: its rows other tokens than alone); the row hands the mask
    on, so that it gets what a forward call with the mask gets. One row on the class that defines the
    method in the module (or on the head, over the mixin's), where the head's forward takes a mask."""
    rows: dict[type, Patch] = {}
    for head in heads:
        if "attention_mask" not in inspect.signature(head.forward).parameters or not causal_lm_head(head.cls):
            continue
        owner = next((c for c in head.cls.__mro__ if "prepare_inputs_for_generation" in c.__dict__), None)
        prepare = owner.__dict__["prepare_inputs_for_generation"] if owner is not None else None
        if prepare is None or owner in rows or not drops_the_mask(prepare):
            continue
        own = owner.__module__ == head.cls.__module__
        where = owner if own else head.cls
        rows[where] = Patch(
            where,
            "prepare_inputs_for_generation",
            prepare if own else ABSENT,
            _handing_the_mask_on(prepare, pin),
        )
    return list(rows.values())


def drops_the_mask(prepare: Callable) -> bool:
    """Whether ``prepare`` cannot return ``generate()``'s mask: its code names no ``attention_mask`` and
    never reads its ``**kwargs`` (where its code cannot be read: False, left as it is)."""
    tree = forward_tree(prepare)
    if tree is None:
        return False
    function = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if function is None:
        return False
    var = function.args.kwarg.arg if function.args.kwarg is not None else None
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id in ("attention_mask", var):
            return False
        if isinstance(node, ast.Constant) and node.value == "attention_mask":
            return False
        if isinstance(node, ast.arg) and node.arg == "attention_mask":
            return False
    return True


def _handing_the_mask_on(prepare: Callable, pin: Pin) -> Callable:
    @functools.wraps(prepare)
    def prepare_inputs_for_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = prepare(self, *args, **kwargs)
        mask = kwargs.get("attention_mask")
        if (
            isinstance(mask, Tensor)
            and mask.dim() == 2
            and isinstance(inputs, dict)
            and inputs.get("attention_mask") is None
            and patched_here(pin)
        ):
            inputs["attention_mask"] = mask
        return inputs

    return prepare_inputs_for_generation


def _checked_length(mask: torch.Tensor, tokens: torch.Tensor) -> int:
    """The mask's length, after checking that it is 2-D and has the inputs' batch size."""
    shape = mask.shape
    if len(shape) != 2:
        raise LeaveToStock(
            "attention_mask must be 2-D [batch, past + new tokens] (or a 4-D custom mask), "
            f"got shape {tuple(shape)}"
        )
    if shape[0] != tokens.shape[0]:
        raise LeaveToStock(f"attention_mask has batch size {shape[0]}, but the inputs have {tokens.shape[0]}")
    return shape[1]


def _where_new(num_new: int, past: Past, mask_len: Optional[int]) -> Optional[torch.Tensor]:
    """Where the new tokens sit in the mask, for :func:`new_token_positions`: ``None`` for its last
    columns (a mask of past + new tokens), else their slots (a static cache's full-length mask)."""
    if isinstance(past, int) and mask_len == past + num_new:
        return None
    if isinstance(past, torch.Tensor) and num_new == 1:  # one decode step: the fill level itself
        return past.reshape(1)
    return cache_positions(num_new, past)


def _check_given_slots(cache_position: torch.Tensor, expected: torch.Tensor) -> None:
    given = cache_position.reshape(-1)
    expected = expected.to(given.device)
    if given.shape != expected.shape or not torch.equal(given, expected):
        raise LeaveToStock(
            f"cache_position {given.tolist()} contradicts the cache, which writes these tokens at "
            f"{expected.tolist()}; this transformers release has no cache_position parameter and "
            "places new tokens after the cached ones, so pass the slots it uses or leave it out"
        )


def _attached_cache(model: Any, path: str) -> Any:
    """The static cache at ``path`` on the model (4.38-4.40 ``_setup_cache``), if any."""
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
