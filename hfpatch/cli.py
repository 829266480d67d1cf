"""The command line: ``hfpatch`` (or ``python -m hfpatch``). ``hfpatch --help`` says it all."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any, Optional

from . import __version__, engine
from .declarations import kept
from .launcher import audit, run

__all__ = ["main"]

OK, WRONG, CANNOT_RUN = 0, 1, 2
BROKEN_PIPE = 141  # as a shell reports a command that SIGPIPE ended

EPILOG = """\
examples:
  hfpatch                                  the doctor: the bug on stock transformers and the fix
  hfpatch verify qwen2 ./my-checkpoint     the same check on model types or checkpoint directories
  hfpatch status [qwen2 ...]               what hfpatch.apply() patches on this installation, and why
  hfpatch run -- torchrun train.py         hfpatch in every Python process of a command
  HFPATCH_ARCHS=qwen2,llama hfpatch run -- python serve.py
  hfpatch audit --json audit.json -- python eval.py   stock results; what stock got wrong, counted
  HFPATCH_SHADOW=0.01 hfpatch run -- python eval.py   patched; 1 % of calls checked against rows alone

exit status:
  0    every model checked is exact with hfpatch (or right on stock)
  1    a model checked is wrong with hfpatch installed (also one hfpatch does not patch: its
       table says why)
  2    cannot run: bad arguments, no such checkpoint or model type, neither a causal LM, an
       image-text-to-text nor an encoder-decoder model (or its tiny model cannot be built or run);
       verify: nothing wrong found, but not everything checked (its table says what was not)
  126  run, audit: the command cannot be executed; 127: it was not found (else: the command's own
       status)
  141  the output's reader closed it (hfpatch status | head)
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit status for usage errors is 2 too
        self.exit(CANNOT_RUN, f"{self.prog}: {message}\n")


def main(argv: Optional[Sequence[str]] = None, prog: str = "hfpatch") -> int:
    parser = _Parser(
        prog=prog,
        description="Right logits from Hugging Face transformers models with padding and KV caches.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hfpatch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("doctor", help="the default: versions, what is patched, the bug and the fix")
    check = commands.add_parser("verify", help="check model types or local checkpoint directories")
    check.add_argument("targets", nargs="+", metavar="TYPE_OR_DIR")
    check.add_argument("--no-static", action="store_true", help="leave out the StaticCache scenario")
    check.add_argument("--dtype", choices=PRECISIONS, help="build or load the model in this dtype (fp32)")
    check.add_argument("--autocast", choices=PRECISIONS[1:], help="every call under torch.autocast to it")
    commands.add_parser("architectures", help="print the table of model types (Markdown)")
    states = commands.add_parser("status", help="what hfpatch.apply() patches here, and why (a table)")
    states.add_argument("types", nargs="*", metavar="TYPE", help="these model types only, imported")
    launcher = commands.add_parser("run", help="run a command with hfpatch in every Python process")
    launcher.add_argument("--unpad", action="store_true", help="padded calls run on their real tokens")
    launcher.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    auditor = commands.add_parser("audit", help="run a command stock and count what stock got wrong")
    auditor.add_argument("--json", metavar="PATH", help="also write the counts there (model type -> counts)")
    auditor.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    args = parser.parse_args(argv)
    warnings.formatwarning = _one_line  # (hfpatch's warnings on the command line: no file and line)
    if args.command == "doctor" or args.command is None:
        _quiet_transformers()
    if args.command == "run":
        return run(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd, prog, unpad=args.unpad)
    if args.command == "audit":
        return audit(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd, args.json, prog)
    if args.command == "architectures":
        print(architectures())
        return OK
    if args.command == "status":
        _quiet_transformers()
        return status(args.types, prog)
    if args.command == "verify":
        if any(not (_names_a_path(t) and not os.path.isdir(t)) for t in args.targets):
            _quiet_transformers()
        precision = {"dtype": args.dtype, "autocast": args.autocast}
        return verify(args.targets, static=not args.no_static, prog=prog, **precision)
    return doctor()


_FORMAT = warnings.formatwarning


def _one_line(message: Any, category: type, filename: str, lineno: int, line: Optional[str] = None) -> str:
    """An hfpatch warning as the command line shows it, ``hfpatch: the message``, without the file and
    line of hfpatch's that raised it (or the call that did); any other as Python shows it."""
    if os.path.dirname(os.path.abspath(__file__)) not in os.path.abspath(filename):
        return _FORMAT(message, category, filename, lineno, line)
    kind = "" if category is RuntimeWarning else f"{category.__name__}: "
    return f"hfpatch: {kind}{message}\n"


def _quiet_transformers() -> None:
    """Building tiny models and loading checkpoints makes transformers log advice meant for training
    (new heads initialized, ``is_decoder``): the command's own lines say what matters here."""
    import transformers

    transformers.logging.set_verbosity_error()


# the doctor's models: gpt2 (absolute positions), llama and gemma (rotary), qwen3_5_text (a hybrid)
DOCTOR_MODELS = ("gpt2", "llama", "gemma", "qwen3_5_text")
WHY = """\
Why stock is wrong: a plain forward call numbers the tokens by cache column, not by the mask.
- Absolute positions (gpt2 below): any padding shifts every real token, left padding in one call too.
- Rotary positions (llama, gemma): a uniform left shift cancels, so left padding in one call is right;
  the holes of a padded cached prefix do not cancel (nor windows, nor rope scaled by the length).
- Layers that carry a state (qwen3_5_text: a gated delta rule beside attention; Mamba, LFM2 ...): a pad
  inside a row, or an earlier sequence packed in it, moves the state on; hfpatch runs each sequence alone."""


def doctor() -> int:
    """Versions, what hfpatch patches here, why stock is wrong, and the check on tiny models of each kind."""
    import torch
    import transformers

    from .verification import verify as check
    from .verification.tiny import tiny_model

    engine.apply()
    waiting = [arch for arch in DOCTOR_MODELS if engine.status()[arch].state == engine.WAITING]
    models = {arch: tiny_model(arch) for arch in waiting}
    status = engine.status()  # the models' modules are imported now: their post-import hooks ran
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"Python {platform.python_version()}, {versions}")
    counts = Counter(entry.state for entry in status.values())
    print(
        f"hfpatch knows {len(status)} model types (decoder-only, encoder-decoder, vision-language): "
        + ", ".join(f"{n} {state}" for state, n in counts.items())
    )
    print("(print(hfpatch.status()) lists each with its reason; hfpatch verify TYPE checks one)")
    print()
    print(WHY)
    print()
    failed = False
    for arch in DOCTOR_MODELS:
        entry = status[arch]
        if entry.state != engine.APPLIED:
            print(f"{arch}: not checked ({entry.state}: {entry.reason})\n")
            continue
        result = check(models.get(arch) or tiny_model(arch))
        failed |= not result.ok
        print(f"{result}\n")
    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    for arch, attention in (("llama", "sdpa"), ("qwen3_5_text", "sdpa")):
        if status[arch].state == engine.APPLIED and kept(status[arch].packed):
            label = f"{arch}, {'SDPA' if attention == 'sdpa' else attention}"
            failed |= not _packed_and_unpadded(tiny_model(arch, attention=attention, sizes=sizes), label)
    return WRONG if failed else OK


def _packed_and_unpadded(model: Any, label: str) -> bool:
    """The doctor's last table: a row packing three sequences (positions restarting), and a skewed
    right-padded batch run with ``apply(unpad=True)``, beside stock: each sequence against itself alone,
    and the median time of a call."""
    import time

    import torch

    lengths = [128, 8, 12, 20, 9, 40, 16, 10]  # a skewed batch: about a quarter of its slots are real tokens
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 90, (n,), generator=generator) for n in lengths]
    ids, mask = torch.zeros(len(rows), max(lengths), dtype=torch.long), torch.zeros(len(rows), max(lengths))
    for r, row in enumerate(rows):
        ids[r, : len(row)], mask[r, : len(row)] = row, 1
    positions = torch.cat([torch.arange(n) for n in lengths[1:4]])[None]
    packed = {"input_ids": torch.cat(rows[1:4])[None], "position_ids": positions}
    padded = {"input_ids": ids, "attention_mask": mask}
    calls = (  # (label, the call, each sequence's (row, first column), which sequences, unpad on our side)
        ("three sequences packed in a row", packed, [(0, sum(lengths[1:i])) for i in range(1, 4)],
         range(1, 4), False),
        (f"a padded batch ({int(mask.sum())} of {mask.numel()} real), unpad=True", padded,
         [(r, 0) for r in range(len(rows))], range(len(rows)), True),
    )  # fmt: skip
    with torch.no_grad(), engine.unpatched():
        alone = [model(input_ids=row[None]).logits[0] for row in rows]

    def run(kwargs: dict, unpad: bool) -> tuple[Any, float]:
        engine.apply(unpad=unpad)
        try:
            with torch.no_grad():
                logits, times = None, []
                for _ in range(5):
                    start = time.perf_counter()
                    logits = model(**kwargs).logits
                    times.append(time.perf_counter() - start)
        finally:
            engine.apply(unpad=False)
        return logits, sorted(times)[2] * 1e3

    print(f"{label}: packed rows, and a padded batch run on its real tokens (each sequence vs itself alone)")
    print(
        f"  {'call':48} {'stock max|diff|':>16} {'hfpatch max|diff|':>18} {'stock ms':>9} {'hfpatch ms':>11}"
    )
    exact = True
    for call, kwargs, spans, which, unpad in calls:
        with engine.unpatched():
            stock, stock_ms = run(kwargs, False)
        ours, ours_ms = run(kwargs, unpad)
        diffs = [
            max(
                (logits[r, s : s + lengths[i]] - alone[i]).abs().max().item()
                for (r, s), i in zip(spans, which)
            )
            for logits in (stock, ours)
        ]
        exact &= diffs[1] <= 1e-5
        print(f"  {call:48} {diffs[0]:16.2e} {diffs[1]:18.2e} {stock_ms:9.1f} {ours_ms:11.1f}")
    return exact


def status(types: Sequence[str], prog: str = "hfpatch") -> int:
    """``hfpatch status``: ``apply()`` in this process; every model type's row (``print(status())``),
    or, for the types named, their modules imported (so the state is what a program that imports them
    gets) and each type's entry in full. Exit 2 for a type hfpatch does not know."""
    import contextlib
    import importlib
    import textwrap

    engine.apply()
    engine.applied_by(f"{prog} status")
    known = engine.status()
    for arch in types:
        try:
            entry = known[arch]
        except KeyError as exc:
            print(f"{prog} status: {exc.args[0]}", file=sys.stderr)
            return CANNOT_RUN
        if entry.target:  # its post-import hook installs the patch (a release without the module: absent)
            with contextlib.suppress(ImportError):
                importlib.import_module(entry.target.split(":")[0])
    if not types:
        print(known)
        return OK
    now = engine.status()
    print(f"transformers {now.transformers or 'not installed'}")
    for arch in types:
        entry = now[arch]
        print(f"{arch}: {entry.state}")
        fields = [
            ("support", entry.support), ("packed", entry.packed), ("patches", entry.target),
            ("releases", entry.versions), ("why", entry.reason),
        ]  # fmt: skip
        for name, value in fields:
            if value:
                print(textwrap.fill(value, 100, initial_indent=f"  {name:9}", subsequent_indent=" " * 11))
    return OK


PRECISIONS = ("float32", "bfloat16", "float16")  # verify --dtype / --autocast: torch's names


def verify(
    targets: Sequence[str],
    static: bool,
    prog: str = "hfpatch",
    dtype: Optional[str] = None,
    autocast: Optional[str] = None,
) -> int:
    """``hfpatch verify``: each target's table; exit 1 if one is wrong with hfpatch, 2 if one cannot
    run (one line each, no traceback) or could not be checked in full (a scenario that raised on both
    sides, no KV cache to continue). A path that is no directory is said at once (before torch loads).
    ``dtype`` / ``autocast``: a precision regime by torch's name of the dtype."""
    worst = OK
    for target in targets:
        if _names_a_path(target) and not os.path.isdir(target):
            print(f"{prog} verify: {target}: no such checkpoint directory", file=sys.stderr)
            worst = max(worst, CANNOT_RUN)
            continue
        import torch

        from .verification import CannotVerify
        from .verification import verify as check

        engine.apply()
        precision = {k: getattr(torch, v) for k, v in (("dtype", dtype), ("autocast", autocast)) if v}
        try:
            result = check(target, static=static, **precision)
        except CannotVerify as exc:
            print(f"{prog} verify: {exc}", file=sys.stderr)
            worst = max(worst, CANNOT_RUN)
            continue
        print(f"{result}\n")
        worst = max(worst, exit_status(result))
    return worst


def exit_status(result: Any) -> int:
    """A verification's exit status: 0 exact wherever checked and everything checked, 1 wrong
    somewhere, else 2 (a scenario that raised on both sides, calls no scenario could make)."""
    return OK if result.ok else WRONG if result.wrong else CANNOT_RUN


def _names_a_path(target: str) -> bool:
    return os.sep in target or target.startswith(".") or bool(os.altsep and os.altsep in target)


def architectures() -> str:
    """The declarations as Markdown: every patched class with its model types, family and releases,
    then the model types hfpatch knows and does not patch, with the reason (docs/architectures.md)."""
    from .support import NEWEST_TESTED

    adapters = sorted((a for a in engine.registry().values() if not a.recognised), key=lambda a: a.arch)
    registry = [a for a in adapters if not (a.family.seq2seq or a.family.multimodal)]
    multimodal = [a for a in adapters if a.family.multimodal]
    seq2seq = [a for a in adapters if a.family.seq2seq]
    lines = [
        f"{sum(1 + len(a.aliases) for a in registry)} decoder-only model types patched ({len(registry)} "
        f"classes), each from the first release of its tested range through {NEWEST_TESTED}.",
        "",
        "| model type (and others that run the class) | class patched | family | releases |",
        "|---|---|---|---|",
    ]
    for adapter in registry:
        family, releases = adapter.family.name, _releases(adapter)
        lines.append(f"| {_types(adapter)} | `{adapter.cls}` | {family} | {releases} |")
    lines += [
        "",
        f"{sum(1 + len(a.aliases) for a in multimodal)} vision-language model types whose wrapper or text "
        "model is patched (text calls; an image call keeps the wrapper's own positions).",
        "",
        "| model type (and others that run the class) | class patched | releases |",
        "|---|---|---|",
    ]
    for adapter in multimodal:
        lines.append(f"| {_types(adapter)} | `{adapter.cls}` | {_releases(adapter)} |")
    lines += [
        "",
        f"{len(seq2seq)} encoder-decoder model types whose decoder (and, where its positions are absolute, "
        "encoder) is patched: positions from `decoder_attention_mask` (and `attention_mask`).",
        "",
        "| model type | classes patched | family | positions handed to | releases |",
        "|---|---|---|---|---|",
    ]
    for adapter in seq2seq:
        classes = ", ".join(f"`{cls}`" for cls in (adapter.cls, *adapter.also))
        receiver = f"`{adapter.receiver}`" if adapter.receiver else "the forward (`position_ids`)"
        row = f"| {adapter.arch} | {classes} | {adapter.family.name} | {receiver} | {_releases(adapter)} |"
        lines.append(row)
    lines += ["", "| model type not patched | verdict | why |", "|---|---|---|"]
    lines += [
        f"| `{entry.arch}` | {entry.state} | {entry.reason} |"
        for entry in sorted(engine.status().values(), key=lambda e: (e.state, e.arch))
        if not entry.target and entry.support != "custom"  # (classes outside transformers: run-time facts)
    ]
    return "\n".join(lines)


def _types(adapter: Any) -> str:
    """The model types that run an adapter's class: its own, then its aliases."""
    return adapter.arch + "".join(f", {alias}" for alias in adapter.aliases)


def _releases(adapter: Any) -> str:
    from .support import NEWEST_TESTED

    holes = "".join(f", not {spec.removeprefix('==')} (known-bad)" for spec, _ in adapter.known_bad)
    holes += "".join(f", not {spec.removeprefix('==')} (unverified)" for spec, _ in adapter.unverified)
    since = adapter.since if not NEWEST_TESTED.startswith(f"{adapter.since}.") else NEWEST_TESTED
    return (f"{since} - {NEWEST_TESTED}" if since != NEWEST_TESTED else since) + holes


def console(prog: str = "hfpatch") -> None:
    """The ``hfpatch`` console script (and ``python -m hfpatch``)."""
    try:
        sys.exit(main(prog=prog))
    except BrokenPipeError:  # its reader stopped reading (hfpatch status | head): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(BROKEN_PIPE)
