"""A padded call at the cost of its real tokens (``hfpatch.apply(unpad=True)``, ``HFPATCH_UNPAD=1``).

A call whose 2-D mask pads some row, with nothing cached before it, runs on its real tokens alone: the
rows' real tokens are gathered into one packed row (each row a sequence of its own, its positions the
mask's, or the caller's at those tokens), which the packed path keeps to its sequences
(:mod:`hfpatch.packed`: SDPA runs each on its own), and what comes back is put in the caller's layout:

- a causal LM's task head (the class with ``labels`` and ``logits_to_keep``) is unpadded itself, so that
  its LM head and loss run on the real tokens too: the caller's labels, shifted as the padded call would
  shift them, are laid so that the head's own loss function pairs each real token's logits with the same
  target (``num_items_in_batch`` and the rest go through unchanged); its logits, hidden states and cache
  come back padded;
- any other call of a patched base model (a sequence-classification head's, an embedding model's) is
  unpadded at the base model: its hidden states come back padded, and the head pools them as it would.

Where the result would not be the padded call's, the call is padded as usual, and why is counted
(:data:`hfpatch._context.UNPADDED`, ``status().unpadded``): an output read at a pad (a label predicted
from a pad or given at one, a loss over every position: question answering's spans, logits kept at a
pad: ``logits_to_keep`` over a right-padded row, as ``generate()`` keeps them), attention weights or
router logits asked for (by keyword or the config), hidden states asked for with gradients on (those of
an unpadded call are copies, off the outputs' graph), a cache that continues, a cache the result could
not be laid back into, inputs given by embeddings, inputs this does not know, a model whose packed rows
are not kept (an encoder-decoder or vision-language model, whose calls are counted too), compiled code.
A pad's outputs in the unpadded result are zeros (logits and hidden states): nothing transformers
computes from a call reads them; its real tokens' are those of the packed call. A call without padding
costs one read of its mask (``has_padding``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from . import caches
from ._compat import CACHE_NAMES, STATE, STATE_NAMES, asked, at_trace_time, cache_name, output_cache, passed
from ._context import CALL, PACKED, UNPAD, Pin, count_unpadded, patched_here
from .layout import Layout, Padded
from .packed import NOT_KEPT, SPANS
from .positions import padded_on_host, positions_from_mask
from .sources import hands_state
from .windows import (
    FULL,
    attention_kinds,
    by_sequence_compiled,
    layer_types,
    packed_not_kept,
    text_config,
    whole_cache,
)

__all__ = ["causal_lm_head", "gate", "laid_out", "padded_back", "read_at_a_pad", "unpadding"]

IGNORE = -100  # transformers' label that no loss reads
# unpadded where the real tokens are at most this share of the slots: gathering, the mask by sequence and
# padding back cost a few per cent of a call (benchmarks/RESULTS.md: about even at 85-90 % real tokens)
WORTH = 0.85
# what a call may carry besides the padded inputs to be unpadded (else: padded as usual)
TAKEN = frozenset({
    "input_ids", "attention_mask", "position_ids", "labels", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "logits_to_keep", "num_logits_to_keep",
    "num_items_in_batch", *CACHE_NAMES,
})  # fmt: skip


def _why_padded(model: Any, kwargs: dict, masks: Any, cache_kw: Optional[str], host: Host) -> Optional[str]:
    """Why the call in ``kwargs`` (a 2-D mask with padding, nothing cached; ``host``, what the host read of
    it) keeps the padded path, or None: it may run on its real tokens."""
    if not PACKED[0]:
        return "packed rows left to stock"
    if host.index.numel() > WORTH * host.real.numel():
        return f"too few pads to pay (under {1 - WORTH:.0%} of the slots)"
    if kwargs.get("input_ids") is None:
        return "inputs given by embeddings"
    config = text_config(model)
    if asked(kwargs, config, "output_attentions"):
        return "attention weights asked for"
    if asked(kwargs, config, "output_router_logits"):
        return ROUTER_LOGITS
    if asked(kwargs, config, "output_hidden_states") and torch.is_grad_enabled():
        return "hidden states asked for with gradients on"
    if any(isinstance(v, Tensor) for k, v in kwargs.items() if k not in TAKEN):
        return "inputs it does not know"
    if masks is not None and packed_not_kept(model, masks, masked=False) not in (None, ""):
        return NOT_KEPT  # (no masks at all: a model of state layers alone, which keep its sequences)
    cache = passed(kwargs, (*CACHE_NAMES, *STATE_NAMES))
    if cache is not None and (
        caches.uncounted(cache) or caches.capacity(cache) is not None or caches.past_length(cache)
    ):
        return "a cache that is continued or static"
    wants = kwargs.get("use_cache")
    wants = getattr(config, "use_cache", False) if wants is None else wants
    if wants and hands_state(model) and cache_name(model) != STATE:
        return "a cache of its own to return (xLSTM's: made at the call's batch size, its states copied in)"
    kinds = set(attention_kinds(layer_types(config, masks), masks)) if masks is not None else {FULL}
    if wants and cache_kw is not None and kinds != {FULL}:
        # sliding layers would keep the packed row's last columns: the cache the model would make (or the
        # caller's empty one) with them kept whole, laid back whole (what hfpatch's windows keep anyway)
        if whole_cache(model, masks, config, cache_kw, kwargs, cache) in (False, None):
            return "a cache with sliding layers to return"
    return None


ROUTER_LOGITS = "router logits asked for (their auxiliary loss reads the padded layout)"


class Host(NamedTuple):
    """What a call's one host read gave (:func:`read_host`): ``real`` ``[batch, length]`` bool (the mask),
    and where the call has them, ``targets`` (a token-level target there), ``foreign`` (an id that is not
    the pad id) and ``positions`` (the caller's); ``index``, the real tokens' flat numbers over ``batch x
    length``."""

    real: Tensor
    index: Tensor
    targets: Optional[Tensor] = None
    foreign: Optional[Tensor] = None
    positions: Optional[Tensor] = None


def read_host(kwargs: dict, targets: Any = None, pad_id: Any = None) -> Optional[Host]:
    """The :class:`Host` of a call whose 2-D mask pads some row, read in one copy with the token-level
    ``targets`` (where given), the ids against ``pad_id`` (where given) and the caller's positions; None
    for a call without padding (or compiled code)."""
    mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
    names, alongside = [], []
    if isinstance(targets, Tensor) and isinstance(mask, Tensor) and targets.shape == mask.shape:
        names.append("targets")
        alongside.append(targets != IGNORE)
    if pad_id is not None and isinstance(ids, Tensor) and ids.dim() == 2:
        names.append("foreign")
        alongside.append(ids != pad_id)
    given = kwargs.get("position_ids")
    if isinstance(given, Tensor) and given.dim() == 2 and isinstance(mask, Tensor) and mask.dim() == 2:
        if given.shape[-1] == mask.shape[-1] and given.shape[0] in (1, mask.shape[0]):
            names.append("positions")
            alongside.append(given)
    host = padded_on_host(kwargs, *alongside)
    if host is None:
        return None
    read = {name: host[i + 1] if name == "positions" else host[i + 1] != 0 for i, name in enumerate(names)}
    real = host[0] != 0
    return Host(real, real.reshape(-1).nonzero().squeeze(1), **read)


def laid_out(kwargs: dict, host: Host) -> Optional[tuple[dict, Layout]]:
    """The call's inputs as one packed row (its rows' real tokens, their positions) and the row's
    :class:`~hfpatch.layout.Layout` for its packed call (each row a sequence: no detection there; where
    the tokens came from, its ``padded``), all from the host's read; None where a row's positions run on
    into the next (the packed row could not tell them apart)."""
    mask, ids = kwargs["attention_mask"], kwargs["input_ids"]
    batch, length = ids.shape
    index_host = host.index
    rows_host = torch.div(index_host, length, rounding_mode="floor")
    index, rows = (t.to(ids.device, non_blocking=True) for t in (index_host, rows_host))
    padded = Padded(index, batch, length)
    if host.positions is None:
        positions = padded.gather(positions_from_mask(mask))
    else:
        gathered = host.positions.expand(batch, length).reshape(-1)[index_host]
        runs_on = (rows_host[1:] != rows_host[:-1]) & (gathered[1:] == gathered[:-1] + 1)
        if bool(runs_on.any()):
            return None
        positions = padded.gather(kwargs["position_ids"].expand(batch, length))
    packed = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "position_ids")}
    packed["input_ids"] = padded.gather(ids)
    packed["position_ids"] = positions
    return packed, _packed_row(positions, rows[None], rows_host[None], padded)


def _packed_row(positions: Tensor, rows: Tensor, rows_host: Tensor, padded: Padded) -> Layout:
    """The layout of an unpadded call's packed row: every token real, each row (of ``padded``'s batch) a
    sequence of its own."""
    real = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    return Layout(real, positions, rows, (torch.ones_like(rows_host, dtype=torch.bool), rows_host), padded)


def padded_back(result: Any, padded: Padded) -> Any:
    """The packed call's result in the caller's layout: every ``[1, tokens, ...]`` tensor (logits, hidden
    states, each layer's) padded back, zeros at the pads; a cache laid back into the padded rows."""

    tokens = (len(padded.index), len(padded.index) + 1)  # (and the one a causal head may add)

    def back(value: Any) -> Any:
        if isinstance(value, Tensor):
            token_level = value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] in tokens
            return padded.scatter(value) if token_level else value
        if isinstance(value, tuple) and value and all(isinstance(v, tuple) for v in value):  # a legacy cache
            return tuple(tuple(caches.padded_states(t, *padded) for t in kv) for kv in value)
        if isinstance(value, tuple):
            return tuple(back(v) for v in value)
        if value is not None and not isinstance(value, (list, dict)):
            caches.lay_back(value, *padded)
        return value

    if isinstance(result, tuple):
        return type(result)(back(v) for v in result)
    for key in list(result.keys()):
        result[key] = back(result[key])
    return result


def unpadding(
    call: Callable[..., Any], model: Any, kwargs: dict, masks: Any, cache_kw: Optional[str], host: Host
) -> Any:
    """Run a base model's call on its real tokens (``call``: the patched forward, bound), or return
    :data:`PADDED` where it keeps the padded path (counted, with why)."""
    why = _why_padded(model, kwargs, masks, cache_kw, host)
    found = laid_out(kwargs, host) if why is None else None
    if found is None:
        count_unpadded(why or RUNS_ON)
        return PADDED
    return _run_packed(call, *found)


RUNS_ON = "the caller's positions run on from one row into the next"


def _run_packed(call: Callable[..., Any], packed: dict, laid: Layout) -> Any:
    """``call`` on the packed row, its layout handed on (``CALL.laid``: its packed call detects nothing),
    the result padded back; counted as unpadded."""
    count_unpadded(None)
    CALL.ran_unpadded += 1
    before = CALL.unpadding, CALL.laid
    CALL.unpadding, CALL.laid = True, laid
    given = passed(packed, CACHE_NAMES)
    try:
        result = padded_back(call(**packed), laid.padded)
    finally:
        CALL.unpadding, CALL.laid = before
    if given is not None and output_cache(result) is not given:  # (a model that returns none: RecurrentGemma)
        caches.lay_back(given, *laid.padded)
    return result


PADDED = object()  # what :func:`unpadding` returns for a call that keeps the padded path


# --- task heads ---------------------------------------------------------------------------------------


def causal_lm_head(cls: type) -> bool:
    """A causal LM's task head: its ``forward`` takes ``labels`` and ``logits_to_keep`` (or 4.45-4.49's
    ``num_logits_to_keep``; before those, a class named as transformers names its causal LMs), whose LM
    head runs on the last hidden states and whose loss shifts the labels by one."""
    try:
        params = inspect.signature(cls.__dict__["forward"]).parameters
    except (KeyError, TypeError, ValueError):
        return False
    named = cls.__name__.endswith(("ForCausalLM", "LMHeadModel"))
    return "labels" in params and ("logits_to_keep" in params or "num_logits_to_keep" in params or named)


def gate(
    original: Callable,
    pin: Pin,
    masks: Any,
    cache_kw: Optional[str],
    causal: bool,
    pools: bool = False,
    mixes: bool = False,
) -> Callable:
    """The ``forward`` of a task head of a patched model, while ``apply(unpad=True)`` holds: a causal LM's
    head unpadded itself (its LM head and loss on the real tokens); any head's call checked for an output
    it reads at a pad (:func:`read_at_a_pad`), so that its base model is not unpadded there
    (``CALL.unpad``)."""
    positional = [
        p.name
        for p in list(inspect.signature(original).parameters.values())[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not UNPAD[0] or CALL.unpadding or not patched_here(pin):
            return original(self, *args, **kwargs)
        named = _named(args, kwargs, positional)
        if named is None:
            return original(self, *args, **kwargs)  # (its own TypeError)
        if torch.compiler.is_compiling():
            compiles = causal and not mixes  # (a compiled packed row's state layers are not kept apart)
            found = _compiled_row(self, named, masks, cache_kw, compiles)
            if found is None:  # (said why: counted at the graph break, or once a graph while traced)
                if not compiles:
                    _compiled()
                return original(self, *args, **kwargs)
            packed, padded = found  # (the graph resumes here: the packed call and its padding back, traced)
            return padded_back(original(self, **packed), padded)
        kwargs = named
        mask = kwargs.get("attention_mask")
        labels = kwargs.get("labels")
        targets = _shifted(labels, mask) if causal and isinstance(mask, Tensor) else labels
        pad_id = getattr(self.config, "pad_token_id", None) if pools else None
        host = read_host(kwargs, targets, pad_id)
        if host is None:
            return original(self, **kwargs)
        why = read_at_a_pad(kwargs, host, causal, pools, pad_id)
        allowed = why is None  # (its base model, unpadded)
        if not allowed:
            count_unpadded(why)
        elif causal and _keeps(kwargs) is None:
            result = _head_unpadded(original, self, kwargs, targets, masks, cache_kw, host)
            if result is not PADDED:
                return result
            allowed = False  # (why is counted: its base model would find the same)
        before, CALL.unpad, ran = CALL.unpad, allowed, CALL.ran_unpadded
        try:
            result = original(self, **kwargs)
        finally:
            CALL.unpad = before
        if CALL.ran_unpadded == ran:  # (its base kept the padded path: every logit as stock's)
            return result
        return _kept_pads_zero(result, host, _keeps(kwargs), labels is not None)

    return forward


COMPILED = "compiled, not a causal LM's head, or with layers that carry a state (counted once a graph)"
ONE_GRAPH = "compiled with fullgraph=True or exported (no graph break for the host's read: once a graph)"
COMPILED_DENSE = "compiled, where its packed row's attention is not run by sequence (dense masks)"


@at_trace_time
def _compiled() -> bool:
    count_unpadded(COMPILED)
    return True


@at_trace_time
def _one_graph() -> bool:
    """Whether the graph being traced may not break (``fullgraph=True``, export; or dynamo's tracer does
    not say: torch releases that hold it elsewhere), counted once a graph: read by dynamo while it traces."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        one = bool(tx.one_graph or getattr(tx, "error_on_graph_break", False) or getattr(tx, "export", False))
    except Exception:  # noqa: BLE001 (a tracer of another torch: no break risked)
        one = True
    if one:
        count_unpadded(ONE_GRAPH)
    return one


def _named(args: tuple, kwargs: dict, positional: list) -> Optional[dict]:
    """A head's call's arguments by name (its positional ones named as its ``forward`` names them), or
    None where they do not bind (the call's own ``TypeError`` is the original's to raise)."""
    if not args:
        return kwargs
    if len(args) > len(positional) or any(name in kwargs for name in positional[: len(args)]):
        return None
    return {**kwargs, **dict(zip(positional, args))}


def _compiled_row(
    model: Any, kwargs: dict, masks: Any, cache_kw: Any, compiles: bool
) -> Optional[tuple[dict, Padded]]:
    """A compiled causal LM head's call as its packed row and where to pad it back, or None (it
    stays padded, counted): the host's read and every decision in eager mode, a graph break
    (:data:`_EAGER`) where the graph may break, so that the packed call after it is traced on the real
    tokens alone (their count a dynamic size from the second count on: two graphs for a stream of them);
    where the graph may not break, it stays padded."""
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if not (isinstance(ids, Tensor) and isinstance(mask, Tensor) and ids.dim() == 2 and ids.shape[1] > 1):
        return None  # (by shapes alone, no graph break: a decode step, inputs by embeddings, no mask)
    if mask.shape != ids.shape or not compiles or _one_graph():
        return None
    return _EAGER(model, kwargs, masks, cache_kw)


def _compiled_row_eagerly(
    model: Any, kwargs: dict, masks: Any, cache_kw: Any
) -> Optional[tuple[dict, Padded]]:
    mask = kwargs["attention_mask"]
    targets = _shifted(kwargs.get("labels"), mask)
    host = read_host(kwargs, targets)
    if host is None:
        return None
    why = read_at_a_pad(kwargs, host, True, False, None)
    if why is None and _keeps(kwargs) is not None:
        why = "compiled, some logits kept (their pads' zeros: eager mode only)"
    if why is None and not by_sequence_compiled(getattr(model, model.base_model_prefix, model), masks):
        why = COMPILED_DENSE
    if why is not None:
        count_unpadded(why)
        return None
    found = _head_packed(model, kwargs, targets, masks, cache_kw, host)
    if found is None:
        return None
    count_unpadded(None)
    return found[0], found[1].padded  # (the packed call detects its own layout, traced)


# the eager work of a compiled call (torch.compiler.disable: a graph break before it, the graph resumed
# after; nothing it calls traced)
_EAGER = getattr(getattr(torch, "compiler", None), "disable", lambda f: f)(_compiled_row_eagerly)


KEEPS = ("logits_to_keep", "num_logits_to_keep")  # (4.45-4.49 call it num_logits_to_keep)


def _keeps(kwargs: dict) -> Any:
    """The call's ``logits_to_keep`` where it keeps some columns only (a count of last columns, or their
    indices), else None."""
    kept = passed(kwargs, KEEPS)
    return None if kept is None or (isinstance(kept, int) and kept == 0) else kept


def read_at_a_pad(kwargs: dict, host: Host, causal: bool, pools: bool, pad_id: Any) -> Optional[str]:
    """Why a head's call would read an output at a pad (then its base model keeps the padded path), or
    None, from the host's read: a token-level target at a pad (a causal LM's: the next column's label), a
    loss over every position (question answering's ``start_positions``/``end_positions``), a token pooled
    by the pad id (``pools``) where a pad's id is not it, a ``generate()`` prompt whose last column is a
    pad (the next token is read there). Logits kept at a pad (``logits_to_keep`` over right-padded
    completions, as RL scoring keeps them) are no reason: they follow the rule for pads (zeros)."""
    real = host.real
    if kwargs.get("attention_mask") is CALL.generating and not bool(real[:, -1].all()):
        return "a right-padded generate() prompt (its next token is read at a pad)"
    if host.targets is not None and bool((host.targets & ~real).any()):
        return "a label predicted from a pad" if causal else "a label at a pad"
    if any(kwargs.get(name) is not None for name in SPANS):
        return "a loss over every position"
    if pools and (pad_id is None or (host.foreign is not None and bool((host.foreign & ~real).any()))):
        return "a token pooled by the pad id, whose id a pad does not have"
    return None


def _kept_pads_zero(result: Any, host: Host, kept: Any, has_loss: bool) -> Any:
    """A causal LM head's result whose ``logits_to_keep`` kept some pads' columns, with those logits
    zeros, as an unpadded call's pads' are (the head saw their hidden states as zeros: its bias, or a
    softcap's, would show there)."""
    if kept is None:
        return result
    columns = host.real[:, -kept:] if isinstance(kept, int) else host.real[:, kept.cpu()]
    logits = result.logits if hasattr(result, "logits") else result[1 if has_loss else 0]
    if not isinstance(logits, Tensor) or logits.shape[:2] != columns.shape or bool(columns.all()):
        return result
    zeroed = logits.masked_fill(~columns.to(logits.device, non_blocking=True)[..., None], 0)
    if hasattr(result, "logits"):
        result.logits = zeroed
        return result
    return (*result[: 1 if has_loss else 0], zeroed, *result[2 if has_loss else 1 :])


def _shifted(labels: Any, mask: Tensor) -> Any:
    """The target of each token, as a causal LM's loss pairs them: the next column's label."""
    if not isinstance(labels, Tensor) or labels.shape != mask.shape:
        return labels
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)


def _head_unpadded(
    original: Callable,
    model: Any,
    kwargs: dict,
    targets: Any,
    masks: Any,
    cache_kw: Optional[str],
    host: Host,
) -> Any:
    """A causal LM head's call on its real tokens: the packed row, its labels laid so that the head's loss
    (which pairs each token with the next label) pairs each real token with its own target, and a
    sequence of one pad after it where the last real token has one; the result padded back."""
    found = _head_packed(model, kwargs, targets, masks, cache_kw, host)
    if found is None:
        return PADDED
    return _run_packed(functools.partial(original, model), *found)


def _head_packed(
    model: Any, kwargs: dict, targets: Any, masks: Any, cache_kw: Optional[str], host: Host
) -> Optional[tuple[dict, Layout]]:
    """A causal LM head's call as its packed row (the labels laid for the head's loss), where it is laid
    and the row's layout; None where it keeps the padded path (counted, with why)."""
    base = getattr(model, model.base_model_prefix, model)
    why = _why_padded(base, kwargs, masks, cache_kw, host)
    found = laid_out(kwargs, host) if why is None else None
    if found is None:
        count_unpadded(why or RUNS_ON)
        return None
    packed, laid = found
    padded = laid.padded
    if isinstance(targets, Tensor):
        own = padded.gather(targets[..., None])[..., 0]  # [1, real tokens]
        last = host.index[-1]
        tail = host.targets is not None and bool(host.targets.reshape(-1)[last])
        if tail:  # one more token, a sequence of its own, whose label is the last real token's target
            packed["input_ids"] = torch.nn.functional.pad(packed["input_ids"], (0, 1))
            packed["position_ids"] = torch.nn.functional.pad(packed["position_ids"], (0, 1))
            ends = (laid.segment_ids, laid.host[1])  # (the device's and the host's)
            rows, rows_host = (torch.nn.functional.pad(t, (0, 1), value=padded.batch) for t in ends)
            laid = _packed_row(packed["position_ids"], rows, rows_host, padded)
        packed["labels"] = torch.cat([own.new_full((1, 1), IGNORE), own if tail else own[:, :-1]], 1)
    return packed, laid
