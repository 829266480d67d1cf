"""torch.compile: a patched model compiles with fullgraph=True (no graph break) and gives the same
logits as eager; one inductor run. Compile is slow on CPU: keep these few and small."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import hfpatch
from hfpatch.plans import SLOTS
from hfpatch.positions import new_token_positions

from conftest import (
    TF,
    cache_object_skip_reason,
    make_dynamic_cache,
    plan,
    reverted,
    static_cache_skip_reason,
)
from expectations import ABSOLUTE
from harness import TOLERANCE, cache_kwarg, max_diff, output_cache, random_rows, run_padded, static_cache

pytestmark = [pytest.mark.compile, pytest.mark.invariant("I6")]  # I6: compat/REPORT.md's column
CHUNKS = ((3, 4), (2, 1))
LEFT = ((False, False), (True, False))


class _Compiled:
    """Calls a compiled ``model.forward`` in place of the model (run_batched's interface)."""

    def __init__(self, model, **options):
        self.forward = model.forward  # for the signature
        self.compiled = torch.compile(model, fullgraph=True, **options)

    def __call__(self, **kwargs):
        return self.compiled(**kwargs)


def stock_first(run):
    """Run ``run`` on stock transformers first: where stock itself cannot compile with fullgraph=True
    (Llama 4.34 branches on `0 in attention_mask`, for one), there is nothing to compare: skip."""
    with reverted():
        try:
            return run()
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
            first_line = str(exc).strip().splitlines()[0][:200]
            pytest.skip(
                f"stock transformers {TF} does not compile this with fullgraph=True either: {first_line}"
            )
        finally:
            torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow  # nox -s ci runs it; the quick suite keeps test_no_graph_break_of_its_own
def test_fullgraph_eager_backend(model):
    rows = random_rows([5, 5], seed=41)
    stock_first(lambda: run_padded(_Compiled(model, backend="eager"), rows, CHUNKS, LEFT))
    eager = run_padded(model, rows, CHUNKS, LEFT)
    compiled = run_padded(_Compiled(model, backend="eager"), rows, CHUNKS, LEFT)
    for a, b in zip(eager, compiled):
        assert (a - b).abs().max().item() <= TOLERANCE
    assert max_diff(model, rows, compiled) <= TOLERANCE


@pytest.mark.slow  # nox -s ci runs it (and the matrix on its sample: a release of every mask code)
def test_a_compiled_training_step_is_the_eager_one(arch):
    """A patched model in training mode (dropout off), compiled, gives eager's loss and gradients on a
    padded batch with labels (4.42-4.52's mask code, patched by hfpatch, once sent dynamo into a
    recursion here)."""
    from hfpatch.verification.tiny import tiny_model

    model = tiny_model(arch).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    rows = random_rows([6, 3], seed=7)
    ids = torch.tensor([rows[0], rows[1] + [0] * 3])
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    labels = ids.masked_fill(mask == 0, -100)

    def step(call):
        model.zero_grad(set_to_none=True)
        loss = call(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = step(model)
    got, got_grads = step(torch.compile(model, backend="eager"))
    assert (got - want).abs().item() <= TOLERANCE
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        assert ((got_grads[name] - grad).norm() / grad.norm().clamp(min=1e-12)).item() <= 1e-5, name


INDUCTOR_ARCH = ABSOLUTE


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_padded_batch(model, arch):
    if arch != INDUCTOR_ARCH:  # one is enough (slow on CPU): the most position-sensitive family
        pytest.skip(f"one inductor test is enough (slow on CPU): {INDUCTOR_ARCH}, absolute positions")
    rows = random_rows([5, 5], seed=42)
    stock_first(lambda: run_padded(_Compiled(model, backend="eager"), rows, CHUNKS, LEFT))
    compiled = run_padded(_Compiled(model), rows, CHUNKS, LEFT)
    eager = run_padded(model, rows, CHUNKS, LEFT)
    for a, b in zip(eager, compiled):
        assert (a - b).abs().max().item() <= TOLERANCE
    assert max_diff(model, rows, compiled) <= TOLERANCE


def _explain(model, **kwargs):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch._dynamo.explain(model)(**kwargs)


def test_no_graph_break_of_its_own(model):
    """Where stock compiles without a break, so does hfpatch; where stock transformers breaks the graph
    itself (Llama 4.34-4.37 mask code), every break hfpatch shows is at one of stock's own places
    (dynamo may count one of them once more, as it resumes one more frame)."""
    a, b = random_rows([3, 5], seed=43)
    kwargs = {
        "input_ids": torch.tensor([[0, 0] + a, b]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1] * 5]),
    }
    patched = _explain(model, **kwargs)
    with reverted():
        original = _explain(model, **kwargs)
    if original.graph_break_count == 0:
        assert patched.graph_break_count == 0
    assert _break_places(patched) <= _break_places(original)
    package = os.path.dirname(hfpatch.__file__) + os.sep  # (not any path naming hfpatch: the matrix's venvs)
    assert not any(place[0].startswith(package) for place in _break_places(patched))


def _break_places(explained):
    return {
        (r.user_stack[-1].filename, r.user_stack[-1].lineno) for r in explained.break_reasons if r.user_stack
    }


def _decode(model, arch, prompt, steps, cache_factory, explicit, compiled_forward, mask_width=None):
    """Greedy decoding, one forward call per token, with a growing (or full-length) 2-D mask."""
    has_cache_position = plan(model).era == SLOTS
    batch, length = prompt["input_ids"].shape
    cache, mask = cache_factory(), prompt["attention_mask"]
    ids, tokens = prompt["input_ids"], []
    for _ in range(steps + 1):
        call_mask = (
            mask
            if mask_width is None
            else torch.cat([mask, mask.new_zeros(batch, mask_width - mask.shape[1])], 1)
        )
        kwargs = {"input_ids": ids, "attention_mask": call_mask, "use_cache": True, cache_kwarg(model): cache}
        if explicit:
            kwargs["position_ids"] = new_token_positions(mask, ids.shape[1])
            if has_cache_position:
                kwargs["cache_position"] = torch.arange(mask.shape[1] - ids.shape[1], mask.shape[1])
        with torch.no_grad():
            out = compiled_forward(**kwargs)
        returned = output_cache(out)
        cache = returned if returned is not None else cache
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(ids)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
    return torch.cat(tokens, dim=1)


def _prompt():
    a, b = random_rows([4, 6], seed=44)
    return {
        "input_ids": torch.tensor([[0, 0] + a, b]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]),
    }


@pytest.mark.slow  # nox -s ci runs it; the quick suite keeps test_no_graph_break_of_its_own
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_decode_loop_compiles_no_more_graphs_than_stock(model, arch, kind):
    """Prefill + 12 steps, mask given, no position_ids or cache_position: as few graphs as stock with
    explicit inputs, and the same tokens as eager. Some releases recompile at every step on stock too
    (4.48, for one: the growing cache is an nn.Module whose int ``_seen_tokens`` dynamo specializes), so
    both runs may compile one graph per call: the counts are compared, not cut off at dynamo's limit."""
    steps = 12
    if kind == "dynamic":
        if cache_object_skip_reason(model, "dynamic"):  # legacy tuples: the model's default cache
            factory, width = (lambda: None), None
        else:
            factory, width = (lambda: make_dynamic_cache(model)), None
    else:
        reason = static_cache_skip_reason(model)
        if reason:
            pytest.skip(reason)
        factory, width = (lambda: static_cache(model, 2, 32)), 32
    prompt = _prompt()
    eager = _decode(
        model, arch, prompt, steps, factory, explicit=False, compiled_forward=model, mask_width=width
    )
    counts = {}

    def run(name):
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        got = _decode(
            model,
            arch,
            prompt,
            steps,
            factory,
            explicit=name == "stock",
            compiled_forward=compiled,
            mask_width=width,
        )
        counts[name] = counter.frame_count
        assert torch.equal(got, eager), name

    with torch._dynamo.config.patch(recompile_limit=steps + 2):
        stock_first(lambda: run("stock"))
        run("hfpatch")
    assert counts["hfpatch"] <= counts["stock"], counts


@pytest.mark.slow  # nox -s ci runs it; the quick suite keeps test_no_graph_break_of_its_own
def test_dynamic_shapes_prompt_length_adds_no_recompiles(model):
    counts = {}

    def run(name):
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
        for length in (5, 7, 9, 12):
            ids = torch.tensor(random_rows([length, length], seed=length))
            mask = torch.ones(2, length, dtype=torch.long)
            mask[0, :2] = 0
            kwargs = {"input_ids": ids, "attention_mask": mask}
            if name == "stock":
                kwargs["position_ids"] = new_token_positions(mask, length)
            with torch.no_grad():
                compiled(**kwargs)
        counts[name] = counter.frame_count

    stock_first(lambda: run("stock"))
    run("hfpatch")
    assert counts["hfpatch"] <= counts["stock"], counts


def _left_padded(seed: int) -> dict:
    a, b = random_rows([3, 5], seed=seed)
    return {
        "input_ids": torch.tensor([[0, 0] + a, b]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1] * 5]),
    }


def test_compiled_calls_follow_unpatched_and_the_audit(model):
    """I10: a graph traced inside ``unpatched()`` or under the audit (which holds the patch unpinned)
    gives stock's logits there, and the patched ones again outside; the eager calls of each context are
    the reference (the rows here have left padding: stock and hfpatch differ where positions are absolute
    or the model is not rotary-exact)."""
    import hfpatch

    kwargs = _left_padded(seed=45)
    with torch.no_grad():
        patched = model(**kwargs).logits
        with hfpatch.unpatched():
            stock_eager = model(**kwargs).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with hfpatch.unpatched():
            assert torch.equal(compiled(**kwargs).logits, stock_eager)
        assert torch.equal(compiled(**kwargs).logits, patched)
        hfpatch.revert()
        try:
            with hfpatch.audit():  # the program's results unchanged: stock's
                assert torch.equal(compiled(**kwargs).logits, stock_eager)
        finally:
            hfpatch.apply()
        assert torch.equal(compiled(**kwargs).logits, patched)


def test_compiled_positions_on_a_model_that_keeps_no_packed_rows_say_nothing(recwarn):
    """A compiled call with the caller's positions on a model whose packed rows are not kept (OpenAI GPT:
    its mask code takes no 4-D mask): one graph under fullgraph=True, no warning from inside the trace,
    stock's logits (an ordinary padded batch whose positions never restart)."""
    from hfpatch.verification.tiny import tiny_model

    model = tiny_model("openai-gpt", attention="eager")
    assert hfpatch.status()["openai-gpt"].packed.startswith("no")
    kwargs = _left_padded(seed=46)
    kwargs["position_ids"] = new_token_positions(kwargs["attention_mask"], 5)
    counter = CompileCounter()
    with torch.no_grad():
        with reverted():  # compiled stock
            want = torch.compile(model, fullgraph=True, backend="eager")(**kwargs).logits
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend=counter)(**kwargs).logits
    assert counter.frame_count == 1
    assert (got - want).abs().max().item() <= TOLERANCE  # (compiled graphs: fp32 rounding apart)
    assert not [w for w in recwarn if "hfpatch" in str(w.message)], [str(w.message) for w in recwarn]
