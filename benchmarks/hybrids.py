"""What a hybrid's packed and unpadded training step costs (hfpatch.mixers): Qwen3.5 (gated delta rule and
attention layers), eight sequences of skewed lengths, 4k-16k tokens, against its padded step and against
its sequences each run alone. Every measurement runs in a process of its own (peak memory is the resident
high-water mark's growth over the step, the mark reset before it), one torch thread, best of 2; the two
variants of a row run back to back, A B A B, so that drift hits both; an A/A row measures the noise.

    python benchmarks/hybrids.py                                  # the table (about 10 minutes)
    python benchmarks/hybrids.py --one packed qwen3_5_text 4096    # one measurement: its JSON line
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
SHARES = (0.30, 0.05, 0.10, 0.15, 0.05, 0.20, 0.10, 0.05)  # of the tokens: a batch 42 % real when padded
TOKENS = (4096, 8192, 16384)


def lengths_of(tokens: int) -> list[int]:
    made = [max(1, int(share * tokens)) for share in SHARES]
    made[0] += tokens - sum(made)
    return made


def measure(what: str, arch: str, tokens: int) -> dict:
    """One training step (forward and backward, labels, no cache) of ``what``: ``packed`` (hfpatch, the
    sequences in one row, positions restarting), ``stock`` (the same row on stock: each sequence's state
    runs on into the next), ``padded`` (hfpatch, the sequences as a right-padded batch), ``unpad`` (that
    batch under ``apply(unpad=True)``), ``alone`` (each sequence its own step, one after the other); its
    seconds and MiB."""
    import torch

    torch.set_num_threads(1)
    import hfpatch

    if what != "stock":
        hfpatch.apply(unpad=what == "unpad")
    sys.path.insert(0, str(HERE))
    import transformers

    from hfpatch.verification.tiny import tiny_config

    from harness import SMALL, peak, reset_peak

    sizes = {
        **SMALL,
        "max_position_embeddings": 1 << 16,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
    }
    config = tiny_config(arch, {**sizes, "num_hidden_layers": 2})  # (its overrides: one layer of each kind)
    layers = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2}
    config = type(config)(**{**config.to_dict(), **layers})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().train()
    generator = torch.Generator().manual_seed(0)
    lengths = lengths_of(tokens)
    sequences = [torch.randint(1, 1000, (n,), generator=generator) for n in lengths]
    if what in ("packed", "stock"):
        row = torch.cat(sequences)[None]
        calls = [{"input_ids": row, "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}]
    elif what in ("padded", "unpad"):
        ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence(
            [torch.ones(n, dtype=torch.long) for n in lengths], batch_first=True
        )
        calls = [{"input_ids": ids, "attention_mask": mask}]
    else:  # alone
        calls = [{"input_ids": s[None]} for s in sequences]
    for call in calls:
        call["use_cache"] = False
        labels = call["input_ids"].clone()
        if "attention_mask" in call:
            labels[call["attention_mask"] == 0] = -100
        call["labels"] = labels
    before = reset_peak()
    best = float("inf")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for call in calls:
            model(**call).loss.backward()
        best = min(best, time.perf_counter() - start)
    grown = peak() - before
    return {"seconds": best, "mib": grown}


def _run(*args: Any) -> dict:
    """:func:`measure` in a process of its own."""
    command = [sys.executable, str(Path(__file__)), "--one", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"seconds": float("nan"), "mib": float("nan"), "error": (done.stderr or "")[-300:]}
    return json.loads(lines[-1])


def _pair(first: tuple, second: tuple) -> tuple[dict, dict]:
    """Two measurements, A B A B: the better of each."""
    runs = [(_run(*first), _run(*second)) for _ in range(2)]
    best = [min((r[i] for r in runs), key=lambda m: m["seconds"]) for i in (0, 1)]
    return best[0], best[1]


def _row(label: str, tokens: int, ours: dict, theirs: dict) -> str:
    return (
        f"| {label} | {tokens:,} | {ours['seconds']:.2f} | {theirs['seconds']:.2f} | "
        f"**{ours['seconds'] / theirs['seconds']:.2f}x** | {ours['mib']:,.0f} / {theirs['mib']:,.0f} |"
    )


def table(arch: str = "qwen3_5_text") -> list[str]:
    out = []
    for tokens in TOKENS:
        for what, against in (
            ("packed", "alone"),
            ("unpad", "alone"),
            ("packed", "padded"),
            ("unpad", "padded"),
        ):
            ours, theirs = _pair((what, arch, tokens), (against, arch, tokens))
            label = f"{'packed row' if what == 'packed' else '`unpad=True`'} vs {against}"
            out.append(_row(label, tokens, ours, theirs))
        stock, alone = _pair(("stock", arch, tokens), ("alone", arch, tokens))
        out.append(_row("stock's packed row (leaks) vs alone", tokens, stock, alone))
    control = _pair(("alone", arch, TOKENS[0]), ("alone", arch, TOKENS[0]))
    out.append(_row("A/A: alone vs alone", TOKENS[0], *control))
    return out


HEADER = [
    "Qwen3.5 text model, 4 layers (gated delta rule and attention alternating), hidden 256, vocab 1000, SDPA,",
    "one thread, a training step (forward, backward, labels, no cache) of eight sequences of skewed lengths",
    "(30 %, 20 %, 15 %, 10 %, 10 %, 5 %, 5 %, 5 % of the tokens; padded, 42 % of the slots are real). Each",
    "measurement a process of its own, best of 2, A B A B. *alone*: each sequence its own step, one after",
    "the other (the exact reference); *padded*: the right-padded batch with hfpatch (its state layers run",
    "each row's real tokens). Stock's packed row is wrong (each sequence's state runs on into the next).",
    "",
    "| step | tokens | hfpatch or stock (s) | reference (s) | time ratio | peak MiB (step / reference) |",
    "|---|---|---|---|---|---|",
]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        what, arch, tokens = sys.argv[2:5]
        print(json.dumps(measure(what, arch, int(tokens))))
    else:
        print("\n".join(HEADER + table()))
