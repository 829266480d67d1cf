"""What a packed row and an unpadded call cost at length: time and peak memory of one call against the
sequences' own run, from 1k to 128k tokens. Every measurement runs in a process of its own (peak memory is
the resident high-water mark's growth over the call, the mark reset before it), one torch thread, best of
2; the variants of one row run back to back, A B A B, so that drift hits both.

    python benchmarks/scale.py --one packed llama sdpa 8 4096   # one measurement: its JSON line
    python benchmarks/scale.py --release [--compiled [--long]] # another release's rows, run under it
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# (tokens, attention, sequences x length): equal sequences, packed into one row (or their own batch);
# eager scores each group of sequences whole (heads x length ** 2): to 16k tokens of 2k; SDPA to 128k
ROWS = [
    (1024, "sdpa", (8, 128)),
    (4096, "sdpa", (8, 512)),
    (16384, "sdpa", (8, 2048)),
    (32768, "sdpa", (8, 4096)),
    (131072, "sdpa", (8, 16384)),
    (1024, "eager", (8, 128)),
    (4096, "eager", (8, 512)),
    (16384, "eager", (8, 2048)),
]
STOCK_UP_TO = 32768  # stock's packed row builds a length x length mask itself: beyond, GiBs to leak


def measure(
    what: str,
    arch: str,
    attention: str,
    sequences: int,
    length: int,
    train: bool = False,
    compiled: bool = False,
) -> dict:
    """One call (``what``: ``packed`` hfpatch, ``stock`` packed, ``own``: the sequences' own batch, no mask;
    ``unpad``: ``sequences`` rows of ``sequences x length`` slots, one full and the others ``length`` long,
    under ``apply(unpad=True)``; ``alone``: those sequences each run alone); its seconds and MiB. ``compiled``:
    the model under ``torch.compile(fullgraph=True)``, compiled by a first call that is not counted."""
    import torch

    torch.set_num_threads(1)
    import hfpatch

    if what not in ("stock", "own", "alone"):
        hfpatch.apply(unpad=what == "unpad")
    sys.path.insert(0, str(HERE))
    from hfpatch.verification.tiny import tiny_model

    from harness import SMALL, peak, reset_peak

    sizes = {**SMALL, "max_position_embeddings": 1 << 18, "n_positions": 1 << 18}
    model = tiny_model(arch, sizes=sizes, attention=attention)
    model.train(train)
    generator = torch.Generator().manual_seed(0)
    tokens = sequences * length
    if what in ("packed", "stock"):
        calls = [{
            "input_ids": torch.randint(1, 1000, (1, tokens), generator=generator),
            "position_ids": torch.arange(length).repeat(sequences)[None],
        }]  # fmt: skip
    elif what == "own":
        calls = [{"input_ids": torch.randint(1, 1000, (sequences, length), generator=generator)}]
    elif what == "unpad":
        ids = torch.randint(1, 1000, (sequences, tokens), generator=generator)
        mask = torch.zeros_like(ids)
        mask[0], mask[1:, :length] = 1, 1
        calls = [{"input_ids": ids, "attention_mask": mask}]
    else:  # alone: the unpad rows' sequences, each its own call
        calls = [{"input_ids": torch.randint(1, 1000, (1, tokens), generator=generator)}]
        calls += [{"input_ids": torch.randint(1, 1000, (1, length), generator=generator)}] * (sequences - 1)
    for call in calls:
        call["use_cache"] = False
        if train:  # (no label at a pad: a label a pad would predict keeps the padded path)
            mask = call.get("attention_mask")
            call["labels"] = (
                call["input_ids"] if mask is None else call["input_ids"].masked_fill(mask == 0, -100)
            )
    # (an unpadded call reads its layout to the host: a graph break, so not fullgraph=True)
    run = torch.compile(model, fullgraph=what != "unpad") if compiled else model

    def once() -> None:
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            for call in calls:
                out = run(**call)
                if train:
                    out.loss.backward()

    if compiled:
        once()  # (compiles: its memory is not the call's)
    before = reset_peak()
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    grown = peak() - before
    return {"seconds": best, "mib": grown}


def _run(*args: Any) -> dict:
    """:func:`measure` in a process of its own."""
    command = [sys.executable, str(Path(__file__)), "--one", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"seconds": float("nan"), "mib": float("nan"), "error": (done.stderr or "")[-200:]}
    return json.loads(lines[-1])


def _pair(first: tuple, second: tuple) -> tuple[dict, dict]:
    """Two measurements, A B A B: the better of each."""
    runs = [(_run(*first), _run(*second)) for _ in range(2)]
    best = [min((r[i] for r in runs), key=lambda m: m["seconds"]) for i in (0, 1)]
    return best[0], best[1]


def _row(label: str, tokens: int, attention: str, ours: dict, own: dict) -> str:
    ratio = ours["seconds"] / own["seconds"]
    memory = ours["mib"] / max(own["mib"], 1.0)
    return (
        f"| {label} | {tokens:,} | {attention} | {ours['seconds']:.2f} | {own['seconds']:.2f} | "
        f"**{ratio:.2f}x** | {ours['mib']:,.0f} / {own['mib']:,.0f} | {memory:.2f} |"
    )


def at_length(arch: str = "llama") -> list[str]:
    out = []
    for tokens, attention, (sequences, length) in ROWS:
        shape = (arch, attention, sequences, length)
        ours, own = _pair(("packed", *shape), ("own", *shape))
        out.append(_row(f"packed row, {sequences} x {length:,}", tokens, attention, ours, own))
        if tokens <= STOCK_UP_TO and attention == "sdpa":
            stock = _run("stock", *shape)
            out.append(
                _row(f"stock's packed row (leaks), {sequences} x {length:,}", tokens, attention, stock, own)
            )
        if attention == "sdpa" and tokens <= STOCK_UP_TO:
            ours, alone = _pair(("unpad", *shape), ("alone", *shape))
            label = f"`unpad=True`, {sequences} rows of {tokens:,} slots (one full, the others {length:,})"
            out.append(_row(label, tokens, attention, ours, alone))
    control = _pair(("own", arch, "sdpa", 8, 512), ("own", arch, "sdpa", 8, 512))
    out.append(_row("A/A: own vs own, 8 x 512", 4096, "sdpa", *control))
    for sequences, length in ((8, 512), (8, 2048)):
        shape = (arch, "sdpa", sequences, length, 1)
        ours, own = _pair(("packed", *shape), ("own", *shape))
        out.append(
            _row(f"training step, packed {sequences} x {length:,}", sequences * length, "sdpa", ours, own)
        )
    return out


def compiled_at_length(arch: str = "llama", long: bool = False) -> list[str]:
    """Compiled packed rows and unpadded calls of 8k and 16k tokens, stock's packed row, training steps and
    an A/A row; ``long`` (``--release --compiled --long``): packed rows of 32k and 64k tokens, an unpadded
    call of 32k slots a row and the A/A row at 32k (no stock row: its dense mask; no training step)."""
    sizes = ((8, 4096), (8, 8192)) if long else ((8, 1024), (8, 2048))
    rows = (("packed", "packed row"),) + (() if long else (("stock", "stock's packed row (leaks)"),))
    out = []
    for sequences, length in sizes:
        shape = (arch, "sdpa", sequences, length, 0, 1)
        for what, label in rows:
            ours, own = _pair((what, *shape), ("own", *shape))
            out.append(
                _row(f"compiled {label}, {sequences} x {length:,}", sequences * length, "sdpa", ours, own)
            )
    for sequences, length in sizes[:1] if long else sizes:
        shape = (arch, "sdpa", sequences, length, 0, 1)
        ours, alone = _pair(("unpad", *shape), ("alone", *shape))
        label = f"compiled `unpad=True`, {sequences} rows of {sequences * length:,} slots (one full)"
        out.append(_row(label, sequences * length, "sdpa", ours, alone))
    if not long:
        shape = (arch, "sdpa", 8, 1024, 1, 1)
        ours, own = _pair(("packed", *shape), ("own", *shape))
        out.append(_row("compiled training step, packed 8 x 1,024", 8192, "sdpa", ours, own))
        ours, alone = _pair(("unpad", *shape), ("alone", *shape))
        label = "compiled training step, `unpad=True`, 8 rows of 8,192 slots"
        out.append(_row(label, 8192, "sdpa", ours, alone))
    sequences, length = sizes[0]
    shape = (arch, "sdpa", sequences, length, 0, 1)
    control = _pair(("own", *shape), ("own", *shape))
    label = f"A/A: compiled own vs own, {sequences} x {length:,}"
    out.append(_row(label, sequences * length, "sdpa", *control))
    return out


def on_this_release(arch: str = "llama") -> list[str]:
    """The rows another release is asked (``--release``: run under it; 4.45.2 and 4.57.6 in RESULTS.md):
    8k and 16k tokens, SDPA and eager, packed and unpadded, a training step, an A/A row."""
    out = []
    for sequences, length in ((8, 1024), (8, 2048)):
        tokens = sequences * length
        for attention in ("sdpa", "eager") if length <= 1024 else ("sdpa",):  # (4.45's eager: dense)
            shape = (arch, attention, sequences, length)
            ours, own = _pair(("packed", *shape), ("own", *shape))
            out.append(_row(f"packed row, {sequences} x {length:,}", tokens, attention, ours, own))
        shape = (arch, "sdpa", sequences, length)
        out.append(_row(f"stock's packed row (leaks), {sequences} x {length:,}", tokens, "sdpa",
                        _run("stock", *shape), _run("own", *shape)))  # fmt: skip
        ours, alone = _pair(("unpad", *shape), ("alone", *shape))
        label = f"`unpad=True`, {sequences} rows of {tokens:,} slots (one full, the others {length:,})"
        out.append(_row(label, tokens, "sdpa", ours, alone))
    shape = (arch, "sdpa", 8, 1024, 1)
    ours, own = _pair(("packed", *shape), ("own", *shape))
    out.append(_row("training step, packed 8 x 1,024", 8192, "sdpa", ours, own))
    control = _pair(("own", arch, "sdpa", 8, 1024), ("own", arch, "sdpa", 8, 1024))
    out.append(_row("A/A: own vs own, 8 x 1,024", 8192, "sdpa", *control))
    return out


SECTIONS = {
    "## A packed row at length: time and memory against the sequences' own run": (
        [
            "Llama, 4 layers, hidden 256, vocab 1000, no cache, one thread; each measurement a process of its",
            "own (peak memory: its growth over the call, which the logits of every token dominate), best of 2,",
            "A B A B. The sequences' own run is the same equal-length sequences as a plain batch with no mask",
            "(for `unpad=True`: each of its sequences alone). A packed row hands its attention layers its layout,",
            "not a length x length mask: eager and SDPA run each group of sequences of similar length on its own",
            "(`hfpatch/attention.py`). Stock's packed row is wrong (its sequences see each other) and builds the",
            "length x length mask itself; not run past 32k. An unpadded call's memory holds its own padded",
            "output besides (logits for every slot: 8 x 32,768 x 1,000 floats are 1,000 MiB).",
            "",
            "| call | tokens | attention | hfpatch or stock (s) | own (s) | time ratio | peak MiB (call / own) | memory ratio |",
            "|---|---|---|---|---|---|---|---|",
        ],
        at_length,
    ),
}


SECTIONS["## A compiled packed row: time and memory against the sequences' own compiled run"] = (
    [
        "As above, each model under `torch.compile(fullgraph=True)` (inductor; an `unpad=True` call under",
        "`torch.compile(model)`: its host read of the mask is a graph break, the packed call after it compiled on",
        "the real tokens), its first call (the compilation) not counted, peak memory from a high-water mark",
        "reset after it. A compiled packed row hands its attention layers its layout as one small tensor, which",
        "a custom op (`hfpatch::sdpa_by_sequence`) runs by sequence, as eager mode does: one graph for every",
        "stream of lengths. Stock's compiled packed row is wrong and dense. The `unpad=True` rows' reference is",
        "each sequence alone, compiled: eight calls (one of 8,192 or 16,384 tokens, seven of 1,024 or 2,048),",
        "whose fixed cost counts eight times and whose memory is the largest one's; the unpadded call holds",
        "all its real tokens at once (in a training step their activations: about 1.9x the largest alone).",
        "",
        "| call | tokens | attention | hfpatch or stock (s) | own (s) | time ratio | peak MiB (call / own) | memory ratio |",
        "|---|---|---|---|---|---|---|---|",
    ],
    compiled_at_length,
)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        what, arch, attention, sequences, length, *flags = sys.argv[2:]
        train, compiled = (bool(int(flag)) for flag in (*flags, "0", "0")[:2])
        print(json.dumps(measure(what, arch, attention, int(sequences), int(length), train, compiled)))
    elif sys.argv[1:2] == ["--release"]:  # the rows of an older release, run under it (--compiled: compiled)
        import transformers

        compiled, long = "--compiled" in sys.argv[2:], "--long" in sys.argv[2:]
        section = list(SECTIONS.values())[1 if compiled else 0]
        rows = compiled_at_length(long=long) if compiled else on_this_release()
        print(f"transformers {transformers.__version__}\n")
        print("\n".join(section[0][-2:] + rows))
    else:
        print("\n".join(SECTIONS[next(iter(SECTIONS))][0] + at_length()))
