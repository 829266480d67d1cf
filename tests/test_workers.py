"""``hfpatch.workers``: the runtime_env that makes Ray workers apply hfpatch keeps everything the user
set, puts hfpatch's setup hook before a hook of theirs, carries the driver's ``HFPATCH_*`` variables,
and is what ``hfpatch run`` names in Ray's ``RAY_RUNTIME_ENV_HOOK``. Real Ray workers, stock vs
hfpatch against the unpadded reference: tests/integrations/test_ray.py."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import hfpatch
from hfpatch import engine, workers
from hfpatch.launcher import RAY_RUNTIME_ENV_HOOK

THEIRS = {"env_vars": {"PYTHONPATH": "/theirs", "HFPATCH_ARCHS": "llama"}, "working_dir": "."}


@pytest.fixture
def fresh_record(monkeypatch):
    """Leave this process's ``applied_by`` as it was, whatever the setup hook records here."""
    monkeypatch.setattr(engine, "_applied_by", [])
    monkeypatch.delenv("HFPATCH_ARCHS", raising=False)
    monkeypatch.delenv("HFPATCH_DISABLED", raising=False)


def test_runtime_env_keeps_theirs_and_adds_the_hook(fresh_record, monkeypatch):
    monkeypatch.setenv("HFPATCH_ARCHS", "gpt2")
    monkeypatch.setenv("HFPATCH_DISABLED", "0")
    merged = workers.ray_runtime_env(THEIRS)
    assert merged == {
        "env_vars": {"PYTHONPATH": "/theirs", "HFPATCH_ARCHS": "llama", "HFPATCH_DISABLED": "0"},
        "working_dir": ".",
        "worker_process_setup_hook": workers.SETUP_HOOK,
    }  # theirs win over the driver's HFPATCH_ARCHS
    assert THEIRS["env_vars"] == {"PYTHONPATH": "/theirs", "HFPATCH_ARCHS": "llama"}, "not changed in place"
    assert workers.ray_runtime_env(merged) == merged, "idempotent"
    assert workers.ray_runtime_env(None) == {
        "env_vars": {"HFPATCH_ARCHS": "gpt2", "HFPATCH_DISABLED": "0"},
        "worker_process_setup_hook": workers.SETUP_HOOK,
    }


def test_the_hook_ray_runs_in_workers_and_the_one_hfpatch_run_names(fresh_record):
    module, _, name = workers.SETUP_HOOK.rpartition(".")
    getattr(importlib.import_module(module), name)()  # as Ray runs a worker_process_setup_hook
    assert hfpatch.status().applied_by == f"the Ray worker setup hook (process {os.getpid()})"
    module, _, name = RAY_RUNTIME_ENV_HOOK.rpartition(".")
    assert getattr(importlib.import_module(module), name) is workers.ray_runtime_env


@pytest.mark.parametrize("theirs", ["os.getcwd", "callable"])
def test_their_own_setup_hook_runs_after_hfpatchs(fresh_record, theirs):
    seen = []
    hook = (lambda: seen.append(hfpatch.status().applied_by)) if theirs == "callable" else theirs
    chained = workers.ray_runtime_env({"worker_process_setup_hook": hook})["worker_process_setup_hook"]
    assert callable(chained) and workers.SETUP_HOOK in chained.__name__
    assert (
        workers.ray_runtime_env({"worker_process_setup_hook": chained})["worker_process_setup_hook"]
        is chained
    )
    chained()
    assert hfpatch.status().applied_by.startswith("the Ray worker setup hook")
    assert seen == ([hfpatch.status().applied_by] if theirs == "callable" else [])


def test_a_runtime_env_ray_has_processed_is_left_as_it_is(fresh_record):
    processed = {"env_vars": {workers._RAY_RESERVED: "their.hook"}, "worker_process_setup_hook": "their.hook"}
    assert workers.ray_runtime_env(processed) == processed  # Ray refuses a second, different hook


def test_bad_input_is_one_line():
    with pytest.raises(TypeError, match=r"^runtime_env: expected a dict or None, got str$"):
        workers.ray_runtime_env("hfpatch.workers.setup")
    with pytest.raises(ValueError, match=r"^HFPATCH_ARCHS=qwen: .*qwen2") as raised:  # in the driver, once
        workers.ray_runtime_env({"env_vars": {"HFPATCH_ARCHS": "qwen"}})
    assert "\n" not in str(raised.value)


def test_a_ray_runtime_env_object_is_merged():
    runtime_env = pytest.importorskip("ray.runtime_env")
    merged = workers.ray_runtime_env(runtime_env.RuntimeEnv(env_vars={"THEIRS": "kept"}))
    assert merged["env_vars"]["THEIRS"] == "kept"
    assert merged["worker_process_setup_hook"] == workers.SETUP_HOOK


def test_ray_applied_by_needs_a_connected_driver():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is open in this process")
    with pytest.raises(RuntimeError, match="call ray.init"):
        workers.ray_applied_by()


def test_hfpatch_workers_after_import_hfpatch():
    code = "import hfpatch; print(hfpatch.workers.ray_runtime_env()['worker_process_setup_hook'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == [workers.SETUP_HOOK], done.stderr[-2000:]


def test_runtime_env_carries_the_shadow_rate_and_the_audit_folder(fresh_record, monkeypatch, tmp_path):
    """Ray workers of `hfpatch audit` and of HFPATCH_SHADOW get the driver's variables (theirs win)."""
    monkeypatch.setenv("HFPATCH_SHADOW", "0.5")
    monkeypatch.setenv("HFPATCH_AUDIT", str(tmp_path))
    env_vars = workers.ray_runtime_env(None)["env_vars"]
    assert env_vars == {"HFPATCH_SHADOW": "0.5", "HFPATCH_AUDIT": str(tmp_path)}
    ours = workers.ray_runtime_env({"env_vars": {"HFPATCH_SHADOW": "0.01"}})["env_vars"]
    assert ours["HFPATCH_SHADOW"] == "0.01"
    with pytest.raises(ValueError, match=r"^HFPATCH_SHADOW=lots: expected a share of calls"):
        workers.ray_runtime_env({"env_vars": {"HFPATCH_SHADOW": "lots"}})
