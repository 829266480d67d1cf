"""The launcher: ``hfpatch run -- CMD`` and the environment variables that configure hfpatch in
every process it starts (read by :mod:`hfpatch.auto`).

    HFPATCH_ARCHS=qwen2,llama   # only these model types (default: every adapter)
    HFPATCH_DISABLED=1          # do nothing (also: true, yes, on)
    HFPATCH_SHADOW=0.01         # also check that share of calls against their rows alone (hfpatch.shadow)
    HFPATCH_PACKED=0            # rows whose positions restart are left to stock (apply(packed=False))
    HFPATCH_UNPAD=1             # padded calls run on their real tokens (apply(unpad=True); run --unpad)

``hfpatch audit -- CMD`` sets ``HFPATCH_AUDIT`` (a folder): its processes run stock and count what
stock gets wrong (:mod:`hfpatch.auditing`), each writing its counts there at exit.

A model type hfpatch does not know in ``HFPATCH_ARCHS`` is a ``ValueError`` that names the variable;
a variable starting with ``HFPATCH_`` that hfpatch does not read gets a warning.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from . import engine
from ._context import PACKED_VARIABLE, UNPAD_VARIABLE, read_packed, read_unpad

__all__ = [
    "ARCHS_VARIABLE",
    "DISABLED_VARIABLE",
    "apply_from_environment",
    "audit",
    "read_environment",
    "run",
    "unknown_variables",
]

ARCHS_VARIABLE = "HFPATCH_ARCHS"
DISABLED_VARIABLE = "HFPATCH_DISABLED"
LAUNCHED_VARIABLE = "HFPATCH_LAUNCHED"  # set by `hfpatch run`, inherited by every child process
SHADOW_VARIABLE = "HFPATCH_SHADOW"  # the share of calls hfpatch.shadowing checks
AUDIT_VARIABLE = "HFPATCH_AUDIT"  # set by `hfpatch audit`: the folder its processes write counts to
RAY_HOOK_VARIABLE = "RAY_RUNTIME_ENV_HOOK"  # Ray's: a function that rewrites each ray.init()'s runtime_env
RAY_RUNTIME_ENV_HOOK = "hfpatch.workers.ray_runtime_env"
VARIABLES = (
    ARCHS_VARIABLE, DISABLED_VARIABLE, SHADOW_VARIABLE, PACKED_VARIABLE, UNPAD_VARIABLE, LAUNCHED_VARIABLE,
    AUDIT_VARIABLE,
)  # fmt: skip
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
CANNOT_RUN, NOT_EXECUTABLE, NOT_FOUND = 2, 126, 127  # exit statuses of `hfpatch run` itself


def read_environment(environ: Mapping[str, str]) -> Optional[list[str]]:
    """The model types ``HFPATCH_ARCHS`` names (``[]``: every adapter), or ``None`` when
    ``HFPATCH_DISABLED`` is set. ``ValueError`` naming the variable for a model type hfpatch does not
    patch."""
    if environ.get(DISABLED_VARIABLE, "").strip().lower() in TRUE:
        return None
    shadow = environ.get(SHADOW_VARIABLE, "").strip()
    if shadow and not _is_rate(shadow):
        raise ValueError(f"{SHADOW_VARIABLE}={shadow}: expected a share of calls from 0 to 1")
    read_packed(environ)
    read_unpad(environ)
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


def _is_rate(value: str) -> bool:
    try:
        return 0 <= float(value) <= 1
    except ValueError:
        return False


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``HFPATCH_*`` variable hfpatch does not read (a misspelled one is ignored)."""
    warnings_ = []
    for name in sorted(environ):
        if name.startswith("HFPATCH_") and name not in VARIABLES:
            close = difflib.get_close_matches(name, VARIABLES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (it reads {', '.join(VARIABLES[:3])})"
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
    folder = os.environ.get(AUDIT_VARIABLE, "").strip()
    rate = os.environ.get(SHADOW_VARIABLE, "").strip()  # checked by read_environment above
    if folder:  # hfpatch audit: stock results, calls counted (and, with HFPATCH_SHADOW, stock's checked)
        from .auditing import audit_this_process

        audit_this_process(folder)
        if rate:
            from .shadowing import shadow_this_process

            shadow_this_process(float(rate))
        return
    if how is None and os.environ.get(LAUNCHED_VARIABLE):
        how = f"the hfpatch run launcher (sitecustomize, process {os.getpid()})"
    elif how is None:
        how = "import hfpatch.auto"
    if names:
        how += f", {ARCHS_VARIABLE}={','.join(names)}"
    engine.apply(names or None, packed=read_packed(os.environ), unpad=read_unpad(os.environ))
    engine.applied_by(how)
    if rate:
        from .shadowing import shadow_this_process

        shadow_this_process(float(rate))


def run(command: Sequence[str], prog: str = "hfpatch", unpad: bool = False) -> int:
    """``hfpatch run [--unpad] -- CMD ARGS...``: run CMD with hfpatch applied at the start of every
    Python process it starts (``python``, ``torchrun``, ``accelerate launch``, their workers), through a
    ``sitecustomize`` put first on ``PYTHONPATH`` that chains to any existing one. The directory of
    a virtual environment's Python running hfpatch goes first on ``PATH`` (as activating it does), so
    that ``python`` in CMD is one that has hfpatch. ``--unpad``: ``HFPATCH_UNPAD=1`` in every process.
    Replaces this process (``os.execvpe``)."""
    env = _environment(command, "run", prog)
    if isinstance(env, int):
        return env
    if unpad:
        env[UNPAD_VARIABLE] = "1"
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        return _cannot_run(command, exc, "run", prog)


def audit(command: Sequence[str], json_path: Optional[str] = None, prog: str = "hfpatch") -> int:
    """``hfpatch audit [--json PATH] -- CMD ARGS...``: run CMD as ``hfpatch run`` does, but stock in
    every process (results unchanged), each counting what stock got wrong by positions; then print
    the counts of all processes, added up, on stderr (and write them to PATH as JSON: model type ->
    counts). Exits with CMD's status."""
    env = _environment(command, "audit", prog)
    if isinstance(env, int):
        return env
    if json_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(json_path))):
        print(f"{prog} audit: --json {json_path}: its folder does not exist", file=sys.stderr)
        return CANNOT_RUN
    from .auditing import merge, table

    folder = tempfile.mkdtemp(prefix="hfpatch-audit-")
    try:
        env[AUDIT_VARIABLE] = folder
        try:
            child = subprocess.Popen(list(command), env=env)
        except OSError as exc:
            return _cannot_run(command, exc, "audit", prog)
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # the child has the signal too: wait for it to finish
                continue
        reports = _read_counts(Path(folder), prog)
    finally:  # a worker still ending may write after its parent: whatever it leaves goes too
        shutil.rmtree(folder, ignore_errors=True)
    merged = merge(reports)
    processes = f"{len(reports)} process{'es' if len(reports) != 1 else ''}"
    print(f"{table(merged)}\n({processes} counted)", file=sys.stderr)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    return code


def _read_counts(folder: Path, prog: str, settle: float = 0.3, longest: float = 3.0) -> list:
    """Each process's counts: its workers may still be writing when the command has exited (a
    DataLoader worker ends after its parent), so the folder is read once it has not changed for
    ``settle`` seconds (at most ``longest``)."""

    def state() -> list:
        return sorted((p.name, p.stat().st_mtime_ns) for p in folder.glob("[0-9]*.json") if p.exists())

    before, start = None, time.monotonic()
    while time.monotonic() - start < longest:
        with contextlib.suppress(OSError):
            now = state()
            if now == before:
                break
            before = now
        time.sleep(settle)
    reports = []
    for path in sorted(folder.glob("[0-9]*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            print(f"{prog} audit: a process's counts could not be read ({path.name})", file=sys.stderr)
    return reports


def _environment(command: Sequence[str], verb: str, prog: str) -> dict[str, str] | int:
    """The environment of a launched command, or the exit status of a mistake (said in one line)."""
    if not command:
        print(f"{prog} {verb}: expected a command, as in: {prog} {verb} -- python train.py", file=sys.stderr)
        return CANNOT_RUN
    try:
        read_environment(os.environ)  # a bad HFPATCH_* variable: one line here, not in every process
    except ValueError as exc:
        print(f"{prog} {verb}: {exc}", file=sys.stderr)
        return CANNOT_RUN
    for warning in unknown_variables(os.environ):
        print(f"{prog} {verb}: {warning}", file=sys.stderr)
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
            f"{prog} {verb}: {RAY_HOOK_VARIABLE}={theirs} is kept: for Ray workers of a cluster started "
            f"elsewhere, pass your runtime_env through {RAY_RUNTIME_ENV_HOOK}()",
            file=sys.stderr,
        )
    return env


def _cannot_run(command: Sequence[str], exc: OSError, verb: str, prog: str) -> int:
    print(f"{prog} {verb}: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
    return NOT_FOUND if isinstance(exc, FileNotFoundError) else NOT_EXECUTABLE
