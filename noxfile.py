"""The release matrix and the heavier checks, as nox sessions (the release facts: compat/matrix.py).

    nox -s matrix                           # every release (hours: see docs/compatibility.md)
    nox -s "matrix(transformers='4.40.2')"  # one release
    nox -s ci                               # the releases CI runs, strict: the whole suite on the
                                            # newest, the quick suite on the others (without the
                                            # launchers' tests, which the integrations session runs;
                                            # the newest release's quick tests neither where
                                            # HFPATCH_QUICK_RAN_ON names it: .ci/run ran them before)
    nox -s corners                          # Python 3.10, 3.13 x torch 2.13 and their newest (CI: newest)
    nox -s integrations                     # peft, trl, accelerate, ray, deepspeed, sentence-transformers,
                                            # processes and launchers (CI runs it)
    nox -s wheel                            # the built wheel, installed as users install it (CI runs it)
    nox -s newest                           # the registry's newest transformers (or NEWEST=X.Y.Z): the
                                            # matrix on it with the whole suite, and what differs from
                                            # the newest tested release (compat/newest.py)
    python compat/report.py                 # compat/evidence/ -> compat/REPORT.md

Each matrix session makes (or, with -R, reuses) a virtualenv with torch and that release, installs
hfpatch from the checkout and runs ``python compat/matrix.py run RELEASE``: the probe, the test suite as
compat/matrix.py splits it (the mechanics on its SAMPLE releases only), the stock-vs-hfpatch case count
(JUnit XML into compat/results/, not committed), and compat/evidence/RELEASE.json rebuilt from them at
the checkout's commit ("-dirty" when it has uncommitted changes). The whole matrix at one commit, in
less time (one shared torch): bash compat/one_commit.sh.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
RESULTS = ROOT / "compat" / "results"
sys.path.insert(0, str(ROOT / "compat"))

from matrix import CI_RELEASES, NEWEST, RELEASES, TEST_DEPENDENCIES, TORCH, install_steps  # noqa: E402

nox.options.sessions = ["matrix"]
nox.options.error_on_missing_interpreters = True
# the Pythons the corners need, where pyenv keeps them (this project's machines): after PATH's own
for _bin in sorted(Path.home().glob(".pyenv/versions/3.1[0-9].*/bin")):
    os.environ["PATH"] += os.pathsep + str(_bin)
# the corners of the axes a user has besides transformers (Python, torch), each with the newest
# transformers that Python installs (5.21+ need Python 3.11) and the newest torch it has (2.15 needs
# 3.11 too): the oldest Python on the oldest torch and on its newest, the newest Python on both (CI runs
# the newest of all). torch from the registry is its CUDA build; PIP_CONSTRAINT=/dev/null lifts this
# machine's cap on torch (2.14.1) for that install
CORNERS = [
    ("3.10", "2.13.0", "5.20.2"),
    ("3.10", "2.14.1", "5.20.2"),
    ("3.13", "2.13.0", "5.25.0"),
    ("3.13", "2.15.0", "5.25.0"),
]
# current releases, next to the newest transformers
INTEGRATIONS = ["peft", "trl", "accelerate", "ray[default]", "deepspeed", "sentence-transformers"]


def _free_disk(session: nox.Session) -> None:
    """Under CI, drop a finished session's virtualenv (torch and its kin are >1 GB each): the CI
    machine's disk holds one at a time, not the eight a full CI run creates."""
    if os.environ.get("CI") and session.virtualenv.location:
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _run_release(session: nox.Session, release: str, strict: bool) -> None:
    _install(session, release)
    RESULTS.mkdir(parents=True, exist_ok=True)
    session.env.update(OMP_NUM_THREADS="1")
    session.chdir(ROOT)
    if not strict:  # the matrix: the probe, the suite split as compat/matrix.py says, the case count,
        # and compat/evidence/RELEASE.json rebuilt from them at this commit (a failing test is a result)
        session.run("python", "compat/matrix.py", "run", release)
        _free_disk(session)
        return
    # CI (45 minutes on 2 cores): the whole suite on the newest release, slow and inductor tests
    # included; the quick suite on the older CI releases (their slow tests, every covered model type's
    # probe among them, run in the matrix: compat/one_commit.sh, at every change to hfpatch/); what another
    # step of the same run already ran is not rerun; test_compat_report checks the committed report
    # against the declarations: not a per-release test
    marks = "slow or not slow" if release == NEWEST else "not slow and not inductor"
    ignored = ["--ignore=tests/test_compat_report.py"]
    ignored.append("--ignore=tests/test_processes.py")  # the launchers: the integrations session's
    if os.environ.get("HFPATCH_QUICK_RAN_ON") == release:  # .ci/run's quick suite: this very release
        marks = "slow"
    junit = RESULTS / f"{release}.xml"
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks,
        "--hypothesis-profile=default", *ignored, f"--junitxml={junit}", *session.posargs,
    )  # fmt: skip
    _free_disk(session)


def _pip(session: nox.Session, *args: str, **kwargs) -> None:
    """``pip install`` without compiling every installed module to bytecode (torch and transformers:
    about 30 s of CPU a session, most of it for modules no test imports; Python compiles what a test
    imports when it imports it)."""
    session.install("--no-compile", *args, **kwargs)


def _install(session: nox.Session, release: str) -> None:
    """torch (the CPU build: never an unpinned torch), ``release``, the test dependencies, hfpatch."""
    _pip(session, TORCH)
    for step in install_steps(release):
        _pip(session, *step)
    _pip(session, *TEST_DEPENDENCIES)
    _pip(session, "--no-deps", "--force-reinstall", str(ROOT))


@nox.session(reuse_venv=True)
@nox.parametrize("transformers", RELEASES)
def matrix(session: nox.Session, transformers: str) -> None:
    """Test suite + case count on one transformers release."""
    _run_release(session, transformers, strict=False)


@nox.session(reuse_venv=False)
@nox.parametrize("transformers", CI_RELEASES)
def ci(session: nox.Session, transformers: str) -> None:
    """The CI subset of the matrix: fresh virtualenvs, and any failing test fails the session."""
    _run_release(session, transformers, strict=True)


@nox.session(reuse_venv=False)
@nox.parametrize(("python", "torch", "transformers"), CORNERS, ids=[f"py{p}-torch{t}" for p, t, _ in CORNERS])
def corners(session: nox.Session, torch: str, transformers: str) -> None:
    """The quick suite (the README's test command: pytest's defaults) at a corner of Python x torch."""
    _pip(session, f"torch=={torch}", env={"PIP_CONSTRAINT": "/dev/null"})
    _pip(session, f"transformers=={transformers}", *TEST_DEPENDENCIES)
    _pip(session, "--no-deps", "--force-reinstall", str(ROOT))
    session.env.update(OMP_NUM_THREADS="1")  # one torch thread, as every session (CI runs two at once)
    session.run("python", "-c", "import sys, torch, transformers; print(sys.version, torch.__version__, "
                "transformers.__version__)")  # fmt: skip
    session.chdir(ROOT)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.posargs)
    _free_disk(session)


@nox.session(reuse_venv=False)
@nox.parametrize("transformers", ["5.5.4"])
def decoders(session: nox.Session, transformers: str) -> None:
    """The encoder-decoder and vision-language tests on a release between the CI's last two (Whisper's
    generate() is wrong on stock 5.3-5.15, the Qwen-VL text models are patched from 5.2)."""
    _install(session, transformers)
    session.env.update(OMP_NUM_THREADS="1")
    session.chdir(ROOT)
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not inductor",
        "tests/test_decoders.py", "tests/test_wrappers.py",
    )  # fmt: skip
    _free_disk(session)


@nox.session(reuse_venv=False)
def integrations(session: nox.Session) -> None:
    """hfpatch with the libraries users combine it with, in their own ways of calling the model."""
    _pip(session, TORCH, f"transformers=={NEWEST}", *INTEGRATIONS, *TEST_DEPENDENCIES)
    _pip(session, "--no-deps", "-e", str(ROOT))
    session.env.update(OMP_NUM_THREADS="1")
    session.chdir(ROOT)
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
        "tests/integrations", "tests/test_processes.py", "tests/test_workers.py",
    )  # fmt: skip
    _free_disk(session)


PLUGIN_TEST = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def test_the_fixture_is_there(assert_padding_invariant):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    try:
        assert_padding_invariant(model, families=["padding"])
    except AssertionError as exc:  # stock GPT-2 (the plugin patches nothing): left padding is wrong
        assert "left padding, one call" in str(exc)
    else:
        raise AssertionError("stock GPT-2 passed the padding check")
"""


@nox.session(reuse_venv=False)
def wheel(session: nox.Session) -> None:
    """Build the wheel and install it as users do, into an environment that already has torch and a
    transformers older than the newest (both must stay as they are), then run the doctor and the
    launcher from outside the checkout: a module or data file left out of the package fails here."""
    import tempfile

    session.install("build")
    out = Path(tempfile.mkdtemp(prefix="hfpatch-wheel-"))
    session.run("python", "-m", "build", "--wheel", "--outdir", str(out), str(ROOT))
    wheels = sorted(out.glob("hfpatch-*.whl"))
    theirs = "4.57.6"  # the environment's own transformers: the last 4.x
    _pip(session, TORCH, f"transformers=={theirs}")
    versions = "import torch, transformers; print(torch.__version__, transformers.__version__)"
    before = session.run("python", "-c", versions, silent=True)
    session.install(str(wheels[-1]))
    after = session.run("python", "-c", versions, silent=True)
    if before != after or theirs not in after:
        session.error(
            f"installing hfpatch changed the environment's torch or transformers: {before} -> {after}"
        )
    session.chdir(out)  # not the checkout: the installed package is what runs
    session.run("python", "-m", "hfpatch")
    session.run("hfpatch", "verify", "qwen2", "--no-static")
    check = "import hfpatch; how = hfpatch.status().applied_by; assert 'launcher' in how, how; print(how)"
    session.run("hfpatch", "run", "--", "python", "-c", check)
    # the pytest plugin: a suite that imports nothing of hfpatch has the fixture
    session.install("pytest")
    (out / "test_plugin.py").write_text(PLUGIN_TEST)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(out / "test_plugin.py"))
    shutil.rmtree(out, ignore_errors=True)
    _free_disk(session)


@nox.session(reuse_venv=False)
def newest(session: nox.Session) -> None:
    """A new transformers release the week it ships: the registry's newest (or ``NEWEST=X.Y.Z``) with
    torch pinned, the matrix on it with the whole suite (compat/evidence/RELEASE.json), then what differs
    from the newest tested release: new model types, changed probe verdicts, failures (compat/newest.py;
    the steps to "tested": docs/compatibility.md)."""
    release = os.environ.get("NEWEST")
    if not release:
        folder = Path(session.create_tmp()) / "newest"
        session.run("python", "-m", "pip", "download", "-q", "--no-deps", "transformers", "-d", str(folder))
        release = next(folder.glob("transformers-*.whl")).name.split("-")[1]
    if release == NEWEST:
        session.log(f"transformers {release} is the newest tested release already")
        return
    _install(session, release)
    session.chdir(ROOT)
    session.run(
        "python", "compat/matrix.py", "run", release, env={"MATRIX_SAMPLE": release, "OMP_NUM_THREADS": "1"}
    )
    session.run("python", "compat/newest.py", "diff", release)
    _free_disk(session)
