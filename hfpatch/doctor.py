"""``python -m hfpatch``: versions, what is patched, and a live before/after check on tiny random models.

    python -m hfpatch                        # the doctor: the flagship architectures (GPT-2, Llama, Gemma)
    python -m hfpatch verify qwen2 ./ckpt    # the probe on model types or local checkpoint directories

Exit status 1 when a patched model is not exact.
"""

from __future__ import annotations

import argparse
import platform
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfpatch", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    check = commands.add_parser("verify", help="probe model types or local checkpoint directories")
    check.add_argument("targets", nargs="+", metavar="PATH_OR_TYPE")
    check.add_argument("--no-static", action="store_true", help="skip the StaticCache scenario")
    args = parser.parse_args(argv)
    if args.command == "verify":
        return verify_cli(args.targets, static=not args.no_static)
    return doctor()
