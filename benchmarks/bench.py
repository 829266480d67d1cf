"""hfpatch benchmarks: what the patch costs, measured side by side in one run.

    python benchmarks/bench.py            # writes benchmarks/RESULTS.md and prints it

Every comparison interleaves its variants call by call (A, B, A, B, ...) and reports the median of
the per-repeat ratios, so drift on a noisy machine hits both sides alike. No result here is a test:
timings on shared CPUs are noisy, and the tests assert numbers, never times.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

import hfpatch
from hfpatch.positions import positions_from_mask

REPEATS = 41
ROOT = Path(__file__).resolve().parent


def small_model(arch: str) -> Any:
    """4 layers, hidden 256: the size the targets are stated for."""
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=1000, n_positions=1024, n_embd=256, n_layer=4, n_head=4)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def padded_batch(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (batch, length), generator=generator)
    pads = torch.randint(0, length // 2, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] >= pads[:, None]).long()  # left padding
    return ids, mask


def median_ratio(
    a: Callable[[], Any], b: Callable[[], Any], repeats: int = REPEATS
) -> tuple[float, float, float]:
    """Median of time(a)/time(b) over interleaved repeats, with both medians (ms)."""
    for _ in range(3):
        a(), b()
    times_a, times_b, ratios = [], [], []
    for i in range(repeats):
        pair = []
        for fn in (a, b) if i % 2 == 0 else (b, a):  # alternate the order too
            start = time.perf_counter()
            fn()
            pair.append((fn, time.perf_counter() - start))
        ta = next(t for fn, t in pair if fn is a)
        tb = next(t for fn, t in pair if fn is b)
        times_a.append(ta)
        times_b.append(tb)
        ratios.append(ta / tb)
    return statistics.median(ratios), statistics.median(times_a) * 1e3, statistics.median(times_b) * 1e3


def eager_padded_forward(batch: int, length: int) -> list[str]:
    """Derived positions vs the same call with positions passed by hand (both patched)."""
    return [_eager_padded_row(arch, batch, length) for arch in ("gpt2", "llama")]


def _eager_padded_row(arch: str, batch: int, length: int) -> str:
    model = small_model(arch)
    ids, mask = padded_batch(batch, length)
    by_hand = positions_from_mask(mask)

    def derived() -> Any:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask)

    def explicit() -> Any:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=by_hand)

    ratio, ms_a, ms_b = median_ratio(derived, explicit)
    return f"| {arch} | {batch} x {length} | {ms_a:.2f} | {ms_b:.2f} | **{ratio:.3f}** |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "RESULTS.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: steadier timings on a 2-core machine
    hfpatch.apply()
    import transformers

    lines = [
        "# hfpatch benchmark results",
        "",
        "Made by `python benchmarks/bench.py` on "
        f"{platform.machine()} ({platform.processor() or 'cpu'}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, one torch thread, "
        f"{REPEATS} interleaved repeats, median of per-repeat ratios.",
        "",
        "## Eager forward on a padded batch: derived positions vs positions passed by hand",
        "",
        "Target: ratio <= 1.01 (issue 4), <= 1.02 (issue 2). Both calls go through the patched forward;",
        "the first lets hfpatch derive `position_ids` from the mask, the second passes them.",
        "",
        "| model (4 layers, hidden 256) | batch x tokens | derived (ms) | by hand (ms) | ratio |",
        "|---|---|---|---|---|",
        *eager_padded_forward(8, 128),
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
