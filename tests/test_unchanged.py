"""What hfpatch must leave exactly as stock transformers has it (bit-identical outputs, or the very
same exception): explicit position_ids / cache_position, calls without a mask, 4-D masks, generate()."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from hfpatch.plans import SLOTS

from conftest import MULTIPLE_CHOICE, TF, cache_object_skip_reason, make_dynamic_cache, plan, spying, stock
from harness import cache_kwarg, output_cache, random_rows


def same_as_stock(run):
    """Run ``run()`` patched and on stock; both must return bit-identical tensors or raise alike."""
    results = []
    for context in (contextlib.nullcontext(), stock()):
        with context:
            try:
                results.append(("ok", run()))
            except Exception as exc:  # noqa: BLE001 - comparing behaviour, whatever it is
                results.append(("raised", f"{type(exc).__name__}: {exc}"))
    (kind_p, patched), (kind_s, original) = results
    assert kind_p == kind_s, results
    if kind_p == "raised":
        assert patched == original
    else:
        assert len(patched) == len(original)
        for a, b in zip(patched, original):
            assert torch.equal(a, b)
    return kind_p


def _two_calls(model, extra1, extra2, mask=True):
    """A right-padded prefix then a 2-token suffix, through the model's default cache."""
    a, b = random_rows([5, 6], seed=11)
    ids1 = torch.tensor([a[:3] + [0], b[:4]])
    mask1 = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ids2 = torch.tensor([a[3:5], b[4:6]])
    mask2 = torch.cat([mask1, torch.ones(2, 2, dtype=torch.long)], dim=1)
    with torch.no_grad():
        out1 = model(input_ids=ids1, attention_mask=mask1 if mask else None, use_cache=True, **extra1)
        out2 = model(
            input_ids=ids2,
            attention_mask=mask2 if mask else None,
            **{cache_kwarg(model): output_cache(out1)},
            **extra2,
        )
    return out1.logits, out2.logits


@pytest.mark.invariant("I2")
def test_explicit_position_ids(model):
    first = {"position_ids": torch.tensor([[0, 1, 2, 2], [0, 1, 2, 3]])}
    # deliberately odd, used as given (below the cache length: Llama < 4.35 cannot look up larger ones)
    second = {"position_ids": torch.tensor([[5, 1], [0, 3]])}
    assert same_as_stock(lambda: _two_calls(model, first, second)) == "ok"


@pytest.mark.invariant("I2")
def test_explicit_position_ids_and_cache_position(model, arch):
    if plan(model).era != SLOTS:
        pytest.skip(f"{type(model.base_model).__name__}.forward has no cache_position in transformers {TF}")
    first = {"position_ids": torch.tensor([[0, 1, 2, 2], [0, 1, 2, 3]]), "cache_position": torch.arange(4)}
    second = {"position_ids": torch.tensor([[3, 4], [4, 5]]), "cache_position": torch.arange(4, 6)}
    assert same_as_stock(lambda: _two_calls(model, first, second)) == "ok"


@pytest.mark.invariant("I2")
def test_explicit_cache_position_is_forwarded_as_given(model, arch):
    """cache_position alone says where the cache writes, not the positions (transformers' own doc:
    "not affected by padding"): hfpatch forwards the caller's tensor itself and still derives
    position_ids from the mask."""
    if plan(model).era != SLOTS:
        pytest.skip(f"{type(model.base_model).__name__}.forward has no cache_position in transformers {TF}")
    slots = torch.arange(4)
    with spying(model) as seen:
        _two_calls(model, {"cache_position": slots}, {})
    assert seen[0]["cache_position"] is slots
    # row 0 is right-padded: its pad takes the position of the last real token before it
    assert seen[0]["position_ids"].tolist() == [[0, 1, 2, 2], [0, 1, 2, 3]]


@pytest.mark.invariant("I3")
def test_no_mask(model):
    assert same_as_stock(lambda: _two_calls(model, {}, {}, mask=False)) == "ok"


@pytest.mark.invariant("I3")
def test_no_mask_single_call_with_dynamic_cache_object(model):
    reason = cache_object_skip_reason(model, "dynamic")
    if reason:
        pytest.skip(reason)
    (row,) = random_rows([5], seed=2)

    def run():
        with torch.no_grad():
            return (
                model(
                    input_ids=torch.tensor([row]), **{cache_kwarg(model): make_dynamic_cache(model)}
                ).logits,
            )

    assert same_as_stock(run) == "ok"


@pytest.mark.invariant("I3")
def test_4d_mask(model):
    """A 4-D mask is the caller's own business: hfpatch passes it on untouched."""
    (row,) = random_rows([4], seed=4)
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None]
    float_mask = torch.zeros(1, 1, 4, 4).masked_fill(~causal, torch.finfo(torch.float32).min)
    ran = []
    for mask in (float_mask, causal, causal.long()):  # the forms releases take (a float one, from 4.53 bool)

        def run(mask=mask):
            with torch.no_grad():
                return (model(input_ids=torch.tensor([row]), attention_mask=mask).logits,)

        ran.append(same_as_stock(run))  # equal outputs, or the very same error
    if "ok" not in ran:  # (each raised the very same error on both sides: checked, nothing to compare)
        pytest.skip(f"{type(model).__name__} takes no 4-D mask in transformers {TF}, on stock either")


@pytest.mark.invariant("I4")
def test_generate_left_padded_greedy(model):
    a, b = random_rows([3, 6], seed=9)
    ids = torch.tensor([[0, 0, 0] + a, b])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])

    def run():
        with torch.no_grad():
            return (
                model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
                ),
            )

    assert same_as_stock(run) == "ok"


@pytest.mark.invariant("I3")
def test_multiple_choice_inputs(model, arch):
    """A multiple-choice head (GPT2DoubleHeadsModel) feeds [batch, choices, tokens] ids and masks: left
    exactly as stock."""
    if arch not in MULTIPLE_CHOICE:
        pytest.skip(f"{arch} has no multiple-choice model")
    import transformers

    torch.manual_seed(0)
    double = getattr(transformers, MULTIPLE_CHOICE[arch])(model.config).eval()
    ids = torch.tensor(random_rows([6, 6], seed=12)).reshape(1, 2, 6)
    mask = torch.tensor([[[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]])

    def run():
        with torch.no_grad():
            out = double(input_ids=ids, attention_mask=mask, mc_token_ids=torch.tensor([[5, 5]]))
        return out.logits, out.mc_logits

    assert same_as_stock(run) == "ok"


@pytest.mark.invariant("I2")
def test_deprecated_cache_name_keeps_transformers_warning(model):
    """Where the release renamed the cache argument and still takes the old name with a warning of
    its own (5.24: ``past_key_values`` -> ``cache``, transformers' test_bc_cache_name_forward), hfpatch
    hands the cache on under the caller's name: the warning reaches the caller, results are equal."""
    old = plan(model).old_cache_kw
    if old is None:
        pytest.skip(f"transformers {TF} takes the cache under one name only")
    rows = random_rows([4], seed=13)
    ids = torch.tensor([rows[0][3:]])
    mask = torch.ones(1, 4, dtype=torch.long)

    def second_call(name):
        with torch.no_grad():
            first = output_cache(model(input_ids=torch.tensor([rows[0][:3]]), use_cache=True))
            return model.base_model(input_ids=ids, attention_mask=mask, **{name: first}).last_hidden_state

    with pytest.warns(FutureWarning, match=old):
        by_old_name = second_call(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        by_new_name = second_call(cache_kwarg(model))
    assert torch.equal(by_old_name, by_new_name)
    with stock(), pytest.warns(FutureWarning, match=old):
        second_call(old)
