"""``apply(unpad=True)``: a padded call run on its real tokens alone. Every real token's logits (and hidden
states) against its sequence run alone, unpadded, on stock transformers, and against the padded path;
the loss and every parameter's gradient against the padded path's; a returned cache continued; a
sequence-classification head; the calls really run on their real tokens (what the base model receives);
what keeps the padded path (a label predicted from a pad, attention weights, a cache continued), and a
call without padding bit-identical. A hypothesis property over random lengths and paddings."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

import hfpatch
from hfpatch._context import UNPADDED
from hfpatch.support import NEWEST_TESTED

from conftest import TF, arch_skip_reason, spying, stock
from expectations import COMPILED_BY_SEQUENCE_FROM
from harness import TOLERANCE, VOCAB, cache_kwarg, output_cache, run_alone

pytestmark = pytest.mark.invariant("I10")

NO_DROPOUT = {name: 0.0 for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout")}
ROWS = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17], [18])


@contextlib.contextmanager
def unpadded():
    """``apply(unpad=True)`` for the block (the suite runs with it off)."""
    hfpatch.apply(unpad=True)
    try:
        yield
    finally:
        hfpatch.apply(unpad=False)


def batch(rows, left: bool = False) -> dict:
    width = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        pads = [0] * (width - len(row))
        ids.append(pads + list(row) if left else list(row) + pads)
        mask.append([0] * len(pads) + [1] * len(row) if left else [1] * len(row) + [0] * len(pads))
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def real(tensor: torch.Tensor, mask: torch.Tensor, r: int) -> torch.Tensor:
    return tensor[r][mask[r] != 0]


@pytest.fixture(params=["gpt2", "llama"])
def arch(request) -> str:
    _kept_here(request.param)
    return request.param


def tiny(arch: str, attention: str = "sdpa", **sizes):
    from hfpatch.verification.tiny import tiny_model

    return tiny_model(arch, attention=attention, sizes={**NO_DROPOUT, **sizes})


@pytest.mark.parametrize(
    "attention", ["eager", "sdpa", pytest.param("flex_attention", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_logits_and_hidden_states_are_each_rows_own(arch, attention, left):
    if attention == "flex_attention" and left:
        pytest.skip("flex attention: right padding is enough (the BlockMask of a packed row either way)")
    if attention == "flex_attention" and TF < Version("4.53"):
        pytest.skip(f"flex attention takes hfpatch's BlockMask from 4.53 (installed {TF})")
    try:
        model = tiny(arch, attention)
    except (ValueError, ImportError) as exc:
        pytest.skip(f"{arch} with {attention} attention in transformers {TF}: {str(exc)[:100]}")
    kwargs = batch(ROWS, left)
    with torch.no_grad():
        padded = model(**kwargs, output_hidden_states=True)
        before = UNPADDED["calls"]
        with unpadded(), spying(model) as seen:
            out = model(**kwargs, output_hidden_states=True)
        assert UNPADDED["calls"] == before + 1
    base = seen[-1]  # the base model got one packed row of the real tokens (a mask by sequence, or none)
    assert base["input_ids"].shape == (1, sum(map(len, ROWS)))
    assert (
        base.get("attention_mask") is None
        or not isinstance(base["attention_mask"], torch.Tensor)
        or (base["attention_mask"].dim() == 4)
    )
    mask = kwargs["attention_mask"]
    for r, row in enumerate(ROWS):
        alone = run_alone(model, row)
        assert (real(out.logits, mask, r) - alone).abs().max() <= TOLERANCE
        assert (real(out.logits, mask, r) - real(padded.logits, mask, r)).abs().max() <= TOLERANCE
        for got, want in zip(out.hidden_states, padded.hidden_states):
            assert (real(got, mask, r) - real(want, mask, r)).abs().max() <= TOLERANCE
    assert bool((out.logits[mask == 0] == 0).all())  # a pad's logits: zeros


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_loss_and_gradients_are_the_padded_paths(arch, left):
    """A training step with labels (-100 at the pads, as DataCollatorForLanguageModeling makes them), and
    with Trainer's num_items_in_batch: the padded path's loss and every gradient. Left padding: the last
    pad predicts the first real token there, so its label is -100'd as a collator with left padding
    does; a label predicted from a pad keeps the padded path (test below)."""
    model = tiny(arch).train()
    kwargs = batch(ROWS, left)
    labels = kwargs["input_ids"].masked_fill(kwargs["attention_mask"] == 0, -100)
    if left:  # (a pad's output would predict each row's first token)
        labels[:, :-1] = labels[:, :-1].masked_fill(kwargs["attention_mask"][:, 1:] == 0, -100)
        labels = labels.masked_fill(torch.nn.functional.pad(kwargs["attention_mask"], (1, -1)) == 0, -100)
    for extra in ({}, {"num_items_in_batch": torch.tensor(11)}):
        model.zero_grad(set_to_none=True)
        try:
            want = model(**kwargs, labels=labels, **extra).loss
        except TypeError:  # a release whose heads take no num_items_in_batch
            continue
        want.backward()
        want_grads = grads(model)
        model.zero_grad(set_to_none=True)
        before = UNPADDED["calls"]
        with unpadded():
            got = model(**kwargs, labels=labels, **extra).loss
        got.backward()
        assert UNPADDED["calls"] == before + 1, UNPADDED
        assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
        got_grads = grads(model)
        for name, g in want_grads.items():
            assert ((got_grads[name] - g).norm() / g.norm().clamp(min=1e-12)).item() <= 1e-4, name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing(arch, reentrant):
    """Activation checkpointing recomputes each layer of the packed row in the backward pass: the same
    loss and gradients as the padded path."""
    import warnings

    model = tiny(arch).train()
    if not model.supports_gradient_checkpointing:
        pytest.skip(f"{type(model).__name__} does not checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    kwargs = batch(ROWS)
    labels = kwargs["input_ids"].masked_fill(kwargs["attention_mask"] == 0, -100)
    model.zero_grad(set_to_none=True)
    want = model(**kwargs, labels=labels).loss
    want.backward()
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    with unpadded():
        got = model(**kwargs, labels=labels).loss
        got.backward()
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    for name, g in want_grads.items():
        assert ((grads(model)[name] - g).norm() / g.norm().clamp(min=1e-12)).item() <= 1e-4, name


STREAM = (ROWS, ROWS[:3], [r * 2 for r in ROWS], [[7], list(range(8, 17))], [[3] * 20, [4] * 7])


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_calls_run_on_their_real_tokens(arch):
    """``torch.compile(model)`` (graphs may break): a padded call runs on its real tokens where the compiled
    packed row's attention runs by sequence (Llama's from 4.53), else stays padded saying why: each
    real token's logits its row's alone (stock, unpadded), a pad's zeros (the rule for pads), a plain
    tensor; the loss and every gradient of a compiled training step the eager padded path's; a stream of
    five batches of other lengths compiles at most 3 graphs more than without unpad (the host's read is
    a graph break, the packed call's token count a dynamic size from its second)."""
    from torch._dynamo.testing import CompileCounter

    from hfpatch.unpad import COMPILED_DENSE

    since = COMPILED_BY_SEQUENCE_FROM.get(arch)
    by_sequence = since is not None and TF >= Version(since)
    model = tiny(arch)
    counts = {}
    for unpad in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter)
        hfpatch.apply(unpad=unpad)
        calls, dense = UNPADDED["calls"], UNPADDED["padded"].get(COMPILED_DENSE, 0)
        try:
            with torch.no_grad():
                for rows in STREAM:
                    kwargs = batch(rows)
                    got = compiled(**kwargs).logits
                    assert type(got) is torch.Tensor
                    pads = got[kwargs["attention_mask"] == 0]
                    assert bool((pads == 0).all()) == (unpad and by_sequence), rows
                    for r, row in enumerate(rows):
                        alone = run_alone(model, row)
                        assert (real(got, kwargs["attention_mask"], r) - alone).abs().max() <= TOLERANCE
        finally:
            hfpatch.apply(unpad=False)
            torch._dynamo.reset()
        counts[unpad] = counter.frame_count
        if unpad:
            ran = UNPADDED["calls"] - calls, UNPADDED["padded"].get(COMPILED_DENSE, 0) - dense
            assert ran == ((len(STREAM), 0) if by_sequence else (0, len(STREAM))), ran
    assert counts[True] <= counts[False] + 3, counts
    model.train()
    kwargs = batch(ROWS)
    labels = kwargs["input_ids"].masked_fill(kwargs["attention_mask"] == 0, -100)
    model.zero_grad(set_to_none=True)
    with stock():
        want = model(**kwargs, labels=labels).loss
        want.backward()
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with unpadded():
        got = torch.compile(model, backend="aot_eager")(**kwargs, labels=labels).loss
        got.backward()
    torch._dynamo.reset()
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    for name, g in want_grads.items():
        assert ((grads(model)[name] - g).norm() / g.norm().clamp(min=1e-12)).item() <= 1e-4, name


@pytest.mark.slow
@pytest.mark.compile
def test_calls_compiled_whole_keep_the_padded_path(arch):
    """A call compiled with ``fullgraph=True`` (no graph break for the host's read) takes the padded path:
    one graph, the eager padded logits, a stream of batches of other lengths compiles no more graphs than
    without unpad, and ``status().unpadded`` says why once a graph (not once a call)."""
    from torch._dynamo.testing import CompileCounter

    from hfpatch.unpad import ONE_GRAPH

    model = tiny(arch)
    counts = {}
    for unpad in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        hfpatch.apply(unpad=unpad)
        before = hfpatch.status().unpadded["padded"].get(ONE_GRAPH, 0)
        try:
            with torch.no_grad():
                for rows in (ROWS, ROWS[:3], [r * 2 for r in ROWS]):
                    kwargs = batch(rows)
                    want = model(**kwargs).logits if not unpad else None
                    got = compiled(**kwargs).logits
                    if want is not None:
                        assert (got - want).abs().max() <= TOLERANCE
            said = dict(hfpatch.status().unpadded["padded"])
        finally:
            hfpatch.apply(unpad=False)
            torch._dynamo.reset()
        counts[unpad] = counter.frame_count
        if unpad:
            assert said.get(ONE_GRAPH, 0) - before == counter.frame_count, said
    assert counts[True] <= counts[False], counts


def test_a_label_predicted_from_a_pad_keeps_the_padded_path(arch):
    model = tiny(arch)
    kwargs = batch(ROWS, left=True)
    labels = kwargs["input_ids"].clone()  # the last pad of each left-padded row predicts a real token
    with torch.no_grad():
        want = model(**kwargs, labels=labels).loss
        before = dict(UNPADDED["padded"])
        with unpadded():
            got = model(**kwargs, labels=labels).loss
    assert torch.equal(got, want)
    reason = "a label predicted from a pad"
    assert UNPADDED["padded"].get(reason, 0) == before.get(reason, 0) + 1


def test_a_returned_cache_is_continued(arch):
    """Eval mode's default use_cache: the cache the unpadded call returns is laid back into the padded
    rows, and a later call continues it (a right-padded prefix, then two tokens)."""
    model = tiny(arch)
    kwargs = batch(ROWS[:3])
    more = torch.tensor([[40, 41], [42, 43], [44, 45]])
    mask = torch.cat([kwargs["attention_mask"], torch.ones(3, 2, dtype=torch.long)], 1)
    with torch.no_grad(), unpadded():
        first = model(**kwargs, use_cache=True)
        cache = output_cache(first)
        assert cache is not None
        second = model(input_ids=more, attention_mask=mask, **{cache_kwarg(model): cache}).logits
    for r, row in enumerate(ROWS[:3]):
        alone = run_alone(model, [*row, *more[r].tolist()])
        assert (second[r] - alone[-2:]).abs().max() <= TOLERANCE


def test_a_sequence_classification_head_pools_the_same_token(arch):
    import transformers

    from hfpatch.verification.tiny import tiny_config

    config = tiny_config(arch, NO_DROPOUT)
    config.num_labels, config.pad_token_id, config._attn_implementation = 3, 0, "sdpa"
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    except ValueError as exc:
        pytest.skip(f"no sequence-classification head for {arch} in transformers {TF}: {exc}")
    kwargs = batch(ROWS)  # right padding with the pad id: the head pools each row's last real token
    with torch.no_grad():
        want = model(**kwargs).logits
        before = UNPADDED["calls"]
        with unpadded():
            got = model(**kwargs).logits
    assert UNPADDED["calls"] == before + 1
    assert (got - want).abs().max() <= TOLERANCE


def test_calls_without_padding_or_continuing_a_cache_are_unchanged(arch):
    model = tiny(arch, "eager")  # (attention weights: eager attention gives them)
    full = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]),
        "attention_mask": torch.ones(2, 3, dtype=torch.long),
    }
    with torch.no_grad():
        want = model(**full).logits
        with unpadded():
            assert torch.equal(model(**full).logits, want)  # bit-identical
            kwargs = batch(ROWS[:2])
            with stock():
                stock_out = model(**kwargs, output_attentions=True)
            out = model(**kwargs, output_attentions=True)  # attention weights: padded, as asked
            assert out.attentions is not None and out.attentions[0].shape == stock_out.attentions[0].shape
    assert UNPADDED["padded"].get("attention weights asked for", 0) >= 1


def test_the_switch_and_its_variable():
    with pytest.raises(TypeError, match="unpad"):
        hfpatch.apply(unpad="yes")
    status = hfpatch.apply(unpad=True)
    try:
        assert status.unpadded["on"] is True
    finally:
        hfpatch.apply(unpad=False)
    assert hfpatch.status().unpadded["on"] is False


@st.composite
def padded_rows(draw):
    count = draw(st.integers(1, 4))
    rows = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=7)) for _ in range(count)]
    return rows, draw(st.booleans())


@settings(max_examples=15, deadline=None)
@given(padded_rows())
def test_any_padding(drawn):
    """Random rows and sides: every real token's logits its row's alone (Llama, SDPA)."""
    if arch_skip_reason("llama") or TF < Version("4.39"):
        pytest.skip("no packed rows of Llama kept here")
    rows, left = drawn
    model = _hypothesis_model()
    kwargs = batch(rows, left)
    with torch.no_grad(), unpadded():
        logits = model(**kwargs).logits
    for r, row in enumerate(rows):
        assert (real(logits, kwargs["attention_mask"], r) - run_alone(model, row)).abs().max() <= TOLERANCE


_MODELS: dict = {}


def _hypothesis_model():
    if "llama" not in _MODELS:
        _MODELS["llama"] = tiny("llama")
    return _MODELS["llama"]


def test_the_watchers_see_unpadded_calls(arch):
    """verify and hfpatch.testing run their padded scenarios through the unpadded path when it is on
    (exact, and counted); the shadow checks an unpadded call's sequences, each against itself alone; the
    audit counts it as run on its real tokens."""
    from hfpatch.testing import assert_padding_invariant

    model = tiny(arch)
    with unpadded():
        before = UNPADDED["calls"]
        assert hfpatch.verify(model).ok
        assert assert_padding_invariant(model, families=["padding", "cached"]).ok
        assert UNPADDED["calls"] > before
        with torch.no_grad(), hfpatch.shadow(rate=1.0) as report:
            model(**batch(ROWS))
        assert report.checked == len(ROWS) and report.mismatches == 0, report
        with torch.no_grad(), hfpatch.audit() as audit:
            model(**batch(ROWS))
    counted = audit.as_dict()[arch]  # (the base model's padded call judged, where it is the one unpadded)
    assert counted["calls"] == 1 and counted["affected"] == 0, counted
    assert counted["not_judged"] in ({}, {"run on its real tokens (apply(unpad=True))": 1}), counted


def test_a_sliding_window_cache_is_kept_whole_and_continued():
    """Mistral with a window of 4: the unpadded call's cache keeps its sliding layers whole (a packed row's
    last columns are not a row's), laid back, and continued past the window, each row exact."""
    import transformers

    from hfpatch.verification.tiny import tiny_config

    if arch_skip_reason("mistral") or TF < Version("4.56"):
        pytest.skip(f"a DynamicCache with sliding layers to keep whole from 4.56 (installed {TF})")
    config = tiny_config("mistral", {"sliding_window": 4})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    rows = [list(range(5, 14)), [14, 15], [16, 17, 18]]
    kwargs = batch(rows)
    more = torch.tensor([[40, 41], [42, 43], [44, 45]])
    mask = torch.cat([kwargs["attention_mask"], torch.ones(3, 2, dtype=torch.long)], 1)
    before = UNPADDED["calls"]
    with torch.no_grad(), unpadded():
        cache = output_cache(model(**kwargs, use_cache=True))
        assert UNPADDED["calls"] == before + 1
        second = model(input_ids=more, attention_mask=mask, **{cache_kwarg(model): cache}).logits
    for r, row in enumerate(rows):
        assert (second[r] - run_alone(model, [*row, *more[r].tolist()])[-2:]).abs().max() <= TOLERANCE


def test_the_callers_positions(arch):
    """Positions the caller gives (as generate() gives them: each row from 0, a pad repeating one) are
    used at the real tokens; positions that run on from one row into the next keep the padded path
    (one packed row could not tell the rows apart)."""
    model = tiny(arch)
    kwargs, right = batch(ROWS, left=True), batch(ROWS)
    mask = kwargs["attention_mask"]
    mine = (mask.cumsum(-1) - 1).clamp(min=0)
    # right-padded rows numbered on: row r's first real token follows row r - 1's last
    runs_on = (right["attention_mask"].reshape(-1).cumsum(0) - 1).view(mask.shape)
    with torch.no_grad():
        want = model(**kwargs, position_ids=mine).logits
        padded_on = model(**right, position_ids=runs_on).logits
        before = dict(UNPADDED["padded"])
        with unpadded():
            got = model(**kwargs, position_ids=mine).logits
            assert torch.equal(model(**right, position_ids=runs_on).logits, padded_on)
    for r in range(len(ROWS)):
        assert (real(got, mask, r) - real(want, mask, r)).abs().max() <= TOLERANCE
    reason = "the caller's positions run on from one row into the next"
    assert UNPADDED["padded"].get(reason, 0) == before.get(reason, 0) + 1


# --- what a caller can ask for: every output the padded call's, or the padded path and why -------------


def _head(arch: str, auto: str, **config):
    """A tiny head of ``arch`` (``auto``: the Auto class's name), SDPA, no dropout."""
    import transformers

    from hfpatch.verification.tiny import tiny_config

    built = tiny_config(arch, NO_DROPOUT)
    built._attn_implementation = config.pop("attention", "sdpa")
    for key, value in config.items():
        setattr(built, key, value)
    torch.manual_seed(0)
    try:
        return getattr(transformers, auto).from_config(built).eval()
    except (ValueError, KeyError) as exc:
        pytest.skip(f"no {auto} for {arch} in transformers {TF}: {str(exc)[:80]}")


def _kept_here(arch: str) -> None:
    """Skip unless ``arch``'s packed rows are kept on this release (else nothing is unpadded)."""
    if arch_skip_reason(arch):
        pytest.skip(arch_skip_reason(arch))
    import importlib

    importlib.import_module(hfpatch.registry()[arch].module)
    packed = hfpatch.status()[arch].packed
    if TF >= Version(NEWEST_TESTED):  # (on the newest release they are kept: a skip there would hide it)
        assert packed.startswith("yes"), packed
    if not packed.startswith("yes"):
        pytest.skip(f"{arch}'s packed rows are not kept in transformers {TF} ({packed}): no unpadding")


def _padded_reason(call, reason: str) -> None:
    """``call()`` under ``apply(unpad=True)`` keeps the padded path once, for ``reason``."""
    before, calls = UNPADDED["padded"].get(reason, 0), UNPADDED["calls"]
    with unpadded():
        result = call()
    assert UNPADDED["padded"].get(reason, 0) == before + 1, dict(UNPADDED["padded"])
    assert UNPADDED["calls"] == calls
    return result


def test_attention_weights_asked_for_by_the_config_keep_the_padded_path(arch):
    model = _head(arch, "AutoModelForCausalLM", attention="eager")
    model.config.output_attentions = True
    kwargs = batch(ROWS)
    with torch.no_grad():
        want = model(**kwargs).attentions
        got = _padded_reason(lambda: model(**kwargs).attentions, "attention weights asked for")
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_question_answering_loss_is_the_padded_calls(arch):
    """Its loss runs over every position, pads included: the padded path."""
    model = _head(arch, "AutoModelForQuestionAnswering", pad_token_id=0)
    kwargs = batch(ROWS)
    spans = {"start_positions": torch.tensor([1, 0, 2, 0]), "end_positions": torch.tensor([3, 1, 3, 0])}
    with torch.no_grad():
        want = model(**kwargs, **spans)
        got = _padded_reason(lambda: model(**kwargs, **spans), "a loss over every position")
        before = UNPADDED["calls"]
        with unpadded():
            plain = model(**kwargs)  # no loss: its real tokens' logits, unpadded
        assert UNPADDED["calls"] == before + 1
    assert torch.equal(got.loss, want.loss)
    real_slots = kwargs["attention_mask"] != 0
    assert (plain.start_logits - want.start_logits)[real_slots].abs().max() <= TOLERANCE


@pytest.mark.parametrize("at_pads", ["labelled", "ignored"])
def test_a_token_classification_loss_is_the_padded_calls(arch, at_pads):
    """Inherited heads too (5.x's ``GenericForTokenClassification``): a label at a pad reads a pad's output
    (the padded path); labels -100 at the pads run unpadded, with the padded call's loss."""
    model = _head(arch, "AutoModelForTokenClassification", num_labels=3)
    kwargs = batch(ROWS)
    labels = torch.randint(0, 3, kwargs["input_ids"].shape, generator=torch.Generator().manual_seed(1))
    if at_pads == "ignored":
        labels = labels.masked_fill(kwargs["attention_mask"] == 0, -100)
    with torch.no_grad():
        want = model(**kwargs, labels=labels).loss
        if at_pads == "labelled":
            got = _padded_reason(lambda: model(**kwargs, labels=labels).loss, "a label at a pad")
            assert torch.equal(got, want)
        else:
            before = UNPADDED["calls"]
            with unpadded():
                got = model(**kwargs, labels=labels).loss
            assert UNPADDED["calls"] == before + 1
            assert abs(got.item() - want.item()) <= TOLERANCE


def test_router_logits_asked_for_by_keyword_keep_the_padded_path():
    _kept_here("mixtral")
    model = _head("mixtral", "AutoModelForCausalLM")
    kwargs = batch(ROWS)
    with torch.no_grad():
        want = model(**kwargs, output_router_logits=True).router_logits
        reason = "router logits asked for (their auxiliary loss reads the padded layout)"
        got = _padded_reason(lambda: model(**kwargs, output_router_logits=True).router_logits, reason)
    assert [g.shape for g in got] == [w.shape for w in want]


def test_returned_hidden_states_are_on_the_outputs_graph(arch):
    """Saliency and gradient x activation: gradients with respect to the returned hidden states (the
    padded path where gradients are on: the unpadded one's are copies off the graph)."""
    model = _head(arch, "AutoModelForCausalLM").train()
    kwargs = batch(ROWS)
    reason = "hidden states asked for with gradients on"
    out = _padded_reason(lambda: model(**kwargs, output_hidden_states=True), reason)
    states = out.hidden_states[1]
    (grad,) = torch.autograd.grad(out.logits.sum(), states)
    assert grad.shape == states.shape and grad.abs().sum() > 0
    with torch.no_grad():  # no gradients: unpadded, the real tokens' states the padded call's
        want = model(**kwargs, output_hidden_states=True).hidden_states
        before = UNPADDED["calls"]
        with unpadded():
            got = model(**kwargs, output_hidden_states=True).hidden_states
    assert UNPADDED["calls"] == before + 1
    mask = kwargs["attention_mask"]
    for g, w in zip(got, want):
        assert (g - w)[mask != 0].abs().max() <= TOLERANCE


def test_logits_kept_at_a_pad_are_zeros_on_the_real_tokens_path(arch):
    """``logits_to_keep`` over right padding (RL scoring keeps a completion's columns, pads included):
    the call runs on its real tokens; each kept real column's logits are the padded call's, a kept pad's
    are zeros (the rule for pads), with one column kept and with several."""
    model = _head(arch, "AutoModelForCausalLM")
    kwargs = batch(ROWS)
    if "logits_to_keep" not in inspect_parameters(model):
        pytest.skip(f"{type(model).__name__} takes no logits_to_keep in transformers {TF}")
    mask = kwargs["attention_mask"]
    for keep in (1, 4):
        with torch.no_grad():
            want = model(**kwargs, logits_to_keep=keep).logits
            before = UNPADDED["calls"]
            with unpadded():
                got = model(**kwargs, logits_to_keep=keep).logits
        assert UNPADDED["calls"] == before + 1
        kept = mask[:, -keep:] != 0
        assert (got - want)[kept].abs().max() <= TOLERANCE
        assert not got[~kept].any()


def test_scoring_prompts_and_completions(arch):
    """RL scoring (GRPO's per-token log-probs): left-padded prompts, right-padded completions, the last
    prompt token's and every completion column's logits kept (``logits_to_keep``): run on the real tokens,
    each real kept column equal to its row run alone, unpadded."""
    model = _head(arch, "AutoModelForCausalLM")
    if "logits_to_keep" not in inspect_parameters(model):
        pytest.skip(f"{type(model).__name__} takes no logits_to_keep in transformers {TF}")
    prompts, completions = [[5, 6], [7, 8, 9, 10, 11], [12]], [[20, 21, 22, 23], [24, 25], [26, 27, 28]]
    width, length = max(map(len, prompts)), max(map(len, completions))
    rows = [[0] * (width - len(p)) + p + c + [0] * (length - len(c)) for p, c in zip(prompts, completions)]
    mask = [[0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (length - len(c))
            for p, c in zip(prompts, completions)]  # fmt: skip
    kwargs = {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(mask)}
    before = UNPADDED["calls"]
    with torch.no_grad(), unpadded():
        got = model(**kwargs, logits_to_keep=length + 1)
    assert UNPADDED["calls"] == before + 1
    for r, (p, c) in enumerate(zip(prompts, completions)):
        alone = run_alone(model, p + c)[len(p) - 1 :]  # [completion + 1, vocab]
        assert (got.logits[r, : len(c) + 1] - alone).abs().max() <= TOLERANCE
        assert not got.logits[r, len(c) + 1 :].any()


def test_a_right_padded_generate_is_unpad_falses(arch):
    import warnings

    model = _head(arch, "AutoModelForCausalLM")
    kwargs = batch(ROWS)
    options = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    keeps = [{}]
    if "logits_to_keep" in inspect_parameters(model):
        keeps.append({"logits_to_keep": 0})  # every column kept: the last one still read
    for keep in keeps:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (transformers' own: right padding detected)
            want = model.generate(**kwargs, **options, **keep)
            with unpadded():
                got = model.generate(**kwargs, **options, **keep)
        assert torch.equal(got, want), keep


def inspect_parameters(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def test_inputs_given_by_embeddings_are_counted(arch):
    model = _head(arch, "AutoModelForCausalLM")
    kwargs = batch(ROWS)
    embeds = model.get_input_embeddings()(kwargs.pop("input_ids"))
    with torch.no_grad():
        want = model(inputs_embeds=embeds, **kwargs).logits
        reason = "inputs given by embeddings"
        got = _padded_reason(lambda: model(inputs_embeds=embeds, **kwargs).logits, reason)
    assert torch.equal(got, want)


def test_an_encoder_decoder_models_padded_calls_are_counted():
    """BART's encoder and decoder keep the padded path (hfpatch unpads decoder-only models), counted."""
    from hfpatch.verification.tiny import tiny_seq2seq

    if arch_skip_reason("bart"):
        pytest.skip(arch_skip_reason("bart"))
    model = tiny_seq2seq("bart")
    kwargs = batch(ROWS)
    reason = "an encoder-decoder model (hfpatch unpads decoder-only models)"
    before = UNPADDED["padded"].get(reason, 0)
    with torch.no_grad():
        want = model(**kwargs, decoder_input_ids=kwargs["input_ids"]).logits
        with unpadded():
            got = model(**kwargs, decoder_input_ids=kwargs["input_ids"]).logits
    assert torch.equal(got, want)
    assert UNPADDED["padded"].get(reason, 0) > before, dict(UNPADDED["padded"])


def test_falcon_with_alibi_runs_and_says_why(fresh_warnings):
    """Falcon builds ALiBi from the 2-D mask it is given (``alibi=True``): a packed row is left to stock, with
    the reason; an unpadded call keeps the padded path (exact); ``status()`` says so."""
    _kept_here("falcon")  # (where they are not kept at all, alibi changes nothing)
    model = _head("falcon", "AutoModelForCausalLM", alibi=True, new_decoder_architecture=False)
    rows = [list(row) for row in ROWS]
    ids = torch.tensor([sum(rows, [])])
    positions = torch.cat([torch.arange(len(row)) for row in rows])[None]
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="ALiBi"):
            model(input_ids=ids, position_ids=positions)
        got = _padded_reason(lambda: model(**batch(ROWS)).logits, "its packed rows are not kept")
    mask = batch(ROWS)["attention_mask"]
    for r, row in enumerate(ROWS):
        assert (real(got, mask, r) - run_alone(model, row)).abs().max() <= TOLERANCE
    assert "not with alibi=True" in hfpatch.status()["falcon"].packed


def test_tuples_come_back_in_the_callers_layout(arch):
    """``return_dict=False``, of the head and of its base model: logits, hidden states and each layer's
    states at the real tokens are the padded call's."""
    model = tiny(arch)
    kwargs = batch(ROWS)
    mask = kwargs["attention_mask"]
    for call in (model, model.base_model):
        with torch.no_grad():
            want = call(**kwargs, return_dict=False, output_hidden_states=True)
            before = UNPADDED["calls"]
            with unpadded():
                got = call(**kwargs, return_dict=False, output_hidden_states=True)
        assert isinstance(got, tuple) and len(got) == len(want)
        assert UNPADDED["calls"] == before + 1
        assert (got[0] - want[0])[mask != 0].abs().max() <= TOLERANCE
        for g, w in zip(got[-1], want[-1]):  # each layer's hidden states
            assert (g - w)[mask != 0].abs().max() <= TOLERANCE


def test_a_pooled_token_picked_by_the_pad_id_is_the_padded_calls(arch):
    """A sequence-classification head pools the last token whose id is not ``pad_token_id``, whatever the
    mask says: where a pad's id is another, that token is a pad (the padded path, as stock pools it)."""
    model = _head(arch, "AutoModelForSequenceClassification", num_labels=3, pad_token_id=0)
    kwargs = batch(ROWS)
    kwargs["input_ids"] = kwargs["input_ids"].masked_fill(kwargs["attention_mask"] == 0, 7)  # pads of id 7
    labels = torch.tensor([0, 1, 2, 1])
    with torch.no_grad():
        want = model(**kwargs, labels=labels)
        reason = "a token pooled by the pad id, whose id a pad does not have"
        got = _padded_reason(lambda: model(**kwargs, labels=labels), reason)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)


def test_a_returned_cache_with_layers_of_state_is_laid_back_around_them():
    """The keys a packed row of real tokens left in a list-kept cache go back to the padded rows, zeros at
    the pads, and a layer that keeps no keys (None: a linear-attention layer of 5.2-5.4's hybrid caches,
    Qwen3-Next's and Qwen3.5's) stays as it is (the matrix found an AttributeError there)."""
    from types import SimpleNamespace

    from hfpatch.caches import lay_back

    lengths, width = [3, 1], 4  # left-padded: row 0 has 1 pad, row 1 has 3
    keys = torch.randn(1, 2, sum(lengths), 5)
    values = torch.randn(1, 2, sum(lengths), 5)
    cache = SimpleNamespace(key_cache=[keys, None], value_cache=[values, None])
    index = torch.tensor([r * width + width - n + i for r, n in enumerate(lengths) for i in range(n)])
    lay_back(cache, index, len(lengths), width)
    for got, flat in ((cache.key_cache[0], keys), (cache.value_cache[0], values)):
        want = torch.zeros(len(lengths), 2, width, 5)
        start = 0
        for r, n in enumerate(lengths):  # each row's real tokens at its right end
            want[r, :, width - n :] = flat[0, :, start : start + n]
            start += n
        assert torch.equal(got, want)
    assert cache.key_cache[1] is None and cache.value_cache[1] is None
