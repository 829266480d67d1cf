"""The reference for padding invariance, for any forward: padded and KV-cached batches must give every real
token the outputs of its row run alone, unpadded, in one call.

>>> from hfpatch.testing import assert_padding_invariant
>>> report = assert_padding_invariant(model)      # doctest: +SKIP  (raises AssertionError with a table)

It runs whatever is installed (stock transformers, hfpatch, a library's kernels, your own model or loop)
on the scenarios :func:`hfpatch.verify` runs, and more: left and right padding in one call; a
right-padded cached prefix continued by one token and by several (holes in the mask); a left-padded
prefix continued by a chunk; rows split into several cached calls; a ``StaticCache`` where the model
takes one; a prefix past the sliding window where the model has one; rows on both sides of the
original context where its rope is scaled by the length; rows that pack several sequences (positions
restarting), each against itself alone. ``pytest`` gets it as the fixture
``assert_padding_invariant`` (:mod:`hfpatch.testing.plugin`); :mod:`hfpatch.testing.strategies` has
hypothesis strategies for scenarios of your own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import torch

from .._compat import cache_name
from ..rope import scaled_rope
from ..tolerances import NOISE_CAP, bound, regime, relative
from ..verification.load import (
    check_causal,
    check_runs,
    first_line,
    is_multimodal,
    plain_call,
    under_autocast,
)
from ..verification.result import CannotVerify
from ..verification.scenarios import (
    CACHED,
    DECODER_ONLY,
    MORE_SCENARIOS,
    PACKED,
    PACKED_SCENARIOS,
    PADDING,
    ROPE,
    SCENARIOS,
    STATIC,
    WINDOW,
    Probe,
    Scenario,
    is_seq2seq,
    model_probes,
    noise_tolerance,
    probes,
    rows_of,
    run_alone,
    run_batch,
    seq2seq_inputs,
)
from ..windows import configured_window

__all__ = [
    "FAMILIES",
    "CannotCheck",
    "InvariantReport",
    "Result",
    "Scenario",
    "assert_padding_invariant",
    "tolerance_for",
]


class CannotCheck(Exception):
    """``assert_padding_invariant`` could not check the model at all (no scenario could run, or the model
    is not one it can run as given): not an ``AssertionError``, so that ``pytest.raises(AssertionError)``
    never passes on a forward nobody checked."""


FAMILIES = (PADDING, CACHED, STATIC, WINDOW, ROPE, PACKED)


def tolerance_for(dtype: torch.dtype, scale: float = 1.0) -> float:
    """The default tolerance for a regime of ``dtype`` (the weights', or autocast's): 1e-5 in fp32 and
    fp64; in fp16 and bf16 a share of ``scale`` (the largest |output| of the rows alone, at least 1).
    :mod:`hfpatch.tolerances` states them."""
    return bound(dtype, scale)


class Result(NamedTuple):
    """One row of one scenario: its largest |difference| from the row alone, and the first of its real
    tokens beyond the tolerance (None: none)."""

    scenario: str
    row: int
    tokens: int
    max_diff: float
    first_wrong: Optional[int]


class InvariantReport(NamedTuple):
    """What :func:`assert_padding_invariant` found: a :class:`Result` per row of each scenario run, the
    tolerance, the dtype, and what it did not run (and why)."""

    results: tuple[Result, ...]
    tolerance: float
    dtype: str
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return all(result.first_wrong is None for result in self.results)

    @property
    def failures(self) -> tuple[Result, ...]:
        return tuple(result for result in self.results if result.first_wrong is not None)

    def __str__(self) -> str:
        scenarios = list(dict.fromkeys(result.scenario for result in self.results))
        shown = self.failures if not self.ok else self.results
        head = (
            f"padding invariance holds: {len(scenarios)} scenarios"
            if self.ok
            else f"padding invariance broken: {len({r.scenario for r in self.failures})} of {len(scenarios)} "
            "scenarios"
        )
        lines = [f"{head} (tolerance {self.tolerance:.1e}, {self.dtype}; each real token vs its row alone)"]
        if self.ok:  # one line a scenario: its worst row
            worst = {result.scenario: result for result in sorted(self.results, key=lambda r: r.max_diff)}
            shown = tuple(worst[name] for name in scenarios)
        width = max([8, *(len(result.scenario) for result in shown)])
        lines.append(f"  {'scenario':{width}}  row  max|diff|  first wrong token")
        for result in shown:
            wrong = "-" if result.first_wrong is None else f"{result.first_wrong} of {result.tokens}"
            lines.append(f"  {result.scenario:{width}}  {result.row:>3}  {result.max_diff:9.1e}  {wrong}")
        lines += [f"  not run: {note}" for note in self.notes]
        return "\n".join(lines)


def assert_padding_invariant(
    model: Any,
    *,
    vocab_size: Optional[int] = None,
    tolerance: Optional[float] = None,
    families: Optional[Iterable[str]] = None,
    scenarios: Optional[Sequence[Scenario]] = None,
    pad_token_id: int = 0,
    autocast: Optional[torch.dtype] = None,
) -> InvariantReport:
    """Assert that ``model`` gives every real token of padded, KV-cached batches the outputs of its row run
    alone, unpadded, in one call; return the :class:`InvariantReport`, or raise an ``AssertionError``
    whose message is its table (scenario, row, max |diff|, the first wrong token).

    ``model``: a transformers model (a causal LM, a vision-language model's text path, an
    encoder-decoder model's decoder; logits compared, or a base model's hidden states), or any callable
    that takes the model calling convention (``input_ids``, ``attention_mask``, the cache as
    ``past_key_values`` or ``cache``, ``use_cache``) and returns an output with ``.logits`` and, for a
    cached call, the cache (``.past_key_values`` or ``.cache``). ``vocab_size``: the token ids to draw
    from, where the model has no config to read it from. ``tolerance``: max |difference| allowed (default
    :func:`tolerance_for` the outputs' dtype). ``families``: which of :data:`FAMILIES` to run (default
    all that apply), or ``scenarios`` of your own (:mod:`hfpatch.testing.strategies`). ``autocast``:
    ``torch.float16`` or ``torch.bfloat16`` to run every call (batched and alone) under ``torch.autocast``,
    as mixed-precision training does, held to that dtype's tolerance; the model's own dtype is checked as
    it is (``model.to(torch.bfloat16)`` first for half weights). Deterministic: the rows are fixed token
    ids; nothing else is drawn. Runs with gradients off; the model's mode is its own (call ``.eval()``
    first: dropout differs from call to call)."""
    wanted = _families(families)
    precision = under_autocast(model, autocast)
    if tolerance is not None and (
        isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0
    ):
        raise ValueError(f"tolerance: expected a number >= 0 (or None), got {tolerance!r}")
    try:
        runs, notes = _runs(model, vocab_size, wanted, scenarios, pad_token_id)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CannotVerify):  # the model cannot be checked as given (not a causal LM ...)
            raise CannotCheck(f"padding invariance not checked: {exc}") from exc
        raise
    except Exception as exc:  # noqa: BLE001 - the model raised before any scenario: one line, documented
        why = f"preparing the scenarios raised {type(exc).__name__}: {first_line(exc)}"
        raise CannotCheck(f"padding invariance not checked: {why}") from exc
    results, dtype, largest = [], None, 0.0
    computed, errors = [], []
    for probe, call, cache_kw, vocab in runs:
        inputs = probe.inputs or DECODER_ONLY
        rows = rows_of(probe.scenario, inputs.pad, vocab)
        try:
            with precision():
                got = run_batch(call, rows, probe.scenario, cache_kw, probe.cache, probe.width, inputs)
                alone = [
                    run_alone(call, r, row, cache_kw, inputs, [c[r] for c in probe.scenario.chunks])
                    for r, row in enumerate(rows)
                ]
        except Exception as exc:  # noqa: BLE001 - a scenario that cannot run is reported, the others decide
            errors.append(f"{probe.name} raised {type(exc).__name__}: {first_line(exc)}")
            continue
        dtype = dtype or got[0].dtype
        largest = max([largest, *(a.abs().max().item() for a in alone)])
        computed.append((probe, got, alone, (call, rows, probe.scenario, cache_kw, inputs)))
    if dtype is None:
        raise CannotCheck(
            "padding invariance not checked: no scenario could run (" + "; ".join([*errors, *notes]) + ")"
        )
    dtype = regime(dtype, _weights_dtype(model), autocast)
    base = tolerance if tolerance is not None else tolerance_for(dtype, largest)
    bound = base
    for probe, got, alone, control in computed:
        allowed = base
        worst = max((g.float() - a.float()).abs().max().item() for g, a in zip(got, alone))
        if tolerance is None and relative(dtype) is None and base < worst <= NOISE_CAP:
            # fp32's own noise at these lengths and splits (controls that change no position), where it
            # is more than the base tolerance: four times it, at most NOISE_CAP
            allowed = max(base, noise_tolerance(*control, alone))
        bound = max(bound, allowed)
        for r, (batch_row, own) in enumerate(zip(got, alone)):
            diffs = (batch_row.float() - own.float()).abs().flatten(1).amax(-1)  # per token
            wrong = (diffs > allowed).nonzero()
            first = int(wrong[0, 0]) if len(wrong) else None
            results.append(Result(probe.name, r, len(diffs), diffs.max().item(), first))
    notes = [*notes, *(f"{error} (the other scenarios decide)" for error in errors)]
    report = InvariantReport(tuple(results), bound, str(dtype).removeprefix("torch."), tuple(notes))
    if not report.ok:
        raise AssertionError(str(report))
    return report


def _weights_dtype(model: Any) -> Optional[torch.dtype]:
    """The dtype of a module's first floating-point parameter (None for a callable that is no module)."""
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    return next((p.dtype for p in parameters() if p.is_floating_point()), None)


def _families(families: Optional[Iterable[str]]) -> set[str]:
    if families is None:
        return set(FAMILIES)
    if isinstance(families, str):
        families = [families]
    chosen = set(families)
    unknown = chosen - set(FAMILIES)
    if unknown:
        raise ValueError(f"families: unknown {sorted(unknown)}; expected some of {', '.join(FAMILIES)}")
    return chosen


def _runs(
    model: Any, vocab_size: Optional[int], wanted: set[str], scenarios: Optional[Sequence[Scenario]], pad: int
) -> tuple[list[tuple[Probe, Callable, Optional[str], int]], list[str]]:
    """(probe, what to call, the cache argument's name, the vocabulary to draw from) for each scenario to
    run, and notes on those not run."""
    notes: list[str] = []
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        found = _model_probes(model, wanted, scenarios, pad, notes)
        vocab = vocab_size or _vocab(model)
        name = cache_name(model)
        return [(probe, model, name, vocab) for probe in found], notes
    if not callable(model):
        raise TypeError(f"model: expected a transformers model or a callable, got {type(model).__name__}")
    if vocab_size is None:
        raise TypeError("vocab_size: required for a callable that is not a transformers model")
    name = _callable_cache_name(model)
    chosen = scenarios if scenarios is not None else (*SCENARIOS, *MORE_SCENARIOS, *PACKED_SCENARIOS)
    packs = _takes_positions(model)
    found = [
        probe
        for probe in probes(chosen, DECODER_ONLY._replace(pad=pad), cached=True, packs=packs)
        if probe.family in wanted
    ]
    if PACKED in wanted and not packs:
        notes.append("packed (needs a callable, or a module's forward, with a position_ids parameter)")
    notes += [
        f"{family} (needs a transformers model)" for family in (STATIC, WINDOW, ROPE) if family in wanted
    ]
    return [(probe, model, name, vocab_size) for probe in found], notes


def _model_probes(
    model: Any, wanted: set[str], scenarios: Optional[Sequence[Scenario]], pad: int, notes: list[str]
) -> list[Probe]:
    model_type = getattr(model.config, "model_type", "?")
    seq2seq = is_seq2seq(model)
    inputs = seq2seq_inputs(model) if seq2seq else DECODER_ONLY._replace(pad=pad)
    if seq2seq:
        check_runs(model, model_type, inputs)
    else:
        plain = plain_call(model, model_type)
        inputs = inputs._replace(uncached=bool(plain))
        if not check_causal(model, model_type, prefix_lm=is_multimodal(model), plain=plain):
            inputs = inputs._replace(prefix_lm=True)
            notes.append("none: a prefix LM, each row alone runs through the same cached calls")
    packs = not seq2seq and not inputs.prefix_lm
    if PACKED in wanted and not packs:
        notes.append("packed: " + ("an encoder-decoder model's decoder" if seq2seq else "a prefix LM"))
    chosen = scenarios if scenarios is not None else (*SCENARIOS, *MORE_SCENARIOS, *PACKED_SCENARIOS)
    found = model_probes(
        model,
        chosen,
        inputs,
        static=STATIC in wanted,
        window=configured_window(model) if WINDOW in wanted else None,
        rope=scaled_rope(model) if ROPE in wanted and not seq2seq else None,
        packs=packs,
    )
    if inputs.uncached:
        notes.append("the cached scenarios: a call with the cache the model makes itself fails")
    elif not found.cached:
        notes.append("the cached scenarios: the model returns no KV cache")
    elif STATIC in wanted and not found.takes_static:
        notes.append("static: the model takes no StaticCache here")
    return [probe for probe in found.probes if probe.family in wanted]


def _vocab(model: Any) -> int:
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise TypeError("vocab_size: the model's config names none; pass vocab_size=")
    return vocab


def _parameters(call: Callable) -> Optional[Mapping[str, inspect.Parameter]]:
    """The parameters a callable is called with: a module's ``forward``'s (its ``__call__`` takes
    ``*args, **kwargs``); None where they cannot be read."""
    try:
        return inspect.signature(call.forward if isinstance(call, torch.nn.Module) else call).parameters
    except (TypeError, ValueError):
        return None


def _takes_positions(call: Callable) -> bool:
    """Whether a callable names ``position_ids`` among its parameters (packed rows pass them)."""
    params = _parameters(call)
    return params is not None and "position_ids" in params


def _callable_cache_name(call: Callable) -> str:
    """The cache argument a callable takes by name (``cache`` or ``past_key_values``; either through
    ``**kwargs``: ``past_key_values``)."""
    params = _parameters(call) or {}
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
