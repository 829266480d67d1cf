"""Ray workers, with real Ray: a cluster started by ``ray.init()`` inside a launched driver, and one
started elsewhere (``ray start --head``) that drivers connect to. Each worker measures its own padded
forward against the unpadded reference: stock is wrong; with the launcher (which makes every
``ray.init()`` add hfpatch's ``worker_process_setup_hook`` to the runtime_env, keeping the user's) or
with ``hfpatch.workers.ray_runtime_env()`` by hand, every worker is exact, a task with a ``PYTHONPATH``
of its own included."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import arch_skip_reason
from expectations import ABSOLUTE
from harness import TOLERANCE, WRONG, worker_script

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray cluster and its workers start Python and torch: nox runs these

ARCH = ABSOLUTE

DRIVER = """
import json, os, sys
import ray
import hfpatch.workers

ADDRESS, MODE, THEIR_PATH = sys.argv[1:]  # ADDRESS "local": ray.init() starts a cluster here
THEIRS = {"env_vars": {"THEIRS": "kept"}}  # the user's own runtime_env

@ray.remote
def worker():
    return dict(measure(), theirs=[os.environ.get("THEIRS"), os.environ.get("THEIR_HOOK")])

def their_hook():  # the user's own worker_process_setup_hook: runs too, after hfpatch's
    os.environ["THEIR_HOOK"] = "ran"

def session(runtime_env):
    where = dict(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20)
    where = where if ADDRESS == "local" else dict(address=ADDRESS)
    ray.init(**where, runtime_env=runtime_env, log_to_driver=False)
    try:
        own = {"env_vars": {"PYTHONPATH": THEIR_PATH}}  # a task's own PYTHONPATH: not the launcher's
        results = {"job": worker.remote(), "own PYTHONPATH": worker.options(runtime_env=own).remote()}
        if MODE == "launched":  # the same worker with hfpatch switched off: stock
            results["disabled"] = worker.options(runtime_env={"env_vars": {"HFPATCH_DISABLED": "1"}}).remote()
        results = {name: ray.get(ref) for name, ref in results.items()}
        return {"workers": results, "nodes": list(hfpatch.workers.ray_applied_by().values())}
    finally:
        ray.shutdown()

if MODE == "launched":  # under hfpatch run: the user's runtime_env, as they wrote it
    sessions = {"launched": session(dict(THEIRS, worker_process_setup_hook=their_hook))}
else:  # no launcher: stock, then hfpatch.workers.ray_runtime_env() by hand
    sessions = {"stock": session(None), "by hand": session(hfpatch.workers.ray_runtime_env(THEIRS))}
print(json.dumps(sessions))
"""


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HFPATCH_", "RAY_"))}
    # no token file written to ~/.ray, no usage report: neither changes what workers run
    env.update(OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


def _drive(tmp_path, address: str, launched: bool, **extra: str) -> dict:
    if arch_skip_reason(ARCH):
        pytest.skip(arch_skip_reason(ARCH))
    script = tmp_path / "driver.py"
    script.write_text(worker_script(ARCH) + DRIVER)
    (tmp_path / "theirs").mkdir(exist_ok=True)
    command = [
        sys.executable,
        str(script),
        address,
        "launched" if launched else "plain",
        str(tmp_path / "theirs"),
    ]
    if launched:  # True: hfpatch run; a list: that hfpatch command and its options
        command = [
            sys.executable,
            "-m",
            "hfpatch",
            *(["run"] if launched is True else launched),
            "--",
            *command,
        ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=_env(**extra), cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _exact(session: dict, how: str = "the Ray worker setup hook", hook: str | None = "ran") -> None:
    for name, result in session["workers"].items():
        if name != "disabled":
            assert result["error"] <= TOLERANCE and how in result["applied_by"], (name, result)
            assert result["theirs"] == ["kept", hook], ("the user's runtime_env is kept", name, result)
    assert session["nodes"] and all(how in applied for applied in session["nodes"]), session["nodes"]


def test_ray_cluster_started_in_the_launched_driver(tmp_path):
    session = _drive(tmp_path, "local", launched=True)["launched"]
    _exact(session)
    assert "hfpatch run launcher" in session["workers"]["job"]["applied_by"]  # its PYTHONPATH: both
    assert "hfpatch run launcher" not in session["workers"]["own PYTHONPATH"]["applied_by"]
    disabled = session["workers"]["disabled"]
    assert disabled["error"] > WRONG and disabled["applied_by"] == "", disabled


def test_ray_workers_under_hfpatch_audit_run_stock_and_are_counted(tmp_path):
    """``hfpatch audit``: each worker (the job's, and the one with a PYTHONPATH of its own, reached by
    the setup hook) runs stock and writes its counts: three calls each, the continued prefix wrong."""
    report = tmp_path / "audit.json"
    session = _drive(tmp_path, "local", launched=["audit", "--json", str(report)])["launched"]
    for name in ("job", "own PYTHONPATH"):
        worker = session["workers"][name]
        assert worker["error"] > WRONG and "hfpatch audit" in worker["applied_by"], (name, worker)
    counted = json.loads(report.read_text())[ARCH]
    assert counted["calls"] == 6 and counted["affected"] == 2, counted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster():
    with ray_head() as address:
        yield address


@contextlib.contextmanager
def ray_head():
    """``ray start --head`` outside any launcher, in a session of its own (own temp dir and ports),
    torn down whatever happens: every process of that session, Ray's workers included."""
    temp = tempfile.mkdtemp(prefix="hfpatch-ray-", dir="/tmp")  # Ray's socket paths must stay short
    port = _free_port()
    ports = [f"--{name}={_free_port()}" for name in ("ray-client-server-port", "dashboard-port")]
    ports.append(f"--dashboard-agent-listen-port={_free_port()}")
    options = ["--num-cpus=1", "--include-dashboard=false", "--object-store-memory=83886080"]
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
    command += [f"--port={port}", f"--temp-dir={temp}", "--disable-usage-stats", *options, *ports]
    log = open(os.path.join(temp, "ray-start.log"), "w")  # noqa: SIM115 - closed below
    head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        probe = f"import ray; ray.init(address='127.0.0.1:{port}', log_to_driver=False); ray.shutdown()"
        for _ in range(90):
            if head.poll() is not None:
                break
            if subprocess.run([sys.executable, "-c", probe], capture_output=True, env=_env()).returncode == 0:
                break
            time.sleep(1)
        assert head.poll() is None, open(log.name).read()[-3000:]
        yield f"127.0.0.1:{port}"
    finally:
        _end_session(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _end_session(head: subprocess.Popen) -> None:
    """SIGTERM the ``ray start`` process group, then SIGKILL whatever of its session is left."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            if os.getsid(pid) == head.pid:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    head.wait(10)


def test_ray_cluster_started_elsewhere(tmp_path, cluster):
    plain = _drive(tmp_path, cluster, launched=False)
    for result in plain["stock"]["workers"].values():  # no launcher, no hook: silently stock
        assert result["error"] > WRONG and result["applied_by"] == "", result
    assert plain["stock"]["nodes"] == [""]
    _exact(plain["by hand"], hook=None)
    launched = _drive(tmp_path, cluster, launched=True, HFPATCH_ARCHS=ARCH)["launched"]
    _exact(launched, f"), HFPATCH_ARCHS={ARCH}")  # the driver's HFPATCH_* reach the workers
    disabled = launched["workers"]["disabled"]
    assert disabled["error"] > WRONG and disabled["applied_by"] == "", disabled
