"""What batching buys for scoring with hfpatch: completions after one shared prompt (its cache reused vs
each row from scratch), and many padded rows scored in batches vs one row at a time on stock."""

from __future__ import annotations

from typing import Any

import torch

import hfpatch
from hfpatch._compat import cache_name, output_cache

from harness import ARCHS, Sections, median_ratio, small_model


def scoring(prompt_len: int, completions: int, completion_len: int) -> list[str]:
    """The original use case: score completions after one shared prompt. Reuse: the prompt runs once,
    its KV cache is repeated per completion, and the completions run left-padded (holes between
    prompt and completion: stock transformers gets their positions wrong) in one cached call.
    Scratch (the reference): prompt + completion, right-padded, in one call per batch."""
    model = small_model("llama")
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 1000, (1, prompt_len), generator=generator)
    lengths = torch.randint(1, completion_len + 1, (completions,), generator=generator)
    tails = torch.randint(1, 1000, (completions, completion_len), generator=generator)
    right = torch.arange(completion_len)[None, :] < lengths[:, None]  # real tokens, right-padded
    left = right.flip(-1)  # the same tokens, left-padded
    left_tails = torch.zeros_like(tails)
    left_tails[left] = tails[right]
    ones = torch.ones(completions, prompt_len, dtype=torch.long)

    def reuse() -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            cache = output_cache(out)
            cache.batch_repeat_interleave(completions)
            mask = torch.cat([ones, left.long()], dim=1)
            return model(input_ids=left_tails, attention_mask=mask, **{cache_name(model): cache}).logits

    def scratch() -> torch.Tensor:
        with torch.no_grad():
            full = torch.cat([prompt.expand(completions, -1), tails * right], dim=1)
            mask = torch.cat([ones, right.long()], dim=1)
            return model(input_ids=full, attention_mask=mask).logits[:, prompt_len:]

    diff = (reuse()[left] - scratch()[right]).abs().max().item()
    with hfpatch.unpatched():  # the same comparison on stock: the completions' positions go wrong
        stock_diff = (reuse()[left] - scratch()[right]).abs().max().item()
    ratio, ms_scratch, ms_reuse = median_ratio(scratch, reuse, repeats=31)
    return [
        f"| {completions} x {completion_len} after {prompt_len} | {ms_reuse:.1f} | {ms_scratch:.1f} | "
        f"**{ratio:.2f}x** | {diff:.1e} | {stock_diff:.1e} |"
    ]


def batched_scoring(rows: int, batch: int, shortest: int, longest: int, threads: int) -> list[str]:
    """Why batching matters: the log-probabilities of many short rows of different lengths, scored in
    padded batches with hfpatch (rows sorted by length, as length-grouped batching does), against one
    row at a time on stock (the only correct way there), the same model, interleaved, on ``threads``
    CPU threads; the largest |log-prob| difference between the two, and stock's own batches."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [_batched_scoring_row(arch, rows, batch, shortest, longest) for arch in ARCHS]
    finally:
        torch.set_num_threads(saved)


def _batched_scoring_row(arch: str, rows: int, batch: int, shortest: int, longest: int) -> str:
    model = small_model(arch)
    generator = torch.Generator().manual_seed(0)
    lengths = sorted(torch.randint(shortest, longest + 1, (rows,), generator=generator).tolist())
    seqs = [torch.randint(1, 1000, (n,), generator=generator) for n in lengths]
    alone = _scored_alone(model, seqs)
    exact = _worst(_scored_in_batches(model, seqs, batch), alone)
    with hfpatch.unpatched():
        stock = _worst(_scored_in_batches(model, seqs, batch), alone)
    speedup, ms_alone, ms_batched = median_ratio(
        lambda: _scored_alone(model, seqs), lambda: _scored_in_batches(model, seqs, batch), repeats=7
    )
    return (
        f"| {arch} | {rows} rows of {shortest}-{longest} tokens, batches of {batch} | {ms_batched:.0f} "
        f"| {ms_alone:.0f} | **{speedup:.1f}x** | {exact:.1e} | {stock:.1e} |"
    )


def _scored_alone(model: Any, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's log-probabilities, the row alone, unpadded, on stock."""
    with torch.no_grad(), hfpatch.unpatched():
        return [model(input_ids=seq[None]).logits[0].log_softmax(-1) for seq in seqs]


def _scored_in_batches(model: Any, seqs: list[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """Each row's log-probabilities at its real tokens, scored in left-padded batches of ``batch``."""
    scored = []
    for start in range(0, len(seqs), batch):
        group = seqs[start : start + batch]
        width = max(len(seq) for seq in group)
        ids = torch.stack([torch.cat([seq.new_zeros(width - len(seq)), seq]) for seq in group])
        mask = (
            torch.arange(width)[None, :] >= torch.tensor([width - len(seq) for seq in group])[:, None]
        ).long()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)
        scored += [logits[i, width - len(seq) :] for i, seq in enumerate(group)]
    return scored


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


SECTIONS: Sections = {
    "## Scoring many padded rows: batched with hfpatch vs one row at a time on stock": (
        [
            "The log-probabilities of every token of 256 rows of 8-64 tokens (random lengths, sorted by",
            "length into batches of 32, as length-grouped batching does), 4 layers, hidden 256, eager, on",
            "both CPU threads: left-padded batches with hfpatch, against each row alone on stock (the only",
            "way stock is right for an absolute-position model), interleaved, median of 7. The last two",
            "columns: the largest |log-prob| difference from the rows alone, hfpatch's batches and stock's.",
            "On one CPU thread a call is mostly compute, so batching gains less; on an accelerator, where a",
            "small call is mostly fixed overhead, it gains more (neither measured here).",
            "",
            "| model | rows | batched, hfpatch (ms) | one row at a time, stock (ms) | speedup "
            "| max abs diff, hfpatch | stock batched |",
            "|---|---|---|---|---|---|---|",
        ],
        lambda: batched_scoring(256, 32, 8, 64, threads=2),
    ),
    "## Scoring completions after a shared prompt (the original use case)": (
        [
            "Llama, 4 layers, hidden 256, eager. Reuse: the prompt runs once, its KV cache is repeated for",
            "every completion, and the left-padded completions (pads between prompt and completion) run in",
            "one cached call, positions derived by hfpatch. Scratch (the reference): prompt + right-padded",
            "completion for every row in one call. Max |logit difference| at the real completion tokens",
            "between the two, with hfpatch and on stock transformers.",
            "",
            "| completions | reuse (ms) | scratch (ms) | speedup | max abs diff, hfpatch | on stock |",
            "|---|---|---|---|---|---|",
        ],
        lambda: scoring(512, 16, 8),
    ),
}
