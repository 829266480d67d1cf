"""The core invariant, as a property: any batch, any padding (left, right, holes left by a padded
cached prefix), split into any number of KV-cached calls (a row may have no new tokens in a call):
the logits at every real token equal the row run alone, unpadded, in one call (fp32, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hfpatch.positions import new_token_positions
from hfpatch.support import in_range
from hfpatch.verification.tiny import tiny_model

from conftest import TF, static_cache_skip_reason, stock
from harness import TOLERANCE, WRONG, max_diff, random_case, random_rows, run_padded, static_cache

pytestmark = pytest.mark.invariant("I1")  # compat/REPORT.md's column

STATIC_LEN = 16  # 3 calls x 4 tokens at most, plus room


def padded_batches():
    """random_case (the compat matrix's generator too), drawn by hypothesis so that it shrinks."""
    return st.randoms(use_true_random=False).map(random_case)


def _check(model, case, **kwargs):
    rows, chunks, left = case
    got = run_padded(model, rows, chunks, left, **kwargs)
    assert max_diff(model, rows, got) <= TOLERANCE, (chunks, left)


@given(case=padded_batches())
def test_default_cache(model, case):
    _check(model, case)


@given(case=padded_batches(), full_length_mask=st.booleans())
def test_static_cache(model, arch, case, full_length_mask):
    reason = static_cache_skip_reason(model)
    if reason:
        pytest.skip(reason)
    cache = static_cache(model, len(case[0]), STATIC_LEN)
    _check(model, case, cache=cache, mask_width=STATIC_LEN if full_length_mask else None)


@given(case=padded_batches())
def test_inputs_embeds(model, case):
    """The same invariant when the batch comes as ``inputs_embeds``."""
    rows, chunks, left = case
    embed = model.get_input_embeddings()
    got = run_padded(_EmbedsOnly(model, embed), rows, chunks, left)
    assert max_diff(model, rows, got) <= TOLERANCE


class _EmbedsOnly:
    """Calls ``model`` with ``inputs_embeds`` in place of ``input_ids``."""

    def __init__(self, model, embed):
        self.model, self.embed, self.forward = model, embed, model.forward

    def __call__(self, input_ids, **kwargs):
        with torch.no_grad():
            return self.model(inputs_embeds=self.embed(input_ids), **kwargs)


def test_sdpa_mask_workaround(arch, adapter):
    """Where the adapter declares transformers' SDPA mask bug (Llama 4.36-4.37: ``_unmask_unattended``
    gets a padded cached prefix continued by several tokens wrong, or raises), stock transformers is
    wrong even with the positions passed by hand, and hfpatch is exact with SDPA attention."""
    if adapter.eager_mask is None or not in_range(adapter.eager_mask[0], TF):
        pytest.skip(f"the {arch} adapter declares no SDPA mask workaround for transformers {TF}")
    sdpa = tiny_model(arch, attention="sdpa")
    rows, chunks, left = (
        random_rows([4, 4], seed=0),
        [[2, 1], [1, 1], [1, 2]],
        [[False, True], [False] * 2, [False] * 2],
    )
    assert max_diff(sdpa, rows, run_padded(sdpa, rows, chunks, left)) <= TOLERANCE
    with stock():
        try:
            wrong = max_diff(sdpa, rows, run_padded(_PositionsByHand(sdpa), rows, chunks, left))
        except IndexError:  # transformers' mask code can also raise on these batches
            wrong = float("inf")
    assert wrong > WRONG, "the upstream bug no longer shows: drop the declaration"


@given(case=padded_batches())
def test_default_cache_with_sdpa_where_a_workaround_is_declared(arch, adapter, case):
    if adapter.eager_mask is None or not in_range(adapter.eager_mask[0], TF):
        pytest.skip(f"the {arch} adapter declares no SDPA mask workaround for transformers {TF}")
    _check(_sdpa(arch), case)


_sdpa_models: dict = {}


def _sdpa(arch):
    if arch not in _sdpa_models:
        _sdpa_models[arch] = tiny_model(arch, attention="sdpa")
    return _sdpa_models[arch]


class _PositionsByHand:
    def __init__(self, model):
        self.model, self.forward = model, model.forward

    def __call__(self, **kwargs):
        kwargs["position_ids"] = new_token_positions(kwargs["attention_mask"], kwargs["input_ids"].shape[1])
        return self.model(**kwargs)
