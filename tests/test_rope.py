"""Rope scaled per row (hfpatch/rope.py): longrope and dynamic NTK choose each row's scaling from its
own largest position, not the batch's. A row of 20 tokens batched with one of 60 (original context 32)
must equal itself run alone, on stock transformers, with the same calls: in one call that is the row
alone in one call; across cached calls, keys cached earlier keep the rotation they were written with,
on stock too (a row that crosses the context between calls differs from itself in one call)."""

from __future__ import annotations

import copy

import pytest
import torch
from packaging.version import Version

import hfpatch

from conftest import TF, arch_skip_reason
from harness import TOLERANCE, WRONG, random_rows, run_padded, scaled_rope_model

CASES = [("phi3", "longrope"), ("llama", "dynamic")]
F, T = False, True
SCENARIOS = {  # (row lengths, chunks, left)
    "one call, right padding": ((20, 60), ((20, 60),), ((F, F),)),
    "one call, left padding": ((20, 60), ((20, 60),), ((T, T),)),
    "two cached calls": ((20, 60), ((12, 24), (8, 36)), ((F, F), (F, F))),
    "prefill + 4 decode steps": (
        (20, 34),
        ((16, 30), (1, 1), (1, 1), (1, 1), (1, 1)),
        ((T, T),) + ((F, F),) * 4,
    ),
}


def _needs(model_type, kind):
    reason = arch_skip_reason(model_type)
    if reason:
        pytest.skip(reason)
    if TF < Version("4.51") or (kind == "dynamic" and TF < Version("4.56")):
        pytest.skip(f"per-row {kind} scaling needs transformers 4.51 (dynamic: 4.56); installed {TF}")


def _alone(fresh, row, counts):
    """The row alone, unpadded, with the same calls, on stock and a fresh copy (stock dynamic NTK keeps
    state from earlier calls)."""
    model = copy.deepcopy(fresh)
    chunks = [(c,) for c in counts if c]
    with hfpatch.unpatched():
        return run_padded(model, [row], chunks, [(False,)] * len(chunks))[0]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type, kind", CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_each_row_is_scaled_as_it_would_be_alone(model_type, kind, attention):
    _needs(model_type, kind)
    fresh = scaled_rope_model(model_type, kind, attention)
    stock_errors = []
    for name, (lengths, chunks, left) in SCENARIOS.items():
        rows = random_rows(lengths, seed=len(name))
        references = [_alone(fresh, row, [c[r] for c in chunks]) for r, row in enumerate(rows)]
        for side in ("hfpatch", "stock"):
            model = copy.deepcopy(fresh)
            with hfpatch.unpatched() if side == "stock" else hfpatch.patched():
                got = run_padded(model, rows, chunks, left)
            error = max((ref - out).abs().max().item() for ref, out in zip(references, got))
            if side == "hfpatch":
                assert error <= TOLERANCE, f"{name}: {error}"
            else:
                stock_errors.append(error)
    assert max(stock_errors) > WRONG, "stock transformers is right: the fix is not needed"


@pytest.mark.parametrize("model_type, kind", CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_rows_inside_the_original_context_are_unchanged(model_type, kind):
    """Both rows inside the original context: the patched rotary forward gives stock's numbers."""
    _needs(model_type, kind)
    model = scaled_rope_model(model_type, kind)
    rows = random_rows([12, 20], seed=5)
    ids = torch.tensor([rows[0] + [0] * 8, rows[1]])
    positions = torch.arange(20)[None].expand(2, -1)
    outputs = []
    for context in (hfpatch.patched(), hfpatch.unpatched()):
        with context, torch.no_grad():
            outputs.append(copy.deepcopy(model)(input_ids=ids, position_ids=positions).logits)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.compile
@pytest.mark.parametrize("model_type, kind", CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_compiles_with_fullgraph(model_type, kind):
    """No graph break of its own: the per-row choice is tensor ops (stock's batch-wide choice branches
    in Python on some releases, so stock is not compiled here)."""
    _needs(model_type, kind)
    model = scaled_rope_model(model_type, kind)
    rows = random_rows([20, 60], seed=7)
    ids = torch.tensor([rows[0] + [0] * 40, rows[1]])
    mask = torch.tensor([[1] * 20 + [0] * 40, [1] * 60])
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            got = compiled(input_ids=ids, attention_mask=mask).logits
            eager = model(input_ids=ids, attention_mask=mask).logits
    finally:
        torch._dynamo.reset()
    assert (got - eager).abs().max().item() <= TOLERANCE
    assert (got[0, :20] - _alone(model, rows[0], [20])).abs().max().item() <= TOLERANCE


def test_only_rotary_classes_under_transformers_wrapper_are_replaced():
    """A class whose forward is not wrapped in ``dynamic_rope_update`` (or a release without it, before
    4.51) is left alone, whatever decorates its forward."""
    import functools
    import types

    from hfpatch.rope import rotary_classes

    module = types.ModuleType("not_a_transformers_module")

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs)

        return wrapper

    class Plain(torch.nn.Module):
        def forward(self, x, position_ids):
            return x

    class Decorated(torch.nn.Module):
        @decorate
        def forward(self, x, position_ids):
            return x

    for cls in (Plain, Decorated):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    assert rotary_classes(module) == []


@pytest.mark.parametrize("layout", ["packed", "unpadded"])
@pytest.mark.parametrize("model_type, kind", CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_each_packed_sequence_is_scaled_as_it_would_be_alone(model_type, kind, layout):
    """A sequence of 20 tokens packed (positions restarting) or unpadded (``apply(unpad=True)``) with one
    of 60: each is rotated with its own scaling, as alone, not the row's longest."""
    _needs(model_type, kind)
    fresh = scaled_rope_model(model_type, kind, "sdpa")
    rows = random_rows([20, 60, 9], seed=3)
    references = [_alone(fresh, row, [len(row)]) for row in rows]
    model = copy.deepcopy(fresh)
    with torch.no_grad():
        if layout == "packed":
            ids = torch.tensor([sum(rows, [])])
            positions = torch.cat([torch.arange(len(row)) for row in rows])[None]
            out = model(input_ids=ids, position_ids=positions).logits[0].split([len(r) for r in rows])
        else:
            hfpatch.apply(unpad=True)
            try:
                out = run_padded(model, rows, [[len(r) for r in rows]], [[False] * len(rows)])
            finally:
                hfpatch.apply(unpad=False)
    error = max((ref - got).abs().max().item() for ref, got in zip(references, out))
    assert error <= TOLERANCE, error
