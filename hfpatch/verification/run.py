"""``hfpatch.verify(model)``: run padded, KV-cached batches on stock transformers and with hfpatch, and
measure every real token's output against its row run alone, unpadded, in one call.

Both sides run in the calling thread only (``unpatched()`` and ``patched()`` are thread-local): other
threads using the same model meanwhile keep what they had.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from .. import engine
from .._compat import cache_name
from ..declarations import Adapter
from ..rope import per_row_scaling, scaled_rope
from ..support import installed_transformers, wrong_with
from ..tolerances import NOISE_CAP, bound, regime, relative
from ..windows import configured_window, positional, smallest_window, text_config
from .load import (
    check_causal,
    check_runs,
    first_line,
    is_multimodal,
    load,
    plain_call,
    tiny_attention,
    under_autocast,
)
from .result import TOLERANCE, CannotVerify, Row, Verification
from .scenarios import (
    DECODER_ONLY,
    ENCODER_SCENARIO,
    MAX_ROPE_PROBE,
    MAX_WINDOW_PROBE,
    MORE_SCENARIOS,
    SCENARIOS,
    Inputs,
    PositionsByHand,
    Probe,
    is_seq2seq,
    model_probes,
    noise_tolerance,
    rows_of,
    run_alone,
    run_batch,
    seq2seq_inputs,
)

__all__ = ["verify"]


def verify(
    model: Union[str, os.PathLike, Any],
    static: bool = True,
    *,
    dtype: Optional[torch.dtype] = None,
    autocast: Optional[torch.dtype] = None,
) -> Verification:
    """Probe ``model`` for the padding and KV-cache bug, stock vs hfpatch.

    ``model`` is a causal-LM instance (or a base model: its hidden states are compared), a local
    checkpoint directory (loaded with ``from_pretrained``), or a model type (``"qwen2"``: built tiny
    from its config). The scenarios (:data:`SCENARIOS`): left padding in one call, a right-padded
    cached prefix + 1 token, variable prefixes and suffixes, a left-padded cached prefix + 2 tokens,
    and the variable one again with a ``StaticCache`` where the model takes one (cached ones only
    where the model returns a cache). Each runs on stock and with hfpatch's patch for this model, in
    this thread only, and every real token is compared with its row run alone. For a model hfpatch
    does not patch, the second column passes positions from the mask by hand: whether they would fix
    it. An encoder-decoder model (``config.is_encoder_decoder``: BART, T5, Whisper ...) runs the same
    scenarios on its decoder (``decoder_input_ids``, ``decoder_attention_mask``), each row with its own
    fixed, unpadded encoder input (token ids, or speech features built from the config), then a
    left-padded encoder input where the encoder takes token ids and a mask (its hidden states compared).
    An image-text-to-text model (PaliGemma, Qwen2-VL, LLaVA ...) runs the decoder-only scenarios on its
    text path (``input_ids`` and ``attention_mask``, no image); a prefix LM among them (PaliGemma on
    releases where a call's tokens attend each other both ways) is compared with each row alone through
    the same cached calls, with a mask of ones. Raises :class:`CannotVerify` (a ``ValueError``) for no
    such directory, an unknown model type, or a model that is none of those.

    Precision: ``dtype`` (a model type or a checkpoint directory: built or loaded in it, fp32 by default;
    an instance is checked in its own dtype) and ``autocast`` (``torch.float16`` or ``torch.bfloat16``:
    every call under ``torch.autocast``, as mixed-precision training runs); each regime is held to its
    own tolerance (:mod:`hfpatch.tolerances`), against each row alone in the same regime.

    >>> result = hfpatch.verify("qwen2")   # doctest: +SKIP
    >>> result.ok, print(result)           # doctest: +SKIP
    """
    built = isinstance(model, str) and not os.path.isdir(model)  # a model type: built tiny here
    given = isinstance(model, torch.nn.Module)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype: expected a floating-point torch dtype (or None), got {dtype!r}")
    if dtype is not None and given:
        raise ValueError("dtype: a model instance is checked in its own dtype (cast it: model.to(dtype))")
    model = load(model)
    if dtype is not None:
        model = model.to(dtype)
    precision = under_autocast(model, autocast)
    engine.discover()  # a class outside transformers defined (or loaded) since apply(): its own adapter
    model_type = getattr(model.config, "model_type", "?")
    seq2seq = is_seq2seq(model)
    inputs = _seq2seq_inputs(model, model_type) if seq2seq else DECODER_ONLY
    notes = []
    if seq2seq:
        check_runs(model, model_type, inputs)
    else:
        plain = plain_call(model, model_type)
        if plain:
            inputs = inputs._replace(uncached=True)
            notes.append("a call with the cache the model makes itself fails here: its calls run with "
                         "use_cache=False, and the KV-cached scenarios are not probed")  # fmt: skip
        if not check_causal(model, model_type, prefix_lm=is_multimodal(model), plain=plain):
            inputs = inputs._replace(prefix_lm=True)
            notes.append("a prefix LM (a call's tokens attend each other both ways): each row alone runs "
                         "through the same cached calls, with a mask of ones")  # fmt: skip
    adapter = _adapter_of_class(model) or engine.adapter_for(model_type)
    entry = engine.status().get(adapter.arch if adapter is not None else model_type)
    if adapter is not None and model_type not in (adapter.arch, *adapter.aliases):
        notes.append(f"{model_type} runs {adapter.cls}, patched by the {adapter.arch!r} adapter")
    attention = tiny_attention(model_type)
    if built and attention is not None:
        notes.append(f"built tiny with {attention} attention")
    probed = not seq2seq or _decoder_takes_positions(adapter)
    notes += _limits(model, adapter, probed=probed, rope=not seq2seq)
    if entry is not None and entry.reason and entry.state != engine.APPLIED:
        notes.append(entry.reason)
    patches = adapter is not None and engine.patchable(adapter.arch)
    if adapter is not None and adapter.family.from_mask:  # its own positions: nothing of hfpatch's to probe
        static = False  # with a StaticCache (some releases fail it on stock alike)
        notes.append("it derives its positions from the mask itself (right on stock with padding): hfpatch "
                     "keeps its packed rows only (hfpatch.testing's packed family checks them)")  # fmt: skip
    probes = _probes(model, adapter, static and adapter is not None, inputs)
    if seq2seq:
        probes += _encoder_probes(model, inputs, notes)
        if static and adapter is not None and not any(probe.cache is not None for probe in probes):
            notes.append("the decoder takes no StaticCache here: not probed")
    rows = tuple(
        _run_scenario(model, adapter if patches else None, probe, precision, autocast) for probe in probes
    )
    if seq2seq and patches and not adapter.family.seq2seq:
        notes.append(f"the {adapter.arch!r} adapter patches the decoder ({adapter.cls}) only: the encoder's "
                     "positions are transformers' (pad encoder inputs on the right)")  # fmt: skip
    not_checked = ()
    if not any(probe.scenario.cached for probe in probes):
        if not inputs.uncached:  # (said above)
            notes.append(
                "the model returns no KV cache to continue from: the cached scenarios are not probed"
            )
        not_checked = ("its KV-cached calls",)
    state = entry.state if entry is not None else "unknown to hfpatch"
    by_hand = patches or inputs.positions in inspect.signature(model.forward).parameters
    if not by_hand:
        notes.append(f"the model takes no {inputs.positions}: the second column is stock's")
    elif patches and entry.state != engine.APPLIED:
        notes.append(
            f"the {adapter.arch!r} adapter is {entry.state} here: its column is what patched() gives"
        )
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    name = str(autocast if autocast is not None else weights).removeprefix("torch.")
    regime_name = "fp32" if relative(name) is None else f"autocast {name}" if autocast else f"{name} weights"
    return Verification(model_type, state, rows, tuple(notes), patches, by_hand, not_checked, regime_name)


def _seq2seq_inputs(model: Any, model_type: str) -> Inputs:
    try:
        return seq2seq_inputs(model)
    except (AttributeError, TypeError) as exc:
        raise CannotVerify(
            f"{model_type}: cannot build its encoder input from the config: {first_line(exc)}"
        ) from exc


def _adapter_of_class(model: Any) -> Optional[Adapter]:
    """The adapter of the outermost module of ``model`` whose class is a declared target."""
    targets = {(a.module, a.cls): a for a in engine.registry().values()}
    for module in model.modules():
        adapter = engine.custom_adapter(type(module)) or targets.get(
            (type(module).__module__, type(module).__name__)
        )
        if adapter is not None:
            return adapter
    return None


def _limits(model: Any, adapter: Optional[Adapter], probed: bool = True, rope: bool = True) -> list[str]:
    """The adapter's declared limits, and (``probed``: a model whose windows the scenarios reach; ``rope``:
    and its rope scaling, a decoder-only model's) what its config sets that the scenarios do not probe."""
    notes = list(adapter.limits) if adapter is not None else []
    attention = getattr(text_config(model), "_attn_implementation", None)
    if adapter is not None and isinstance(attention, str):
        wrong = wrong_with(adapter, attention, installed_transformers())
        notes += [wrong] if wrong else []
    if not probed:
        return notes
    window = smallest_window(model, adapter.cls if adapter is not None else None)
    configured = configured_window(model)
    if configured and (adapter is None or not positional(model, adapter.cls)):
        if not any("sliding window" in note for note in notes):
            text = f"sliding window / chunked attention ({configured} tokens) left to transformers here"
            notes.append(f"{text}: where its mask applies it, by cache column, a hole from a padded "
                         "cached prefix inside the window stays wrong")  # fmt: skip
    elif window and window > MAX_WINDOW_PROBE:
        notes.append(f"sliding window / chunked attention ({window} tokens): not probed here")
    if not rope:
        return notes
    scaled = scaled_rope(model)
    if scaled is not None:
        kind, threshold = scaled
        if not per_row_scaling(kind):
            notes.append(f"{kind} rope scales rows by the batch's longest on transformers "
                         f"{installed_transformers()} (per row from 4.51, dynamic from 4.56)")  # fmt: skip
        if threshold > MAX_ROPE_PROBE:
            notes.append(f"{kind} rope past the original context ({threshold} tokens): not probed here")
    return notes


def _decoder_takes_positions(adapter: Optional[Adapter]) -> bool:
    """A seq2seq decoder whose forward takes ``position_ids`` (T5Gemma ...): its windows are hfpatch's to
    decide, as a decoder-only model's (the others have none)."""
    return adapter is not None and adapter.family.seq2seq and adapter.family.hands_to is None


def _probes(model: Any, adapter: Optional[Adapter], static: bool, inputs: Inputs) -> list[Probe]:
    """Each scenario this model can run (the oracle's: hfpatch.testing runs the same), past its window
    wherever its config sets one (decided by position or not), rope scaling of decoder-only models."""
    if adapter is not None and positional(model, adapter.cls):
        window = smallest_window(model, adapter.cls)
    else:  # transformers' own window (a declared limit where it is by cache column): probed all the same
        window = configured_window(model)
    rope = None if is_seq2seq(model) else scaled_rope(model)  # rope scaling of a decoder: not probed yet
    return model_probes(model, (*SCENARIOS, *MORE_SCENARIOS), inputs, static, window, rope).probes


def _encoder_probes(model: Any, decoder: Inputs, notes: list[str]) -> list[Probe]:
    """A left-padded encoder input, where the encoder takes token ids and a mask; each row with its own
    decoder tokens, unpadded. Its hidden states at real tokens are compared."""
    params = inspect.signature(model.forward).parameters
    if model.main_input_name != "input_ids" or "attention_mask" not in params:
        notes.append(f"the encoder takes {model.main_input_name}: encoder padding is not probed")
        return []
    tokens = torch.tensor(
        [row[:3] for row in rows_of(ENCODER_SCENARIO, decoder.pad)]
    )  # 3 decoder tokens each
    inputs = Inputs(fixed=(("decoder_input_ids", decoder.tokens(tokens)),), pad=decoder.pad, encoder=True)
    return [Probe(ENCODER_SCENARIO.name, ENCODER_SCENARIO, inputs=inputs)]


def _run_scenario(
    model: Any, adapter: Optional[Adapter], probe: Probe, precision: Callable[[], Any], autocast: Any
) -> Row:
    """Stock, then hfpatch (or, for a model hfpatch does not patch here, positions by hand), each against
    every row alone, every call inside ``precision()`` (autocast, or nothing); in half precision the
    tolerance is the regime's; in fp32, where the judged side is past the fp32 tolerance by no more than
    fp32 noise could be, the scenario's control (its rows right-padded in one call, on that side) sets
    it."""
    scenario, inputs, name = probe.scenario, probe.inputs, cache_name(model)
    rows = rows_of(scenario, inputs.pad)
    by_hand = adapter is None and inputs.positions in inspect.signature(model.forward).parameters
    judged = "hfpatch" if adapter is not None else "stock"

    def side(which: str) -> Any:  # the context and the callable of one side
        if adapter is None:  # not patched here: stock, then positions from the mask by hand
            return engine.unpatched(), (
                PositionsByHand(model, inputs) if which == "hfpatch" and by_hand else model
            )
        return (engine.unpatched(adapter.arch) if which == "stock" else engine.patched(adapter.arch)), model

    results, errors = {}, []
    try:
        with engine.unpatched(), precision():
            alone = [run_alone(model, r, row, name, inputs, [c[r] for c in scenario.chunks])
                     for r, row in enumerate(rows)]  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a crash is a result of the probe
        text = f"{type(exc).__name__}: {first_line(exc, 100)}"
        return Row(probe.name, float("nan"), float("nan"), f"both sides: {text}")
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    half = regime(alone[0].dtype, weights, autocast)
    tolerance = bound(half, max(a.abs().max().item() for a in alone))
    for which in ("stock", "hfpatch"):
        context, call = side(which)
        try:
            with context, precision():
                got = run_batch(call, rows, scenario, name, probe.cache, probe.width, inputs)
                results[which] = max((own - out).float().abs().max().item() for own, out in zip(alone, got))
        except Exception as exc:  # noqa: BLE001 - a crash is a result of the probe
            results[which] = float("nan")
            errors.append((which, f"{type(exc).__name__}: {first_line(exc, 100)}"))
            continue
        if which == judged and relative(half) is None and TOLERANCE < results[which] <= NOISE_CAP:
            context, call = side(which)  # a fresh context
            with context:
                tolerance = noise_tolerance(call, rows, scenario, name, inputs, alone)
    if len(errors) == 2 and errors[0][1] == errors[1][1]:  # the same on both sides: said once
        return Row(probe.name, results["stock"], results["hfpatch"], f"both sides: {errors[0][1]}", tolerance)
    error = "; ".join(f"{which}: {text}" for which, text in errors)
    return Row(probe.name, results["stock"], results["hfpatch"], error, tolerance)
