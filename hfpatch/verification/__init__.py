"""``hfpatch.verify``: padded and KV-cached batches, stock vs hfpatch, against each row run alone.

>>> result = hfpatch.verify("qwen2")   # doctest: +SKIP
>>> result.ok                          # doctest: +SKIP
True

The rooms: :mod:`.run` (``verify`` itself), :mod:`.scenarios` (what it runs, and how), :mod:`.load`
(what it is given, made a model), :mod:`.tiny` (tiny random models of any model type),
:mod:`.result` (what it returns).
"""

from .result import CannotVerify, Row, Verification
from .run import verify

__all__ = ["CannotVerify", "Row", "Verification", "verify"]
