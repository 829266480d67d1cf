"""The pytest plugin (entry point ``pytest11``): installing hfpatch gives every test suite the fixture
``assert_padding_invariant``, :func:`hfpatch.testing.assert_padding_invariant` itself.

    def test_my_model_batches_as_its_rows(assert_padding_invariant):
        assert_padding_invariant(my_tiny_model().eval())

Importing this module imports neither torch nor transformers: pytest loads it in every run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def assert_padding_invariant() -> Callable[..., Any]:
    """:func:`hfpatch.testing.assert_padding_invariant`: padded and KV-cached batches against each row
    run alone, unpadded; an ``AssertionError`` with a table where a real token differs."""
    from hfpatch.testing import assert_padding_invariant as check

    return check
