"""What packed rows and padded batches cost with hfpatch: a packed training step (each sequence kept to
itself vs stock's leak, and vs a padded batch) and a padded batch unpadded (``apply(unpad=True)``); at
length: scale.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import hfpatch
from hfpatch.verification.tiny import tiny_model

from harness import SMALL, Sections, median_ratio, stock_if

PACKED_LENGTHS = (16, 256)  # the sequences of a packed training step: random lengths in this range


def packed_training_step(sequences: int, repeats: int = 15) -> list[str]:
    """A training step (forward and backward, no optimizer) of ``sequences`` sequences of random
    lengths packed into one row (positions restarting, as ``DataCollatorWithFlattening`` makes it):
    hfpatch (kept to its sequences) vs stock (each sequence sees the ones before it), vs the same
    sequences as a right-padded batch (hfpatch, exact too), and an A/A row (stock vs stock)."""
    model = tiny_model("llama", sizes=SMALL, attention="sdpa").train()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(
        PACKED_LENGTHS[0], PACKED_LENGTHS[1] + 1, (sequences,), generator=generator
    ).tolist()
    rows = [torch.randint(1, 1000, (n,), generator=generator) for n in lengths]
    packed = {
        "input_ids": torch.cat(rows)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "labels": torch.cat([torch.cat([torch.tensor([-100]), row[1:]]) for row in rows])[None],
    }
    longest = max(lengths)
    ids = torch.zeros(sequences, longest, dtype=torch.long)
    mask = torch.zeros(sequences, longest, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)], mask[r, : len(row)] = row, 1
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def step(kwargs: dict, stock: bool) -> Callable[[], Any]:
        def run() -> Any:
            model.zero_grad(set_to_none=True)
            with stock_if(stock):
                loss = model(**kwargs).loss
                loss.backward()
            return loss

        return run

    hfpatch_packed, stock_packed = step(packed, False), step(packed, True)
    losses = [float(run()) for run in (hfpatch_packed, stock_packed, step(padded, False))]
    out = []
    tokens = f"{sequences} of {PACKED_LENGTHS[0]}-{PACKED_LENGTHS[1]} ({sum(lengths)} tokens)"
    for label, a, b, loss_a, loss_b in (
        ("packed: hfpatch vs stock", hfpatch_packed, stock_packed, losses[0], losses[1]),
        ("hfpatch: packed vs padded", hfpatch_packed, step(padded, False), losses[0], losses[2]),
        ("A/A: stock packed vs stock packed", stock_packed, stock_packed, losses[1], losses[1]),
    ):
        ratio, ms_a, ms_b = median_ratio(a, b, repeats=repeats)
        out.append(
            f"| {label} | {tokens} | {ms_a:.0f} | {ms_b:.0f} | **{ratio:.3f}** | {loss_a:.5f} | {loss_b:.5f} |"
        )
    return out


def skewed_lengths(real_share: float, rows: int = 16, longest: int = 256, shortest: int = 16) -> list[int]:
    """``rows`` lengths from ``shortest`` to ``longest`` (one of them), their real tokens about
    ``real_share`` of ``rows x longest`` slots: ``shortest + (longest - shortest) * (i / (rows - 1)) ** k``,
    ``k`` found by bisection (a larger ``k``: more short rows)."""
    low, high = 0.01, 100.0
    for _ in range(60):
        k = (low * high) ** 0.5
        lengths = [longest] + [
            round(shortest + (longest - shortest) * (i / (rows - 1)) ** k) for i in range(rows - 1)
        ]
        low, high = (k, high) if sum(lengths) / (rows * longest) > real_share else (low, k)
    return lengths


def _saved_bytes(run: Callable[[], Any]) -> int:
    """The bytes of the tensors autograd saves for the backward pass of ``run()`` (the activations: what
    a training step's peak memory grows with), each storage counted once."""
    seen: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        run()
    return sum(seen.values())


def unpadded_batches(repeats: int = 15) -> list[str]:
    """A right-padded batch of 16 sequences (Llama 4 x 256, SDPA, vocab 1000), its real tokens a given share
    of the slots: the training step (forward, loss, backward) and the no-grad scoring call with
    ``apply(unpad=True)`` vs without, interleaved; an A/A row; each side's loss; the activations saved
    for the backward pass (the training step's memory)."""
    model = tiny_model("llama", sizes=SMALL, attention="sdpa")
    out = []
    for share in (0.27, 0.5, 0.95, 1.0):
        out += _unpadded_rows(
            model, skewed_lengths(share) if share < 1 else [256] * 16, repeats, share == 0.27
        )
    hfpatch.apply(unpad=False)
    return out


def _unpadded_rows(model: Any, lengths: list[int], repeats: int, control: bool) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n], mask[r, :n] = torch.randint(1, 1000, (n,), generator=generator), 1
    labels = ids.masked_fill(mask == 0, -100)
    losses: dict[bool, float] = {}

    def train(unpad: bool) -> Callable[[], Any]:
        def run() -> Any:
            hfpatch.apply(unpad=unpad)
            model.train()
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            losses[unpad] = loss.item()

        return run

    def score(unpad: bool) -> Callable[[], Any]:
        def run() -> Any:
            hfpatch.apply(unpad=unpad)
            model.eval()
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask).logits

        return run

    memory = {unpad: _saved_bytes(train(unpad)) for unpad in (True, False)}
    real = f"{sum(lengths)} of {ids.numel()} ({sum(lengths) / ids.numel():.0%})"
    out = []
    for label, a, b in (
        ("training step", train(True), train(False)),
        ("scoring call (no grad)", score(True), score(False)),
    ):
        ratio, ms_a, ms_b = median_ratio(b, a, repeats=repeats)  # padded / unpadded: the speed-up
        training = label.startswith("training")
        mib = f"{memory[True] / 2**20:.0f} / {memory[False] / 2**20:.0f}" if training else "-"
        loss = f"{losses[True]:.6f} / {losses[False]:.6f}" if training else "-"
        out.append(f"| {real} | {label} | {ms_b:.0f} | {ms_a:.0f} | **{ratio:.2f}x** | {loss} | {mib} |")
    if control:
        ratio, ms_a, ms_b = median_ratio(train(False), train(False), repeats=repeats)
        out.append(
            f"| {real} | A/A: padded vs padded (training) | {ms_a:.0f} | {ms_b:.0f} | {ratio:.2f} | - | - |"
        )
    return out


SECTIONS: Sections = {
    "## Packed training step: each sequence kept to itself vs stock's leak, and vs a padded batch": (
        [
            "Llama, 4 layers, hidden 256, SDPA, train mode, one thread: one step (forward, loss, backward;",
            f"no optimizer) of 16 sequences of random lengths {PACKED_LENGTHS[0]}-{PACKED_LENGTHS[1]},",
            "packed into one row with positions restarting (`DataCollatorWithFlattening`'s layout) or",
            "right-padded into a batch. hfpatch keeps each packed sequence to itself (a mask by sequence);",
            "stock lets every sequence attend to the ones before it (its loss is not the sequences' own).",
            "Interleaved, median of 15 ratios; the last two columns are each side's loss (hfpatch's packed",
            "and padded losses agree: the same tokens, the same mean).",
            "",
            "| sides | sequences | first (ms) | second (ms) | ratio | loss, first | loss, second |",
            "|---|---|---|---|---|---|---|",
        ],
        lambda: packed_training_step(16),
    ),
    "## A padded batch at the cost of its real tokens: `apply(unpad=True)`": (
        [
            "Llama, 4 layers, hidden 256, vocab 1000, SDPA, one thread: 16 right-padded sequences up to 256",
            "tokens (one of 256, the others shorter: `skewed_lengths`), their real tokens the share the first",
            "column says. The training step (forward, loss, backward; no optimizer; dropout off) and the",
            "no-grad scoring call (eval mode, its default cache returned) with `apply(unpad=True)` and",
            "without, interleaved, median of 15; the ratio is padded / unpadded (the speed-up). A batch with",
            "fewer than 15 % pads is left padded (`hfpatch.unpad.WORTH`). Loss: unpadded / padded. Memory:",
            "the activations autograd saves for the backward pass, unpadded / padded (MiB).",
            "",
            "| real tokens | call | unpadded (ms) | padded (ms) | speed-up | loss | saved activations (MiB) |",
            "|---|---|---|---|---|---|---|",
        ],
        lambda: unpadded_batches(),
    ),
}
