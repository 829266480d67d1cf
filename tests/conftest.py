"""Shared fixtures: tiny random models of the flagship model types, stock/patched switching, release
facts read from the declarations or from what stock transformers does.

Every test runs on whatever transformers release is installed; a test that cannot apply to it skips
with the release fact that says why (docs/compatibility.md lists them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, settings
from probes import Probe

import hfpatch
from compat.vocabulary import ABSENT, CLASS_DIFFERS, FLAGSHIPS, OUTSIDE
from hfpatch import _context, engine
from hfpatch._compat import attaches_static_caches
from hfpatch.plans import Plan, read_plan
from hfpatch.support import installed_transformers, release_has, support
from hfpatch.verification.tiny import tiny_model

from costs import make_dynamic_cache  # noqa: F401 (the tests' import of it)
from harness import cache_kwarg, static_cache

settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# the release matrix (nox -s matrix, pytest --hypothesis-profile=matrix): 64 releases, fewer examples each
settings.register_profile("matrix", parent=settings.get_profile("default"), max_examples=8)
settings.load_profile("default")

TF = installed_transformers()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--outside-ranges",
        action="store_true",
        help="probe every covered model type the release ships, in its declared range or not, as if it were "
        "(compat/probe_matrix.sh: the evidence that sets the ranges)",
    )


REGISTRY = hfpatch.registry()
# the mappings whose model types status() lists besides the decoder-only ones: their decoders (and
# encoders), or why they are not patched (hfpatch/adapters/seq2seq.py)
SEQ2SEQ_MAPPINGS = (
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
)


def _seq2seq_model_types() -> dict[str, str]:
    """Model type -> its class, in the three mappings of the installed release (first mapping wins)."""
    from transformers.models.auto import modeling_auto

    types: dict[str, str] = {}
    for name in SEQ2SEQ_MAPPINGS:
        for model_type, cls in getattr(modeling_auto, name, {}).items():
            types.setdefault(model_type, cls)
    return types


SEQ2SEQ_MODEL_TYPES = _seq2seq_model_types()
MULTIPLE_CHOICE = {"gpt2": "GPT2DoubleHeadsModel"}  # [batch, choices, tokens] inputs, left to stock


def arch_skip_reason(arch: str) -> str | None:
    """Why ``arch`` cannot be tested here: absent from this release (a fact), or outside its range."""
    adapter = REGISTRY[arch]
    if not release_has(adapter):
        return f"{adapter.cls} is not in transformers {TF} (no {adapter.module})"
    verdict = support(adapter, TF)
    return None if verdict.patchable else verdict.reason


OUTSIDE_RANGES: list[bool] = []  # [True] under --outside-ranges (pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--outside-ranges"):
        OUTSIDE_RANGES.append(True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A full-suite test's column in compat/REPORT.md (its ``invariant`` marker), as a JUnit property."""
    for item in items:
        marker = item.get_closest_marker("invariant")
        if marker is not None:
            item.user_properties.append(("invariant", marker.args[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or report.outcome != "passed":
        item._probe_report = report  # type: ignore[attr-defined]  (read by the probe fixture's teardown)


@pytest.fixture
def probe(request: pytest.FixtureRequest) -> Iterator[Probe]:
    """The verdict of a release-probe test (tests/probes.py), recorded for compat/evidence.py."""
    found = Probe(request.node)
    yield found
    found.close(getattr(request.node, "_probe_report", None))


_PROBING: set[str] = set()  # the adapters this test patches outside their ranges (require_covered)


@pytest.fixture(autouse=True)
def _probing_ends() -> Iterator[None]:
    yield
    if _PROBING:  # patched with ignore_ranges=True for the test: back to what the declarations say
        hfpatch.revert(sorted(_PROBING))
        _PROBING.clear()


def probed_here(arch: str) -> bool:
    """Whether ``arch`` runs patched in this test: in its range, or anywhere the release ships its class
    under ``--outside-ranges``."""
    return arch_skip_reason(arch) is None or bool(OUTSIDE_RANGES and release_has(REGISTRY[arch]))


def require_covered(arch: str, probe: Optional[Probe] = None) -> None:
    """Skip unless ``arch`` runs patched on this release (:func:`probed_here`). Under ``--outside-ranges``
    (the release probe: the evidence for the ranges), an adapter outside its range is patched for this
    test with the switch users have for it, ``apply(arch, ignore_ranges=True)``: one adapter at a time,
    so that one that cannot install on a release fails its own tests only. ``probe``: the test's record
    (absent, outside, or a class hfpatch cannot patch here)."""
    if not probed_here(arch):
        if probe is not None:
            probe.found(ABSENT if not release_has(REGISTRY[arch]) else OUTSIDE)
        pytest.skip(arch_skip_reason(arch))
    if arch_skip_reason(arch) is not None:
        _PROBING.add(arch)
        hfpatch.apply(arch, ignore_ranges=True)
    importlib.import_module(REGISTRY[arch].module)  # installed now, or found to be another class
    entry = hfpatch.status()[arch]
    if entry.state == "skipped":  # the release's class is not the one the adapter patches
        if probe is not None:
            probe.found(CLASS_DIFFERS)
        pytest.fail(f"{arch}: hfpatch cannot patch {entry.target} here: {entry.reason}")


@functools.cache
def _accepts(model_id: int, kind: str) -> str | None:
    """None if the model takes a cache object of ``kind`` as its cache argument, else why not."""
    model = _by_id[model_id]
    import transformers

    if kind == "static":
        if not hasattr(transformers, "StaticCache"):
            return f"StaticCache first shipped in 4.38 (installed: {TF})"
        if attaches_static_caches(model):
            return f"a StaticCache object as the cache argument needs 4.41+ (installed: {TF})"
    elif not hasattr(transformers, "DynamicCache"):
        return f"Cache objects first shipped in 4.36 (installed: {TF})"
    try:
        cache = static_cache(model, 1, 8) if kind == "static" else make_dynamic_cache(model)
        with stock(), torch.no_grad():
            model(input_ids=torch.tensor([[5, 6]]), use_cache=True, **{cache_kwarg(model): cache})
    except Exception as exc:  # noqa: BLE001 - what stock transformers says is the fact to report
        name = type(model.base_model).__name__
        return f"{name} takes no {kind} Cache object in transformers {TF}: {exc}"[:300]
    return None


_by_id: dict[int, Any] = {}


def cache_object_skip_reason(model: Any, kind: str) -> str | None:
    """Why ``model`` takes no ``kind`` ("dynamic" or "static") cache object on this release (GPT-2 takes
    Cache objects from 4.52, Llama from 4.36), read from what stock transformers does."""
    _by_id[id(model)] = model
    return _accepts(id(model), kind)


def static_cache_skip_reason(model: Any) -> str | None:
    return cache_object_skip_reason(model, "static")


@pytest.fixture(autouse=True)
def _applied() -> Iterator[None]:
    """Every test starts with hfpatch applied and leaves it applied."""
    hfpatch.apply()
    yield
    hfpatch.apply()


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warnings hfpatch gives once per process, given again in this test (and forgotten after it)."""
    monkeypatch.setattr(_context, "WARNED", set())


def stock() -> contextlib.AbstractContextManager:
    """Run a block on unpatched transformers, in this thread (eager calls)."""
    return hfpatch.unpatched()


@contextlib.contextmanager
def reverted() -> Iterator[None]:
    """Stock transformers for the whole process, compiled code included (``torch.compile`` traces
    whatever the class's forward is): revert() for the block, apply() after it."""
    hfpatch.revert()
    try:
        yield
    finally:
        hfpatch.apply()


@contextlib.contextmanager
def spying(model: Any) -> Iterator[list[dict[str, Any]]]:
    """Record the keyword arguments the original (unpatched) base-model forward receives."""
    owner = type(model.base_model)
    arch = engine.adapter_for(model.config.model_type).arch
    seen: list[dict[str, Any]] = []
    hfpatch.revert(arch)
    original = owner.__dict__["forward"]

    @functools.wraps(original)
    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(self, *args, **kwargs)

    owner.forward = spy
    try:
        hfpatch.apply(arch)  # patches the spy
        yield seen
    finally:
        hfpatch.revert(arch)
        owner.forward = original
        hfpatch.apply(arch)


_models: dict[str, Any] = {}


@pytest.fixture(params=FLAGSHIPS)
def arch(request: pytest.FixtureRequest) -> str:
    request.node.user_properties.append(("arch", request.param))  # compat/REPORT.md's column
    reason = arch_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def adapter(arch: str) -> Any:
    return REGISTRY[arch]


@pytest.fixture
def model(arch: str) -> Any:
    """The tiny model of ``arch``, built once per session."""
    if arch not in _models:
        _models[arch] = tiny_model(arch)
    return _models[arch]


def plan(model: Any) -> Plan:
    """What the installed release's base-model forward takes (GPT2Model, LlamaModel, ...)."""
    owner = type(model.base_model)
    return read_plan(engine.adapter_for(model.config.model_type), owner.forward, owner)
