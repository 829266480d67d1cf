"""``python -m hfpatch``: versions, what is patched, and a live before/after check on tiny random models.

    python -m hfpatch                        # the doctor: the flagship architectures (GPT-2, Llama, Gemma)
    python -m hfpatch verify qwen2 ./ckpt    # the probe on model types or local checkpoint directories
    python -m hfpatch architectures          # the table of declarations (Markdown, as in the README)
    hfpatch run -- torchrun train.py         # CMD with hfpatch applied in every Python process it starts

Exit status 1 when a patched model is not exact.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Optional

from . import engine

__all__ = ["main"]


def doctor() -> int:
    import torch
    import transformers

    from .probe import tiny_model, verify

    status = engine.apply()
    flagships = [a.arch for a in engine.registry().values() if a.flagship]
    models = {}
    for arch in flagships:
        if engine.status()[arch].state == engine.WAITING:
            models[arch] = tiny_model(arch)  # imports the modeling module: the hook patches it
    status = engine.status()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"Python {platform.python_version()}, {versions}")
    counts = Counter(entry.state for entry in status.values())
    print(
        f"{len(status)} decoder-only model types known: " + ", ".join(f"{n} {s}" for s, n in counts.items())
    )
    print("(print(hfpatch.status()) lists each with its reason; python -m hfpatch verify TYPE probes one)")
    print()
    failed = False
    for arch in flagships:
        entry = status[arch]
        if entry.state not in (engine.APPLIED, engine.WAITING):
            print(f"{arch}: not checked ({entry.state}: {entry.reason})")
            continue
        result = verify(models.get(arch) or tiny_model(arch))
        failed |= not result.ok
        print(result)
        print()
    return 1 if failed else 0


def verify_cli(targets: Sequence[str], static: bool) -> int:
    from .probe import verify

    engine.apply()
    failed = False
    for target in targets:
        result = verify(target, static=static)
        failed |= result.state == engine.APPLIED and not result.ok
        print(result)
        print()
    return 1 if failed else 0


def architectures() -> str:
    """The declarations as Markdown: every patched class with its model types, family and releases,
    then the model types hfpatch knows and does not patch, with the reason (the README's table)."""
    from .gates import NEWEST_TESTED

    lines = [
        f"{sum(1 + len(a.aliases) for a in engine.registry().values())} model types patched "
        f"({len(engine.registry())} classes); releases: where the compat matrix tests the class, "
        f"through {NEWEST_TESTED} (compat/REPORT.md).",
        "",
        "| model type (and others that run the class) | class patched | family | releases |",
        "|---|---|---|---|",
    ]
    for adapter in sorted(engine.registry().values(), key=lambda a: a.arch):
        types = adapter.arch + "".join(f", {alias}" for alias in adapter.aliases)
        releases = f"{adapter.since} - {NEWEST_TESTED}{adapter.exceptions}"
        lines.append(f"| {types} | `{adapter.cls}` | {adapter.family.name} | {releases} |")
    by_verdict: dict[str, list[str]] = {}
    for entry in engine.status().values():
        if not entry.target:
            by_verdict.setdefault(entry.state, []).append(f"`{entry.arch}` ({entry.reason})")
    for verdict, entries in by_verdict.items():
        lines += ["", f"**{verdict.capitalize()}** ({len(entries)}): " + "; ".join(sorted(entries)) + "."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfpatch", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    check = commands.add_parser("verify", help="probe model types or local checkpoint directories")
    check.add_argument("targets", nargs="+", metavar="PATH_OR_TYPE")
    check.add_argument("--no-static", action="store_true", help="skip the StaticCache scenario")
    commands.add_parser("architectures", help="print the table of declarations (Markdown)")
    launcher = commands.add_parser("run", help="run a command with hfpatch applied in every Python process")
    launcher.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)
    if args.command == "architectures":
        print(architectures())
        return 0
    if args.command == "verify":
        return verify_cli(args.targets, static=not args.no_static)
    return doctor()


def run(command: Sequence[str]) -> int:
    """``hfpatch run -- CMD ARGS...``: run CMD with hfpatch applied at the start of every Python
    process it starts (``python``, ``torchrun``, ``accelerate launch``, their workers), through a
    ``sitecustomize`` put first on ``PYTHONPATH`` that chains to any existing one. Replaces this
    process (``os.execvpe``); the environment variables of :mod:`hfpatch.auto` choose the adapters
    or switch it off."""
    import os
    from pathlib import Path

    from .auto import LAUNCHED_VARIABLE

    if not command:
        print("hfpatch run: expected a command, as in: hfpatch run -- python train.py", file=sys.stderr)
        return 2
    bootstrap = str(Path(__file__).resolve().parent / "bootstrap")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([bootstrap, *filter(None, [env.get("PYTHONPATH")])])
    env[LAUNCHED_VARIABLE] = "1"
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        print(f"hfpatch run: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127


def console() -> None:
    """The ``hfpatch`` console script: the same commands as ``python -m hfpatch``."""
    sys.exit(main())
