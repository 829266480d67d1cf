"""torch.compile: a patched model compiles with fullgraph=True (no graph break) and gives the same
logits as eager; one inductor run. Compile is slow on CPU: keep these few and small."""

from __future__ import annotations

import pytest
import torch
from conftest import random_rows

from hfpatch import doctor

pytestmark = pytest.mark.compile
ATOL = 1e-5
CHUNKS = ((3, 4), (2, 1))
LEFT = ((False, False), (True, False))


class _Compiled:
    """Calls a compiled ``model.forward`` in place of the model (run_batched's interface)."""

    def __init__(self, model, **options):
        self.forward = model.forward  # for the signature
        self.compiled = torch.compile(model, fullgraph=True, **options)

    def __call__(self, **kwargs):
        return self.compiled(**kwargs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_fullgraph_eager_backend(model):
    rows = random_rows([5, 5], seed=41)
    eager = doctor.run_batched(model, rows, CHUNKS, LEFT)
    compiled = doctor.run_batched(_Compiled(model, backend="eager"), rows, CHUNKS, LEFT)
    for a, b in zip(eager, compiled):
        assert (a - b).abs().max().item() <= ATOL
    assert doctor.max_diff(model, rows, compiled) <= ATOL


@pytest.mark.inductor
def test_inductor_padded_batch(model, arch):
    if arch != "gpt2":
        pytest.skip("one inductor test is enough (slow on CPU): GPT-2, the most position-sensitive")
    rows = random_rows([5, 5], seed=42)
    compiled = doctor.run_batched(_Compiled(model), rows, CHUNKS, LEFT)
    eager = doctor.run_batched(model, rows, CHUNKS, LEFT)
    for a, b in zip(eager, compiled):
        assert (a - b).abs().max().item() <= ATOL
    assert doctor.max_diff(model, rows, compiled) <= ATOL
