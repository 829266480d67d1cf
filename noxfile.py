"""The release matrix: one nox session per transformers release in compat/releases.txt.

    nox -s matrix                          # every release (hours: see compat/README.md)
    nox -s "matrix(transformers='4.40.2')"  # one release
    python compat/report.py                # compat/results/ -> compat/REPORT.md + compat/summary.json
    nox -s integrations                    # peft, trl, accelerate, processes (CI runs it)
    nox -s wheel                           # the built wheel, installed as users install it (CI runs it)

Each session makes (or, with -R, reuses) a virtualenv with torch==2.13.0 (CPU) and that release,
installs hfpatch from the checkout, runs the test suite (JUnit XML) and the stock-vs-hfpatch case
count (JSON) into compat/results/.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
RESULTS = ROOT / "compat" / "results"
RELEASES = [
    line.strip()
    for line in (ROOT / "compat" / "releases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
CI_RELEASES = [
    "4.20.1",
    "4.40.2",
    "4.57.6",
    "5.24.0",
]  # oldest, StaticCache cache_position era, last 4.x, newest
# transformers 4.20-4.25 pin tokenizers<0.13, which has no wheel for Python 3.11: install without it
NO_TOKENIZERS = ("4.20.", "4.21.", "4.22.", "4.23.", "4.24.", "4.25.")
NO_TOKENIZERS_DEPS = [
    "huggingface_hub<1.0",
    "regex",
    "requests",
    "pyyaml",
    "tqdm",
    "filelock",
    "packaging",
    "numpy",
]

# transformers 5.4.0 allows huggingface_hub up to 1.x, but its newest (1.33) rejects the field types of
# some of 5.4.0's configs (OLMo, PhiMoE, ERNIE 4.5, Cohere 2: no model can be built); 1.5.0, the oldest
# it allows, builds them
HUB_PINS = {"5.4.0": "1.5.0"}

nox.options.sessions = ["matrix"]
nox.options.error_on_missing_interpreters = True


def _run_release(session: nox.Session, release: str, strict: bool) -> None:
    session.install("torch==2.13.0")  # the CPU build; never an unpinned torch
    if release.startswith(NO_TOKENIZERS):
        session.install("--no-deps", f"transformers=={release}")
        session.install(*NO_TOKENIZERS_DEPS)
    elif release in HUB_PINS:
        session.install(f"transformers=={release}", f"huggingface_hub=={HUB_PINS[release]}")
    else:
        session.install(f"transformers=={release}")
    session.install("wrapt", "packaging", "pytest", "hypothesis")
    session.install("--no-deps", "--force-reinstall", str(ROOT))
    RESULTS.mkdir(parents=True, exist_ok=True)
    # fewer hypothesis examples, no inductor (the main suite runs both on the newest release), one thread
    session.env.update(HFPATCH_HYPOTHESIS_PROFILE="matrix", OMP_NUM_THREADS="1")
    # test_compat_report checks the committed report against the adapters: not a per-release test
    select = ["-m", "not inductor", "--ignore=tests/test_compat_report.py"]
    session.chdir(ROOT)
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
        f"--junitxml={RESULTS / (release + '.xml')}", *select, *session.posargs,
        success_codes=[0] if strict else [0, 1],  # matrix: a failing test is a result for the report
    )  # fmt: skip
    if not strict:  # the report's stock-vs-hfpatch counts; CI only needs the tests
        session.run("python", "compat/count_cases.py", str(RESULTS / f"{release}.cases.json"))


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


NEWEST = RELEASES[-1]
INTEGRATIONS = ["peft", "trl", "accelerate"]  # current releases, next to the newest transformers


@nox.session(reuse_venv=False)
def integrations(session: nox.Session) -> None:
    """hfpatch with the libraries users combine it with, in their own ways of calling the model."""
    session.install("torch==2.13.0", f"transformers=={NEWEST}", *INTEGRATIONS, "pytest", "hypothesis")
    session.install("wrapt", "packaging")
    session.install("--no-deps", "-e", str(ROOT))
    session.env.update(OMP_NUM_THREADS="1")
    session.chdir(ROOT)
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/integrations",
        "tests/test_processes.py",
    )


@nox.session(reuse_venv=False)
def wheel(session: nox.Session) -> None:
    """Build the wheel, install it (not editable) in a fresh virtualenv, run the doctor and the
    launcher from outside the checkout: a module or data file left out of the package fails here."""
    import tempfile

    session.install("build")
    out = Path(tempfile.mkdtemp(prefix="hfpatch-wheel-"))
    session.run("python", "-m", "build", "--wheel", "--outdir", str(out), str(ROOT))
    wheels = sorted(out.glob("hfpatch-*.whl"))
    session.install("torch==2.13.0", f"transformers=={NEWEST}", str(wheels[-1]))
    session.chdir(out)  # not the checkout: the installed package is what runs
    session.run("python", "-m", "hfpatch")
    session.run("hfpatch", "verify", "qwen2", "--no-static")
    check = "import hfpatch; how = hfpatch.status().applied_by; assert 'launcher' in how, how; print(how)"
    session.run("hfpatch", "run", "--", "python", "-c", check)
