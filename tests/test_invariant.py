"""The core invariant, as a property: any batch, any padding (left, right, holes left by a padded
cached prefix), split into any number of KV-cached calls (a row may have no new tokens in a call):
the logits at every real token equal the row run alone, unpadded, in one call (fp32, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TF, make_static_cache, random_rows, static_cache_skip_reason, stock, upstream_bug
from hypothesis import given
from hypothesis import strategies as st

from hfpatch import doctor
from hfpatch.positions import new_token_positions

ATOL = 1e-5
STATIC_LEN = 16  # 3 calls x 4 tokens at most, plus room


@st.composite
def padded_batches(draw):
    batch = draw(st.integers(1, 3))
    calls = draw(st.integers(1, 3))
    chunks = [[draw(st.integers(0, 4)) for _ in range(batch)] for _ in range(calls)]
    for r in range(batch):  # every row has at least one real token
        if sum(c[r] for c in chunks) == 0:
            chunks[0][r] = draw(st.integers(1, 4))
    left = [[draw(st.booleans()) for _ in range(batch)] for _ in range(calls)]
    seed = draw(st.integers(0, 2**16))
    return chunks, left, seed


def _check(model, case, **kwargs):
    chunks, left, seed = case
    rows = random_rows([sum(c[r] for c in chunks) for r in range(len(chunks[0]))], seed=seed)
    got = doctor.run_batched(model, rows, chunks, left, **kwargs)
    assert doctor.max_diff(model, rows, got) <= ATOL, (chunks, left)


@given(case=padded_batches())
def test_default_cache(model, case):
    _check(model, case)


@given(case=padded_batches(), full_length_mask=st.booleans())
def test_static_cache(model, arch, case, full_length_mask):
    reason = static_cache_skip_reason(arch)
    if reason:
        pytest.skip(reason)
    cache = make_static_cache(model, len(case[0][0]), STATIC_LEN)
    _check(model, case, cache=cache, mask_width=STATIC_LEN if full_length_mask else None)


@given(case=padded_batches())
def test_inputs_embeds(model, case):
    """The same invariant when the batch comes as ``inputs_embeds``."""
    chunks, left, seed = case
    rows = random_rows([sum(c[r] for c in chunks) for r in range(len(chunks[0]))], seed=seed)
    embed = model.get_input_embeddings()
    got = doctor.run_batched(_EmbedsOnly(model, embed), rows, chunks, left)
    assert doctor.max_diff(model, rows, got) <= ATOL


class _EmbedsOnly:
    """Calls ``model`` with ``inputs_embeds`` in place of ``input_ids``."""

    def __init__(self, model, embed):
        self.model, self.embed, self.forward = model, embed, model.forward

    def __call__(self, input_ids, **kwargs):
        with torch.no_grad():
            return self.model(inputs_embeds=self.embed(input_ids), **kwargs)


def test_upstream_bug(arch):
    """Where the adapter declares an upstream bug (Llama 4.36-4.37: SDPA masks), hfpatch gives exactly
    what stock gives with positions passed by hand, and the declared workaround (eager attention)
    is exact: the bug is transformers', and hfpatch still fixes the positions."""
    why = upstream_bug(arch)
    if not why:
        pytest.skip(f"the {arch} adapter declares no upstream bug for transformers {TF}")
    sdpa = doctor.tiny_model(arch, attention="sdpa")
    rows, chunks, left = (
        random_rows([4, 4], seed=0),
        [[2, 1], [1, 1], [1, 2]],
        [[False, True], [False] * 2, [False] * 2],
    )
    patched = doctor.run_batched(sdpa, rows, chunks, left)
    with stock():
        by_hand = doctor.run_batched(_PositionsByHand(sdpa), rows, chunks, left)
    assert all(torch.equal(a, b) for a, b in zip(patched, by_hand))
    assert doctor.max_diff(sdpa, rows, patched) > 1e-3, (
        "the upstream bug no longer shows: update the declaration"
    )
    eager = doctor.tiny_model(arch, attention="eager")
    assert doctor.max_diff(eager, rows, doctor.run_batched(eager, rows, chunks, left)) <= ATOL


class _PositionsByHand:
    def __init__(self, model):
        self.model, self.forward = model, model.forward

    def __call__(self, **kwargs):
        kwargs["position_ids"] = new_token_positions(kwargs["attention_mask"], kwargs["input_ids"].shape[1])
        return self.model(**kwargs)
