"""What differs between transformers releases that every room needs, stated once: the cache argument's
name, where a call returns its cache, ``StaticCache``'s constructor, how ``from_pretrained`` names the
dtype, and the transformers modules the per-call code reads. The runtime, ``verify``, the tests and the
benchmarks read these from here.

Imports torch and transformers: imported when a class is patched or a check runs, never by
``import hfpatch`` or ``apply()``. The modules are imported here, at import, not in a call: dynamo
cannot trace an import from transformers' lazy module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Optional

import torch

try:
    from transformers import cache_utils
except ImportError:  # before 4.36
    cache_utils = None
try:
    from transformers import modeling_rope_utils
except ImportError:  # before 4.43
    modeling_rope_utils = None

__all__ = [
    "CACHE_NAMES",
    "at_trace_time",
    "attaches_static_caches",
    "cache_name",
    "cache_utils",
    "dtype_keyword",
    "modeling_rope_utils",
    "new_static_cache",
    "output_cache",
]

CACHE_NAMES = ("cache", "past_key_values")  # 5.24 renamed past_key_values -> cache


def at_trace_time(function: Callable) -> Callable:
    """``function`` run by dynamo while it traces, outside the graph and not again by the graph it makes
    (``torch.compiler.assume_constant_result``, torch 2.2+; it returns a constant); before 2.2, a function
    that does nothing."""
    mark = getattr(torch.compiler, "assume_constant_result", None)
    return mark(function) if mark is not None else lambda *_: True


STATE = "state"  # what RWKV takes and returns instead: its state itself (a list of tensors)
# what a model without a KV cache takes for its states: 4.x Mamba's ``cache_params``, RWKV's ``state``
STATE_NAMES = ("cache_params", STATE)


def passed(kwargs: dict, names: tuple[str, ...]) -> Any:
    """The first of ``names`` a call's ``kwargs`` hold (not None): its cache, or its states; else None."""
    return next((kwargs[name] for name in names if kwargs.get(name) is not None), None)


def asked(kwargs: dict, config: Any, name: str) -> bool:
    """Whether a call asks for an output (``output_attentions`` ...): by keyword, else (None or absent) by
    the config."""
    value = kwargs.get(name)
    return bool(getattr(config, name, False) if value is None else value)


def cache_name(model: Any) -> Optional[str]:
    """The cache argument of ``model``'s forward (a model, or a forward function): ``cache`` (5.24+),
    ``past_key_values``, a state's (:data:`STATE_NAMES`), or ``None`` for a model without a cache."""
    forward: Callable = getattr(model, "forward", model)
    params = inspect.signature(forward).parameters
    return next((name for name in (*CACHE_NAMES, *STATE_NAMES) if name in params), None)


def output_cache(output: Any) -> Any:
    """The cache a call returned: ``.cache`` (5.24+) or ``.past_key_values``, read as keys of a
    transformers output (5.24's ``past_key_values`` property logs a deprecation), as attributes of any
    other object (a user's own forward's); None where it returned none."""
    keys, names = getattr(output, "keys", None), (*CACHE_NAMES, *STATE_NAMES)
    if callable(keys):
        found = keys()
        return next((output[key] for key in names if key in found), None)
    return next((value for key in names if (value := getattr(output, key, None)) is not None), None)


def new_static_cache(
    model: Any, batch: int, length: int, device: Any = "cpu", dtype: torch.dtype = torch.float32
) -> Any:
    """A ``StaticCache`` of ``length`` slots for ``model``: its constructor's keywords changed across
    releases (``max_batch_size`` then ``batch_size``; ``device`` and ``dtype`` later inferred)."""
    import transformers

    params = inspect.signature(transformers.StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": length}
    for name, value in (
        ("max_batch_size", batch),
        ("batch_size", batch),
        ("device", device),
        ("dtype", dtype),
    ):
        if name in params:
            kwargs[name] = value
    try:
        return transformers.StaticCache(**kwargs)
    except TypeError as exc:  # 4.54-4.55 take the layers' batch_size, device and dtype through **kwargs
        if "batch_size" not in str(exc):
            raise
        return transformers.StaticCache(**kwargs, batch_size=batch, device=device, dtype=dtype)


def attaches_static_caches(model: Any) -> bool:
    """transformers 4.38-4.40: a static cache lives on the attention layers (``model._setup_cache``);
    a ``StaticCache`` object passed as the cache argument is broken there (every layer writes one
    buffer). ``model``: a model instance or class."""
    return hasattr(model, "_setup_cache")


def dtype_keyword() -> str:
    """``from_pretrained``'s dtype argument: ``dtype`` from 4.56, ``torch_dtype`` before."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
