"""hfpatch: the right logits from Hugging Face transformers models with padding and KV caches.

>>> import hfpatch
>>> hfpatch.apply()           # doctest: +SKIP
>>> print(hfpatch.status())   # doctest: +SKIP
"""

import importlib
from typing import Any

from .custom import check_classes_with
from .engine import (
    AdapterStatus,
    Status,
    apply,
    patched,
    registry,
    revert,
    status,
    unpatched,
)

__version__ = "0.3.0.dev0"  # 0.2.0 and what CHANGELOG.md lists under Unreleased

__all__ = [
    "AdapterStatus",
    "CannotVerify",
    "Status",
    "ShadowMismatch",
    "__version__",
    "apply",
    "audit",
    "patched",
    "positions",
    "registry",
    "revert",
    "shadow",
    "status",
    "unpatched",
    "verify",
    "workers",
]


def _check_on_a_tiny_copy(cls: type) -> tuple[bool, str]:
    from .verification.classes import check  # imports torch: only when such a class exists

    return check(cls)


check_classes_with(_check_on_a_tiny_copy)


def __getattr__(name: str) -> Any:
    # hfpatch.positions and hfpatch.verification import torch: keep `import hfpatch` light until used
    if name in ("positions", "workers"):
        return importlib.import_module(f"hfpatch.{name}")
    if name in ("verify", "CannotVerify"):
        return getattr(importlib.import_module("hfpatch.verification"), name)
    if name in ("audit", "shadow", "ShadowMismatch"):
        module = importlib.import_module(f"hfpatch.{'auditing' if name == 'audit' else 'shadowing'}")
        return getattr(module, name)
    raise AttributeError(f"module 'hfpatch' has no attribute {name!r}")
