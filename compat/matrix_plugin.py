"""The release matrix's test selection, a pytest plugin (``-p compat.matrix_plugin``): the split of
``compat/matrix.py`` applied to the collected tests.

    --matrix-part=probe    the tests that take the ``probe`` fixture (run with --outside-ranges)
    --matrix-part=release  every other test, but those that run on SAMPLE only (matrix.runs_once)
    --matrix-part=sample   every other test (a SAMPLE release: the whole suite)
    --matrix-part=once     only those that run on SAMPLE only (to time them)

Deselected tests are reported as deselected, not skipped: the evidence holds only what ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from compat.matrix import ROOT, runs_once

PARTS = ("probe", "release", "sample", "once")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--matrix-part", choices=PARTS, help="the part of the release matrix to run")


def _nodeid(item: pytest.Item) -> str:
    """``item``'s node id from the repository root (whatever the rootdir)."""
    path = Path(str(item.path)).resolve()
    relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else item.nodeid
    return relative + item.nodeid[item.nodeid.index("::") :] if "::" in item.nodeid else relative


def selected(item: pytest.Item, part: str) -> bool:
    """Whether the matrix's ``part`` runs ``item``."""
    probe = "probe" in getattr(item, "fixturenames", ())
    if part == "probe":
        return probe
    if probe:
        return False
    if part == "sample":
        return True
    once = runs_once(_nodeid(item), {mark.name for mark in item.iter_markers()})
    return once if part == "once" else not once


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = config.getoption("--matrix-part")
    if not part:
        return
    keep, drop = [], []
    for item in items:
        (keep if selected(item, part) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
