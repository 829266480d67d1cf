"""Shared fixtures: tiny random models per architecture, stock/patched switching, release facts.

Every test runs on whatever transformers release is installed; a test that cannot apply to it skips
with the release fact that says why (see ../shared/research/transformers-versions.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from packaging.version import Version

import hfpatch
from hfpatch import doctor, engine
from hfpatch.gates import (
    Signature,
    installed_transformers,
    read_signature,
    release_has,
    support,
    upstream_bugs_on,
)

settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "matrix", parent=settings.get_profile("default"), max_examples=8
)  # compat/: 64 releases
settings.load_profile(os.environ.get("HFPATCH_HYPOTHESIS_PROFILE", "default"))

TF = installed_transformers()
ARCHS = ("gpt2", "llama", "gemma")


def arch_skip_reason(arch: str) -> str | None:
    """Why ``arch`` cannot be tested here: absent from this release (a fact), or outside its range."""
    adapter = engine._registry[arch]
    if not release_has(adapter):
        return f"{adapter.cls} is not in transformers {TF} (no {adapter.module})"
    verdict = support(adapter, TF)
    return None if verdict.patchable else verdict.reason


def static_cache_skip_reason(arch: str) -> str | None:
    if TF < Version("4.38"):
        return f"StaticCache first shipped in 4.38 (installed: {TF})"
    if TF < Version("4.41"):
        return (
            f"a StaticCache object as the cache argument needs 4.41+ (installed: {TF}; see test_setup_cache)"
        )
    if arch == "gpt2" and TF < Version("4.52"):
        return f"GPT-2 accepts Cache objects from 4.52 (installed: {TF})"
    return None


def make_static_cache(model: Any, batch: int, length: int) -> Any:
    return doctor.static_cache(model, batch, length)


def make_dynamic_cache(model: Any) -> Any:
    import transformers

    if "config" in inspect.signature(transformers.DynamicCache.__init__).parameters:
        return transformers.DynamicCache(config=model.config)
    return transformers.DynamicCache()


@pytest.fixture(autouse=True)
def _applied() -> Iterator[None]:
    """Every test starts with hfpatch applied and leaves it applied."""
    hfpatch.apply()
    yield
    hfpatch.apply()


@contextlib.contextmanager
def stock() -> Iterator[None]:
    """Run a block on unpatched transformers."""
    hfpatch.revert()
    try:
        yield
    finally:
        hfpatch.apply()


@contextlib.contextmanager
def spying(model: Any) -> Iterator[list[dict[str, Any]]]:
    """Record the keyword arguments the original (unpatched) base-model forward receives."""
    owner = type(model.base_model)
    hfpatch.revert()
    original = owner.__dict__["forward"]
    seen: list[dict[str, Any]] = []

    @functools.wraps(original)
    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(self, *args, **kwargs)

    owner.forward = spy
    try:
        hfpatch.apply()
        yield seen
    finally:
        hfpatch.revert()
        owner.forward = original
        hfpatch.apply()


_models: dict[str, Any] = {}


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    reason = arch_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def upstream_bug(arch: str) -> str | None:
    """The upstream bug the adapter declares for this release, if any (its workaround is eager attention)."""
    return next(iter(upstream_bugs_on(engine._registry[arch], TF)), None)


@pytest.fixture
def model(arch: str) -> Any:
    """The tiny model; with eager attention where the adapter declares an upstream SDPA bug (the
    declared workaround), so that the tests check hfpatch, not that bug (test_upstream_bug shows it)."""
    if arch not in _models:
        _models[arch] = doctor.tiny_model(arch, attention="eager" if upstream_bug(arch) else None)
    return _models[arch]


def random_rows(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, doctor.VOCAB, (n,), generator=generator).tolist() for n in lengths]


def cache_kw(model: Any) -> str:
    return doctor.cache_kwarg(model)


def signature(model: Any, arch: str) -> Signature:
    """What the installed release's base-model forward takes (GPT2Model, LlamaModel, ...)."""
    return read_signature(engine._registry[arch], type(model.base_model).forward)
