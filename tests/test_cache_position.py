"""cache_position: optional wherever a release has it, right for every cache type, honoured (or a
clear error) where the release removed it; the cache argument under either name."""

from __future__ import annotations

import copy

import pytest
import torch
from packaging.version import Version
from torch._dynamo.testing import CompileCounter

from hfpatch._compat import attaches_static_caches
from hfpatch.plans import SLOTS, SLOTS_REMOVED

from conftest import TF, cache_object_skip_reason, make_dynamic_cache, plan, static_cache_skip_reason, stock
from harness import (
    TOLERANCE,
    WRONG,
    cache_kwarg,
    max_diff,
    output_cache,
    random_rows,
    run_alone,
    run_padded,
    static_cache,
)

pytestmark = pytest.mark.invariant("I5")  # compat/REPORT.md's column

ROWS_CHUNKS = (((3, 4), (2, 1), (1, 1)), ((False, False), (True, False), (False, False)))


def _needs_parameter(model):
    if plan(model).era != SLOTS:
        pytest.skip(f"{type(model.base_model).__name__}.forward has no cache_position in transformers {TF}")


def _needs_static(model):
    reason = static_cache_skip_reason(model)
    if reason:
        pytest.skip(reason)


def _run(model, cache_factory, explicit, **kwargs):
    chunks, left = ROWS_CHUNKS
    rows = random_rows([6, 6], seed=21)
    got = run_padded(model, rows, chunks, left, cache=cache_factory(), pass_cache_position=explicit, **kwargs)
    return rows, got


@pytest.mark.parametrize("kind", ["dynamic", "static", "static-full-mask"])
def test_omitted_equals_explicit(model, arch, kind):
    _needs_parameter(model)
    if kind == "dynamic":
        reason = cache_object_skip_reason(model, "dynamic")
        if reason:
            pytest.skip(reason)
        factory, width = (lambda: make_dynamic_cache(model)), None
    else:
        _needs_static(model)
        factory, width = (
            (lambda: static_cache(model, 2, 16)),
            (16 if kind == "static-full-mask" else None),
        )
    rows, omitted = _run(model, factory, explicit=False, mask_width=width)
    _, explicit = _run(model, factory, explicit=True, mask_width=width)
    for a, b in zip(omitted, explicit):
        assert torch.equal(a, b)
    assert max_diff(model, rows, omitted) <= TOLERANCE


def _zeroed(model, zero):
    """A copy of ``model`` whose embedding row for token ``zero`` is zero (its keys are zero too)."""
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        zeroed.get_input_embeddings().weight[zero] = 0
    return zeroed


def _decode(model, row, prompt, cache, with_mask=False, compiled=None, explicit=False):
    """Prefill ``row[:prompt]`` (eager), then one token a call (``compiled`` if given); the logits."""
    logits = []
    for start, stop in [(0, prompt)] + [(i, i + 1) for i in range(prompt, len(row))]:
        kwargs = {"attention_mask": torch.ones(1, stop, dtype=torch.long)} if with_mask else {}
        if explicit:
            kwargs["cache_position"] = torch.arange(start, stop)
        call = compiled if compiled is not None and start > 0 else model
        with torch.no_grad():
            out = call(
                input_ids=torch.tensor([row[start:stop]]),
                use_cache=True,
                **{cache_kwarg(model): cache},
                **kwargs,
            )
        logits.append(out.logits[0])
    return torch.cat(logits)


ZERO = 5


@pytest.mark.parametrize("zero_at", ["first", "newest"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_static_cache_zero_key(model, arch, with_mask, zero_at):
    """A StaticCache without cache_position stays right when cached keys are exactly zero
    (transformers #30377: a zero embedding, like JackFram/llama-68m's BOS; transformers' `.any()`
    count before 5.4 then writes over the last token). The zero token comes first (a BOS), or last
    in the prompt (greedy decoding that emits a token whose embedding is zero): then only an exact
    count of the slots written is right, which 5.4+ keeps and hfpatch keeps before 5.4."""
    if getattr(model.config, "attention_bias", True):  # GPT-2's config has no such field: it has biases
        pytest.skip(f"{arch}'s attention has key biases: its cached keys are never all zero")
    _needs_static(model)
    zeroed = _zeroed(model, ZERO)
    a, b, c, d = random_rows([4], seed=31)[0]
    row = [ZERO, a, b, c, d] if zero_at == "first" else [a, b, ZERO, c, d]
    reference = run_alone(zeroed, row)
    assert (
        _decode(zeroed, row, 3, static_cache(zeroed, 1, 16), with_mask) - reference
    ).abs().max() <= TOLERANCE
    if not with_mask and Version("4.41") <= TF < Version("5.4"):
        with stock():
            got = _decode(zeroed, row, 3, static_cache(zeroed, 1, 16))
        assert (got - reference).abs().max().item() > WRONG, "stock should mis-count the zero key"


def test_static_cache_count_survives_reset_and_compile(model, arch):
    """Before 5.4, hfpatch's count of a StaticCache's slots: equal to the run with cache_position
    given, after cache.reset() (which clears it) and with the decode steps compiled (fullgraph, one
    graph for every step: the count is a tensor updated in place)."""
    if getattr(model.config, "attention_bias", True):
        pytest.skip(f"{arch}'s attention has key biases: its cached keys are never all zero")
    _needs_static(model)
    _needs_parameter(model)  # 4.38-5.3: the releases without an exact counter of their own
    zeroed = _zeroed(model, ZERO)
    a, b, c, d = random_rows([4], seed=33)[0]
    row = [a, b, ZERO, c, d, ZERO, a]
    explicit = _decode(zeroed, row, 3, static_cache(zeroed, 1, 16), explicit=True)
    assert (explicit - run_alone(zeroed, row)).abs().max().item() <= TOLERANCE
    cache = static_cache(zeroed, 1, 16)
    assert torch.equal(_decode(zeroed, row, 3, cache), explicit)
    cache.reset()
    assert torch.equal(_decode(zeroed, row, 3, cache), explicit), "after reset()"
    cache.reset()
    counter = CompileCounter()
    compiled = torch.compile(zeroed, fullgraph=True, backend=counter)
    torch._dynamo.reset()
    try:
        got = _decode(zeroed, row, 3, cache, compiled=compiled)
    finally:
        torch._dynamo.reset()
    assert (got - explicit).abs().max().item() <= TOLERANCE, "compiled"
    assert counter.frame_count == 1, "one graph for every decode step"


def test_setup_cache_static_path(model, arch):
    """4.38-4.40's supported static path (the cache lives on the attention layers): no cache_position
    needed, and right (stock silently overwrote slot 0)."""
    if not attaches_static_caches(model):
        pytest.skip(f"model._setup_cache exists in 4.38-4.40 only (installed: {TF})")
    chunks, left = ROWS_CHUNKS
    rows = random_rows([6, 6], seed=23)
    attached = copy.deepcopy(model)
    for width in (None, 16):
        attached._setup_cache(__import__("transformers").StaticCache, 2, 16)
        got = run_padded(attached, rows, chunks, left, mask_width=width)
        assert max_diff(model, rows, got) <= TOLERANCE
    attached._setup_cache(__import__("transformers").StaticCache, 2, 16)
    with stock():
        assert max_diff(model, rows, run_padded(attached, rows, chunks, left)) > WRONG


def test_static_cache_object_before_4_41_is_left_to_stock_with_a_warning(model, arch):
    """Before 4.41 a StaticCache passed as the cache argument cannot run right (its layers share one
    buffer): hfpatch says how to attach one instead, once, and the call gets what stock does with it
    (its result or its own error)."""
    from test_bad_input import left_to_stock

    if not attaches_static_caches(model) or plan(model).era != SLOTS:
        pytest.skip(f"StaticCache objects are usable as the cache argument from 4.41 (installed: {TF})")

    def kwargs():
        return {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
                cache_kwarg(model): static_cache(model, 1, 16)}  # fmt: skip

    left_to_stock(model, kwargs, match="_setup_cache")


def _needs_removed(model, arch):
    if plan(model).era != SLOTS_REMOVED:
        pytest.skip(f"transformers {TF} has cache_position (or rejects it): the 5.4+ rule does not apply")


def test_removed_release_consistent_cache_position_is_honoured(model, arch):
    _needs_removed(model, arch)
    rows, with_cp = _run(model, lambda: None, explicit=True)
    _, without = _run(model, lambda: None, explicit=False)
    for a, b in zip(with_cp, without):
        assert torch.equal(a, b)
    assert max_diff(model, rows, with_cp) <= TOLERANCE


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.usefixtures("fresh_warnings")
def test_removed_release_contradicting_cache_position_is_left_to_stock(model, arch, with_mask):
    """A cache_position that contradicts the cache, on a release that removed the parameter: hfpatch
    cannot place the new tokens by it, says so, and the call runs as stock runs it (which ignores it)."""
    from test_bad_input import left_to_stock

    _needs_removed(model, arch)
    (row,) = random_rows([4], seed=3)

    def kwargs():
        with torch.no_grad():
            out = model(input_ids=torch.tensor([row[:3]]), use_cache=True)
        mask = {"attention_mask": torch.ones(1, 4, dtype=torch.long)} if with_mask else {}
        return {"input_ids": torch.tensor([row[3:]]), "cache_position": torch.tensor([40]),
                cache_kwarg(model): output_cache(out), **mask}  # fmt: skip

    left_to_stock(model, kwargs, "cache_position")


def test_cache_under_either_name(model):
    """`cache=` and `past_key_values=` both work (on every release); the same object twice is fine."""
    rows = random_rows([5], seed=8)
    reference = run_alone(model, rows[0])
    for names in (["cache"], ["past_key_values"], ["cache", "past_key_values"]):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([rows[0][:3]]), use_cache=True)
            cache = output_cache(out)
            out2 = model.base_model(
                input_ids=torch.tensor([rows[0][3:]]),
                attention_mask=torch.ones(1, 5, dtype=torch.long),
                **{name: cache for name in names},
            )
            logits = model.get_output_embeddings()(out2.last_hidden_state)[0]
        assert (logits - reference[3:]).abs().max().item() <= TOLERANCE, names


@pytest.mark.usefixtures("fresh_warnings")
def test_two_different_caches_are_left_to_stock(model):
    """`cache=` and `past_key_values=` naming two different caches: hfpatch cannot tell which the caller
    means, says so, and the call gets what stock does with both (its choice, or its error)."""
    from test_bad_input import left_to_stock

    rows = random_rows([3], seed=8)

    def kwargs():
        with torch.no_grad():
            first = output_cache(model(input_ids=torch.tensor(rows), use_cache=True))
            second = output_cache(model(input_ids=torch.tensor(rows), use_cache=True))
        return {"input_ids": torch.tensor(rows), "cache": first, "past_key_values": second}

    left_to_stock(model.base_model, kwargs, "two different caches", lambda out: out.last_hidden_state)
