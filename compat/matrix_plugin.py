"""The release matrix's test selection, a pytest plugin (``-p compat.matrix_plugin``): the split of
``compat/matrix.py`` applied to the collected tests.

    --matrix-part=probe    the tests that take the ``probe`` fixture (run with --outside-ranges), but
                           those that run on SAMPLE only (matrix.probe_runs_once)
    --matrix-part=suite    every other test, but those that run on SAMPLE only (matrix.runs_once)
    --matrix-sample        a SAMPLE release: none left out (the whole suite, the whole probe)
    --matrix-part=once     the suite's tests that run on SAMPLE only, alone (to time them)

Deselected tests are reported as deselected, not skipped: the evidence holds only what ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from compat.matrix import ROOT, probe_runs_once, runs_once

PARTS = ("probe", "suite", "once")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--matrix-part", choices=PARTS, help="the part of the release matrix to run")
    parser.addoption("--matrix-sample", action="store_true", help="a SAMPLE release: nothing left out")


def _nodeid(item: pytest.Item) -> str:
    """``item``'s node id from the repository root (whatever the rootdir)."""
    path = Path(str(item.path)).resolve()
    relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else item.nodeid
    return relative + item.nodeid[item.nodeid.index("::") :] if "::" in item.nodeid else relative


def selected(item: pytest.Item, part: str, sample: bool = False, release: str = "") -> bool:
    """Whether the matrix's ``part`` runs ``item`` on ``release`` (a SAMPLE release: ``sample``)."""
    probe = "probe" in getattr(item, "fixturenames", ())
    if part == "probe":
        return probe and (sample or not probe_runs_once(_nodeid(item), release))
    if probe:
        return False
    once = runs_once(_nodeid(item), {mark.name for mark in item.iter_markers()})
    return once if part == "once" else sample or not once


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = config.getoption("--matrix-part")
    if not part:
        return
    import transformers

    keep, drop = [], []
    sample = config.getoption("--matrix-sample")
    for item in items:
        (keep if selected(item, part, sample, transformers.__version__) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
