"""What every benchmark question shares: the run's settings, the small models and padded batches the
questions measure, and the interleaved timing (A, B, A, B, ...) whose median ratio each comparison reports."""

from __future__ import annotations

import contextlib
import ctypes
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

import hfpatch
from hfpatch.verification.tiny import tiny_model

REPEATS = 101
DECODE_STEPS = 1001  # one step's ratio varies by ~5 %: 1001 steps pin the median to ~0.2 %
COLD_CALLS = 301  # hfpatch's own work timed right after a decode step
STATIC_CYCLE = 100  # a StaticCache row re-runs its prompt (outside the timing) every 100 steps
ROOT = Path(__file__).resolve().parent


SMALL = {
    "vocab_size": 1000, "hidden_size": 256, "n_embd": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "n_layer": 4, "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 4,
    "head_dim": 64, "max_position_embeddings": 1024, "n_positions": 1024, "initializer_range": 0.02,
}  # fmt: skip
ARCHS = ("gpt2", "llama")  # the rows the targets are stated for: one flagship of each family


Sections = dict[str, tuple[list[str], Callable[[], list[str]]]]  # heading: (text, what measures its rows)


def _status_mib(field: str) -> float:
    kib = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)
    return int(kib) / 1024


def reset_peak() -> float:
    """The process's resident MiB now, with its high-water mark brought down to it (Linux) and the heap's
    free memory handed back first (glibc): what a call grows past this, read by :func:`peak`, is its own,
    even after a compilation whose peak was higher (``ru_maxrss`` never comes down)."""
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def peak() -> float:
    """The process's resident high-water mark (MiB) since :func:`reset_peak`."""
    return _status_mib("VmHWM")


def small_model(arch: str) -> Any:
    """4 layers, hidden 256: the size the targets are stated for."""
    return tiny_model(arch, sizes=SMALL)


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


class Paired(NamedTuple):
    """The seconds of each interleaved pair of calls: side 0 (``a``) and side 1 (``b``)."""

    a: list[float]
    b: list[float]

    def ms(self, side: int) -> float:
        return statistics.median((self.a, self.b)[side]) * 1e3

    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.a, self.b)]

    def ratio(self) -> tuple[float, float, float]:
        """The median of the per-pair ratios, and their interquartile range."""
        low, _, high = statistics.quantiles(self.ratios(), n=4)
        return statistics.median(self.ratios()), low, high


def interleaved(
    timed: Callable[[int], float],
    steps: int = DECODE_STEPS,
    before: Optional[Callable[[], None]] = None,
    after: Optional[Callable[[], None]] = None,
) -> Paired:
    """``steps`` pairs of ``timed(side)`` (each returns the seconds of its own model call, so that what it
    does around the call is not timed), in alternating order, after 3 warm-up pairs; ``before`` and
    ``after`` run around each pair, untimed."""
    paired = Paired([], [])
    for i in range(steps + 3):
        if before is not None:
            before()
        pair = [0.0, 0.0]
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            pair[side] = timed(side)
        if after is not None:
            after()
        if i >= 3:  # warm-up
            paired.a.append(pair[0])
            paired.b.append(pair[1])
    return paired


def seconds(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def stock_if(stock: bool) -> Any:
    return hfpatch.unpatched() if stock else contextlib.nullcontext()
