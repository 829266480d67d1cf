"""``import hfpatch.auto``: apply hfpatch now, configured by the environment (like ``ddtrace.auto``).

    HFPATCH_ARCHS=qwen2,llama   # only these model types (default: every adapter)
    HFPATCH_DISABLED=1          # do nothing (also: true, yes, on)

``hfpatch run -- CMD`` imports this module at the start of every Python process it starts (through a
``sitecustomize`` on ``PYTHONPATH``), so spawned workers, DataLoader workers and torchrun ranks are
patched too. ``hfpatch.status().applied_by`` says how a process was patched.
"""

import os

from . import engine

__all__ = ["ARCHS_VARIABLE", "DISABLED_VARIABLE"]

ARCHS_VARIABLE = "HFPATCH_ARCHS"
DISABLED_VARIABLE = "HFPATCH_DISABLED"
LAUNCHED_VARIABLE = "HFPATCH_LAUNCHED"  # set by `hfpatch run`, inherited by every child process


def _apply_from_environment() -> None:
    if os.environ.get(DISABLED_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    names = [name.strip() for name in os.environ.get(ARCHS_VARIABLE, "").split(",") if name.strip()]
    if os.environ.get(LAUNCHED_VARIABLE):
        how = f"the hfpatch run launcher (sitecustomize, process {os.getpid()})"
    else:
        how = "import hfpatch.auto"
    if names:
        how += f", {ARCHS_VARIABLE}={','.join(names)}"
    engine.apply(names or None)
    engine.applied_by(how)


_apply_from_environment()
