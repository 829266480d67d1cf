"""pytest plugin for runs (b) and (c) only: records, per test id, how many calls hfpatch ran unpadded
and why others stayed padded (deltas of hfpatch.status().unpadded), and the adapters' states at the
start and end of the session.  Reads status only; changes nothing.  Output: $HFPATCH_RECORD (JSONL).
"""

import json
import os

import pytest

_OUT = os.environ.get("HFPATCH_RECORD")


def _snap():
    import hfpatch

    u = hfpatch.status().unpadded
    return int(u.get("calls", 0)), dict(u.get("padded", {}))


def _write(obj):
    if _OUT:
        with open(_OUT, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(obj, default=str) + "\n")


def _states():
    import hfpatch

    st = hfpatch.status()
    return {
        "applied_by": st.applied_by,
        "transformers": st.transformers,
        "unpad_on": st.unpadded.get("on"),
        "states": {k: str(getattr(v, "state", v)) for k, v in st.items()},
    }


def pytest_sessionstart(session):
    _write({"event": "start", **_states()})


def pytest_sessionfinish(session, exitstatus):
    _write({"event": "end", **_states()})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, p0 = _snap()
    yield
    c1, p1 = _snap()
    pad = {k: v - p0.get(k, 0) for k, v in p1.items() if v - p0.get(k, 0)}
    if c1 - c0 or pad:
        _write({"id": item.nodeid, "unpadded_calls": c1 - c0, "padded": pad})
