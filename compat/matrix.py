"""The release matrix, stated once: which transformers releases it tests, how each one installs (torch
pinned: the CPU build), which ones CI runs. ``noxfile.py``, ``probe_matrix.sh``, ``run_matrix.sh``,
``report.py`` and the tests read it from here.

    python compat/matrix.py releases                  # one release a line
    python compat/matrix.py setup PYTHON              # torch and the test dependencies into PYTHON's
    python compat/matrix.py install RELEASE PYTHON    # that transformers release into PYTHON's
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

TORCH = "torch==2.13.0"  # the CPU build on this project's machines; an unpinned torch pulls a CUDA build
TEST_DEPENDENCIES = ["wrapt", "packaging", "pytest", "hypothesis"]

# the last patch of every minor from 4.20 to 5.24, plus 4.54.0 (it starts an era: 4.54.1 behaves otherwise)
RELEASES = [
    line.strip()
    for line in (HERE / "releases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
NEWEST = RELEASES[-1]
CI_RELEASES = ["4.20.1", "4.40.2", "4.57.6", NEWEST]  # oldest, 4.38-4.40 static-cache era, last 4.x, newest

# transformers 4.20-4.25 pin tokenizers<0.13, which has no wheel for Python 3.11: installed without it
# (transformers imports without tokenizers; no test needs it)
NO_TOKENIZERS = ("4.20.", "4.21.", "4.22.", "4.23.", "4.24.", "4.25.")
NO_TOKENIZERS_DEPENDENCIES = [
    "huggingface_hub<1.0",
    "regex",
    "requests",
    "pyyaml",
    "tqdm",
    "filelock",
    "numpy",
]
# transformers 5.4.0 allows huggingface_hub up to 1.x, but its newest (1.33) rejects the field types of
# some of 5.4.0's own configs (OLMo, PhiMoE, ERNIE 4.5, Cohere 2: no model can be built); 1.5.0, the
# oldest it allows, builds them
HUB_PINS = {"5.4.0": "1.5.0"}


def install_steps(release: str) -> list[list[str]]:
    """The ``pip install`` argument lists that install ``release`` (after torch), in order."""
    if release.startswith(NO_TOKENIZERS):
        return [["--no-deps", f"transformers=={release}"], NO_TOKENIZERS_DEPENDENCIES]
    if release in HUB_PINS:
        return [[f"transformers=={release}", f"huggingface_hub=={HUB_PINS[release]}"]]
    return [[f"transformers=={release}"]]


def setup(python: str) -> None:
    """Install torch and the test dependencies into ``python``'s environment."""
    subprocess.run([python, "-m", "pip", "install", "-q", TORCH, *TEST_DEPENDENCIES], check=True)


def install(release: str, python: str) -> None:
    """Install ``release`` into ``python``'s environment, replacing the transformers it has (a newer
    tokenizers fails the old releases' import check: it goes first)."""
    pip = [python, "-m", "pip", "install", "-q"]
    if release.startswith(NO_TOKENIZERS):
        subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "tokenizers"], check=True)
    for step in install_steps(release):
        subprocess.run([*pip, *step], check=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["releases"]:
        print("\n".join(RELEASES))
    elif sys.argv[1:2] == ["setup"] and len(sys.argv) == 3:
        setup(sys.argv[2])
    elif sys.argv[1:2] == ["install"] and len(sys.argv) == 4:
        install(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: python {sys.argv[0]} releases | setup PYTHON | install RELEASE PYTHON")
