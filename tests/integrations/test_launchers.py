"""``accelerate launch`` and DeepSpeed's ``deepspeed`` launcher, for real, on CPU (gloo, 2 ranks): under
``hfpatch run`` every rank is exact; without it every rank runs stock transformers. Each rank measures
its own padded forward against the unpadded reference."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import arch_skip_reason
from expectations import ABSOLUTE
from harness import TOLERANCE, WRONG, worker_script

pytestmark = pytest.mark.slow  # two ranks start Python and torch again: nox -s integrations runs them

ARCH = ABSOLUTE

RANKS = """
import json, os, torch.distributed as dist

if __name__ == "__main__":  # the launcher sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("gloo")
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, measure())
    if dist.get_rank() == 0:
        print("RANKS", json.dumps(results), flush=True)  # DeepSpeed's launcher logs to stdout too
    dist.barrier()  # every rank done; then out without gloo's teardown, which can abort a rank under load
    os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(launcher: str, script: str) -> list[str]:
    package = {"accelerate": "accelerate", "deepspeed": "deepspeed"}[launcher]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    program = shutil.which(launcher, path=os.path.dirname(sys.executable))
    if program is None:
        pytest.skip(f"no {launcher} command next to this Python")
    port = str(_free_port())
    if launcher == "accelerate":  # --multi_gpu without a GPU: torchrun's ranks on CPU, gloo
        options = ["--multi_gpu", "--num_processes=2", "--num_machines=1", "--mixed_precision=no"]
        return [program, "launch", *options, "--dynamo_backend=no", f"--main_process_port={port}", script]
    return [program, "--num_gpus=2", f"--master_port={port}", script]  # DeepSpeed's CPU accelerator


@pytest.mark.parametrize("launched", [True, False], ids=["hfpatch run", "stock"])
@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_launcher_ranks(tmp_path, launcher, launched):
    if arch_skip_reason(ARCH):
        pytest.skip(arch_skip_reason(ARCH))
    script = tmp_path / "ranks.py"
    script.write_text(worker_script(ARCH) + RANKS)
    command = _command(launcher, str(script))
    if launched:
        command = [sys.executable, "-m", "hfpatch", "run", "--", *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))  # no accelerate config of the user's
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(next(line[6:] for line in done.stdout.splitlines() if line.startswith("RANKS ")))
    assert len(results) == 2 and len({r["pid"] for r in results}) == 2, results
    for result in results:
        if launched:
            assert result["error"] <= TOLERANCE and "hfpatch run launcher" in result["applied_by"], result
        else:
            assert result["error"] > WRONG and result["applied_by"] == "", result
