"""Hypothesis strategies for padded batches split into KV-cached calls, for property tests of your own:

    from hypothesis import given
    from hfpatch.testing import assert_padding_invariant
    from hfpatch.testing.strategies import scenarios

    @given(scenarios())
    def test_any_padding_and_split(scenario):
        assert_padding_invariant(model, scenarios=[scenario])

    @given(packed_scenarios())
    def test_any_packing(scenario):
        assert_padding_invariant(model, scenarios=[scenario])

Needs ``hypothesis`` (``pip install hypothesis``).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from ..verification.scenarios import Scenario, packed

__all__ = ["packed_scenarios", "scenarios"]


@st.composite
def scenarios(draw: Any, max_rows: int = 3, max_calls: int = 3, max_new: int = 4) -> Scenario:
    """A padded batch of 1 to ``max_rows`` rows, split into 1 to ``max_calls`` calls of 0 to ``max_new``
    new tokens per row and call (every row at least one token), each row padded on the left or the
    right in each call (a right-padded call followed by more tokens leaves holes in the mask)."""
    rows = draw(st.integers(1, max_rows))
    calls = draw(st.integers(1, max_calls))
    chunks = [[draw(st.integers(0, max_new)) for _ in range(rows)] for _ in range(calls)]
    for r in range(rows):  # every row has a real token, and every call one row with a token
        if not any(chunk[r] for chunk in chunks):
            chunks[0][r] = draw(st.integers(1, max_new))
    for chunk in chunks:
        if not any(chunk):
            chunk[0] = 1
    left = [[draw(st.booleans()) for _ in range(rows)] for _ in range(calls)]
    lengths = tuple(sum(chunk[r] for chunk in chunks) for r in range(rows))
    name = f"drawn: {rows} rows, {calls} calls"
    return Scenario(name, lengths, tuple(map(tuple, chunks)), tuple(map(tuple, left)), cached=calls > 1)


@st.composite
def packed_scenarios(draw: Any, max_rows: int = 2, max_sequences: int = 4, max_length: int = 6) -> Scenario:
    """1 to ``max_rows`` rows, each packing 1 to ``max_sequences`` sequences of 1 to ``max_length`` tokens
    (positions restarting at each), right-padded to the longest row, with or without the 2-D mask (always
    with one where a row is padded): each sequence against itself alone."""
    rows = draw(st.integers(1, max_rows))
    counts = [draw(st.integers(1, max_sequences)) for _ in range(rows)]
    lengths = tuple(draw(st.integers(1, max_length)) for _ in range(sum(counts)))
    into = tuple(r for r, count in enumerate(counts) for _ in range(count))
    mask = draw(st.booleans())
    return packed(f"drawn packed: {rows} rows, {len(lengths)} sequences", lengths, into, mask)
