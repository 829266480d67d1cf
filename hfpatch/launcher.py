"""The launcher: ``hfpatch run -- CMD`` and the environment variables that configure hfpatch in
every process it starts (read by :mod:`hfpatch.auto`).

    HFPATCH_ARCHS=qwen2,llama   # only these model types (default: every adapter)
    HFPATCH_DISABLED=1          # do nothing (also: true, yes, on)

A model type hfpatch does not know in ``HFPATCH_ARCHS`` is a ``ValueError`` that names the variable;
a variable starting with ``HFPATCH_`` that hfpatch does not read gets a warning.
"""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from . import engine

__all__ = [
    "ARCHS_VARIABLE",
    "DISABLED_VARIABLE",
    "apply_from_environment",
    "read_environment",
    "run",
    "unknown_variables",
]

ARCHS_VARIABLE = "HFPATCH_ARCHS"
DISABLED_VARIABLE = "HFPATCH_DISABLED"
LAUNCHED_VARIABLE = "HFPATCH_LAUNCHED"  # set by `hfpatch run`, inherited by every child process
RAY_HOOK_VARIABLE = "RAY_RUNTIME_ENV_HOOK"  # Ray's: a function that rewrites each ray.init()'s runtime_env
RAY_RUNTIME_ENV_HOOK = "hfpatch.workers.ray_runtime_env"
VARIABLES = (ARCHS_VARIABLE, DISABLED_VARIABLE, LAUNCHED_VARIABLE)
TRUE = ("1", "true", "yes", "on")
CANNOT_RUN, NOT_EXECUTABLE, NOT_FOUND = 2, 126, 127  # exit statuses of `hfpatch run` itself


def read_environment(environ: Mapping[str, str]) -> Optional[list[str]]:
    """The model types ``HFPATCH_ARCHS`` names (``[]``: every adapter), or ``None`` when
    ``HFPATCH_DISABLED`` is set. ``ValueError`` naming the variable for a model type hfpatch does not
    patch."""
    if environ.get(DISABLED_VARIABLE, "").strip().lower() in TRUE:
        return None
    names = [name.strip() for name in environ.get(ARCHS_VARIABLE, "").split(",") if name.strip()]
    if not names:
        return names
    try:
        engine.select(names)
    except ValueError as exc:
        raise ValueError(
            f"{ARCHS_VARIABLE}={environ[ARCHS_VARIABLE]}: {str(exc).removeprefix('archs: ')}"
        ) from None
    return names


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``HFPATCH_*`` variable hfpatch does not read (a misspelled one is ignored)."""
    warnings_ = []
    for name in sorted(environ):
        if name.startswith("HFPATCH_") and name not in VARIABLES:
            close = difflib.get_close_matches(name, VARIABLES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (it reads {', '.join(VARIABLES[:2])})"
            warnings_.append(f"{name} is not a variable hfpatch reads: ignored{hint}")
    return warnings_


def apply_from_environment(how: Optional[str] = None) -> None:
    """What ``import hfpatch.auto`` (and the Ray worker setup hook, ``how``) does: apply as the
    environment says, and record how."""
    for warning in unknown_variables(os.environ):
        warnings.warn(f"hfpatch: {warning}", RuntimeWarning, stacklevel=4)
    names = read_environment(os.environ)
    if names is None:
        return
    if how is None and os.environ.get(LAUNCHED_VARIABLE):
        how = f"the hfpatch run launcher (sitecustomize, process {os.getpid()})"
    elif how is None:
        how = "import hfpatch.auto"
    if names:
        how += f", {ARCHS_VARIABLE}={','.join(names)}"
    engine.apply(names or None)
    engine.applied_by(how)


def run(command: Sequence[str], prog: str = "hfpatch") -> int:
    """``hfpatch run -- CMD ARGS...``: run CMD with hfpatch applied at the start of every Python
    process it starts (``python``, ``torchrun``, ``accelerate launch``, their workers), through a
    ``sitecustomize`` put first on ``PYTHONPATH`` that chains to any existing one. The directory of
    a virtual environment's Python running hfpatch goes first on ``PATH`` (as activating it does), so
    that ``python`` in CMD is one that has hfpatch. Replaces this process (``os.execvpe``)."""
    if not command:
        print(f"{prog} run: expected a command, as in: {prog} run -- python train.py", file=sys.stderr)
        return CANNOT_RUN
    try:
        read_environment(os.environ)  # a bad HFPATCH_* variable: one line here, not in every process
    except ValueError as exc:
        print(f"{prog} run: {exc}", file=sys.stderr)
        return CANNOT_RUN
    for warning in unknown_variables(os.environ):
        print(f"{prog} run: {warning}", file=sys.stderr)
    here = Path(__file__).resolve().parent
    paths = [str(here / "bootstrap")]
    if here.parent.name not in ("site-packages", "dist-packages"):  # a source checkout, not installed
        paths.append(str(here.parent))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    if sys.prefix != sys.base_prefix:  # a virtual environment, maybe not activated: as activating it does
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), *filter(None, [env.get("PATH")])])
    env[LAUNCHED_VARIABLE] = "1"
    # Ray calls this on every ray.init()'s runtime_env: workers of a cluster started elsewhere, or given
    # a PYTHONPATH of their own, apply hfpatch from a worker_process_setup_hook (hfpatch.workers)
    theirs = env.setdefault(RAY_HOOK_VARIABLE, RAY_RUNTIME_ENV_HOOK)
    if theirs != RAY_RUNTIME_ENV_HOOK:
        print(
            f"{prog} run: {RAY_HOOK_VARIABLE}={theirs} is kept: for Ray workers of a cluster started "
            f"elsewhere, pass your runtime_env through {RAY_RUNTIME_ENV_HOOK}()",
            file=sys.stderr,
        )
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        print(f"{prog} run: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return NOT_FOUND if isinstance(exc, FileNotFoundError) else NOT_EXECUTABLE
