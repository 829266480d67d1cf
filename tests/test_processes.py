"""Every process: ``hfpatch run -- CMD`` applies hfpatch at interpreter start in CMD and every Python
process it starts (a spawned child, DataLoader workers with the spawn start method, torchrun ranks);
without the launcher, and without ``apply()`` in the worker, those processes run stock transformers.
Each worker measures its own padded forward against the unpadded reference."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from compat.vocabulary import FLAGSHIPS
from hfpatch.launcher import RAY_RUNTIME_ENV_HOOK

from conftest import arch_skip_reason
from expectations import ABSOLUTE
from harness import TOLERANCE, WRONG, worker_script

pytestmark = pytest.mark.slow  # processes start Python and torch again: nox -s integrations runs them

ARCH = ABSOLUTE

MEASURE = worker_script(ARCH)

SCRIPTS = {
    "spawn": """
import json, multiprocessing as mp

def child(queue):
    queue.put(measure())

if __name__ == "__main__":
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    print(json.dumps([queue.get()]))
    process.join()
""",
    "dataloader": """
import json, torch

class Workers(torch.utils.data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, index):
        return json.dumps(measure())

if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(
        Workers(), batch_size=None, num_workers=2, multiprocessing_context="spawn"
    )
    print(json.dumps([json.loads(item) for item in loader]))
""",
    "torchrun": """
import json, os, sys, torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, measure())
    if dist.get_rank() == 0:
        print(json.dumps(results))
    dist.barrier()  # every rank done; then out without gloo's teardown, which can abort a rank under load
    sys.stdout.flush()
    os._exit(0)
""",
}


def _run(tmp_path, kind, launcher):
    reason = arch_skip_reason(ARCH)
    if reason:
        pytest.skip(reason)
    script = tmp_path / f"{kind}.py"
    script.write_text(MEASURE + textwrap.dedent(SCRIPTS[kind]))
    if kind == "torchrun":
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
        if torchrun is None:
            pytest.skip("no torchrun next to this Python")
        command = [torchrun, "--standalone", "--nproc_per_node=2", str(script)]
    else:
        command = [sys.executable, str(script)]
    if launcher:  # True: hfpatch run; a list: that hfpatch command and its options
        verb = ["run"] if launcher is True else launcher
        command = [sys.executable, "-m", "hfpatch", *verb, "--", *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_launcher_patches_every_process(tmp_path, kind):
    results = _run(tmp_path, kind, launcher=True)
    assert len(results) == (1 if kind == "spawn" else 2) and len({r["pid"] for r in results}) == len(results)
    for result in results:
        assert result["error"] <= TOLERANCE, result
        assert "hfpatch run launcher" in result["applied_by"], result


@pytest.mark.parametrize("kind", ["spawn", "dataloader"])
def test_without_the_launcher_workers_run_stock(tmp_path, kind):
    for result in _run(tmp_path, kind, launcher=False):
        assert result["error"] > WRONG and result["applied_by"] == "", result


def test_hfpatch_auto_and_environment(tmp_path):
    """``import hfpatch.auto`` applies in code; HFPATCH_ARCHS chooses adapters; HFPATCH_DISABLED stops it."""
    code = "import hfpatch.auto, hfpatch, json; s = hfpatch.status(); "
    code += f"print(json.dumps([s.applied_by, s[{ARCH!r}].state, s[{FLAGSHIPS[0]!r}].state]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}

    def state(**extra):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**env, **extra}
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    how, own, first = state()
    assert how == "import hfpatch.auto" and own != "not applied"
    how, own, _ = state(HFPATCH_ARCHS=ARCH)
    assert how.endswith(f"HFPATCH_ARCHS={ARCH}") and own != "not applied"
    assert state(HFPATCH_DISABLED="1")[:2] == ["", "not applied"]


def test_launcher_chains_an_existing_sitecustomize(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['THEIRS'] = 'ran'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    code = "import os, hfpatch; print(os.environ.get('THEIRS'), bool(hfpatch.status().applied_by))"
    done = subprocess.run(
        [sys.executable, "-m", "hfpatch", "run", "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ran", "True"]


def test_launcher_from_a_checkout_that_is_not_installed(tmp_path):
    """``python path/to/checkout/hfpatch run -- python script.py`` from another folder, in a virtual
    environment that has torch and transformers but not hfpatch, and no PYTHONPATH: the launcher puts
    the checkout on the child's path, and the child is patched."""
    reason = arch_skip_reason(ARCH)
    if reason:
        pytest.skip(reason)
    checkout = Path(__file__).resolve().parents[1]  # this test's own checkout, whatever is installed
    farm = tmp_path / "packages"  # this environment's packages, hfpatch left out
    farm.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("hfpatch", "__editable__", "_hfpatch")):
            (farm / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "packages.pth").write_text(str(farm) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HFPATCH_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1")
    (tmp_path / "elsewhere").mkdir()
    bare = subprocess.run(
        [str(python), "-c", "import hfpatch"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path / "elsewhere",
    )
    assert "No module named 'hfpatch'" in bare.stderr, "hfpatch must not be importable in that environment"
    # the launcher's sitecustomize alone, hfpatch out of reach: a warning, and Ray not sent to hfpatch
    code = "import os; print(os.environ.get('RAY_RUNTIME_ENV_HOOK'))"
    lost = {
        **env,
        "PYTHONPATH": str(checkout / "hfpatch" / "bootstrap"),
        "RAY_RUNTIME_ENV_HOOK": RAY_RUNTIME_ENV_HOOK,
    }
    lost = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, env=lost, cwd=tmp_path / "elsewhere"
    )
    assert lost.stdout.split() == ["None"] and "not applied in this process" in lost.stderr, lost
    script = tmp_path / "elsewhere" / "child.py"
    script.write_text(MEASURE + "import json\nprint(json.dumps(measure()))\n")
    done = subprocess.run(
        [str(python), str(checkout / "hfpatch"), "run", "--", "python", str(script)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path / "elsewhere",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] <= TOLERANCE and "hfpatch run launcher" in result["applied_by"], result


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_audit_counts_every_process_and_leaves_them_stock(tmp_path, kind):
    """``hfpatch audit``: every worker runs stock (its padded cached call is wrong, as without the
    launcher), and the counts of all processes are added up: three calls each, the continued prefix
    the one stock gets wrong."""
    results = _run(tmp_path, kind, launcher=["audit", "--json", str(tmp_path / "audit.json")])
    counted = json.loads((tmp_path / "audit.json").read_text())[ARCH]
    assert counted["calls"] == 3 * len(results) and counted["affected"] == len(results), counted
    for result in results:
        assert result["error"] > WRONG and "hfpatch audit" in result["applied_by"], result
