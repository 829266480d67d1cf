"""What watching calls costs: ``hfpatch audit`` and ``hfpatch.shadow`` on a decode step and a scoring call,
next to what the patch itself adds."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

import torch

import hfpatch
from hfpatch._compat import cache_name, output_cache

from harness import Paired, Sections, interleaved, padded_batch, seconds, small_model


def watching(batch: int, prompt: int, steps: int = 301) -> list[str]:
    """What ``hfpatch audit`` and ``hfpatch.shadow`` add to a call, next to what the patch itself adds:
    a decode step after a right-padded prompt (holes; the cache cropped back after each call) and a
    left-padded scoring call without a cache. Each row interleaves its two sides, the watcher
    registered for its side only (outside the timing); the A/A row runs stock on both sides."""
    from hfpatch.auditing import AuditReport
    from hfpatch.judge import Watcher as AuditWatcher
    from hfpatch.shadowing import ShadowReport
    from hfpatch.shadowing import _Watcher as ShadowWatcher

    model = small_model("llama")
    name = cache_name(model)
    ids, left = padded_batch(batch, prompt)
    right = left.flip(-1)
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, attention_mask=right, use_cache=True))
    decode = {"input_ids": torch.ones(batch, 1, dtype=torch.long), name: cache, "use_cache": True,
              "attention_mask": torch.cat([right, right.new_ones(batch, 1)], 1)}  # fmt: skip
    scoring = {"input_ids": ids, "attention_mask": left}
    stock, patch = hfpatch.unpatched, contextlib.nullcontext
    audit = ("audit", stock, lambda: AuditWatcher(AuditReport()))
    sides = {
        "hfpatch applied vs stock (the patch itself)": (("hfpatch", patch, None), ("stock", stock, None)),
        "audit (stock results) vs stock": (audit, ("stock", stock, None)),
        "shadow 0 % vs hfpatch": (("shadow", patch, lambda: ShadowWatcher(ShadowReport(), 0.0, None, 0)),
                                  ("hfpatch", patch, None)),
        "shadow 1 % vs hfpatch": (("shadow", patch, lambda: ShadowWatcher(ShadowReport(), 0.01, None, 0)),
                                  ("hfpatch", patch, None)),
        "shadow 100 % vs hfpatch": (("shadow", patch, lambda: ShadowWatcher(ShadowReport(), 1.0, None, 0)),
                                    ("hfpatch", patch, None)),
        "A/A: stock vs stock": (("stock", stock, None), ("stock", stock, None)),
    }  # fmt: skip
    held = hfpatch.engine.hold()
    rows = []
    try:
        for regime, kwargs, after in (
            (f"decode step, {batch} x 1 after {prompt} (holes)", decode, lambda: cache.crop(-1)),
            (f"scoring, {batch} x {prompt} (left padding, no cache)", scoring, None),
        ):
            for label, pair in sides.items():
                if "100 %" in label and after is not None:
                    continue  # a cropped cache is let go: the shadow checks uncached calls and followed caches
                paired = _watched_pair(model, kwargs, pair, after, steps)
                ratio, low, high = paired.ratio()
                rows.append(f"| {regime} | {label} | {paired.ms(0):.3f} | {paired.ms(1):.3f} "
                            f"| **{ratio:.3f}** ({low:.2f}-{high:.2f}) |")  # fmt: skip
    finally:
        hfpatch.engine.release(held)
    return rows


def _watched_pair(model: Any, kwargs: dict, pair: tuple, after: Optional[Callable], steps: int) -> Paired:
    """Interleaved calls of two sides, each (label, context, make its watcher or None)."""
    from hfpatch.observers import unwatch, watch

    watchers = [make() if make is not None else None for _, _, make in pair]

    def timed(side: int) -> float:
        context, watcher = pair[side][1], watchers[side]
        if watcher is not None:
            watch(watcher)
        try:
            with torch.no_grad(), context():
                spent = seconds(lambda: model(**kwargs))
        finally:
            if watcher is not None:
                unwatch(watcher)
            if after is not None:
                after()
        return spent

    return interleaved(timed, steps=steps)


SECTIONS: Sections = {
    "## Watching calls: `hfpatch audit` and `hfpatch.shadow`": (
        [
            "Llama, 4 layers, hidden 256, SDPA. Each row interleaves two sides on the same model and",
            "inputs; its watcher (the audit's, or a shadow's at the rate shown) is registered for its side",
            "only, outside the timing. The audit runs stock and judges each call; the shadow at 100 %",
            "re-runs every row alone on every padded uncached call (a cropped cache is let go, so the decode",
            "regime has no 100 % row). The A/A row runs stock on both sides: the noise floor.",
            "",
            "| regime | sides | first (ms) | second (ms) | ratio (interquartile range) |",
            "|---|---|---|---|---|",
        ],
        lambda: watching(8, 128),
    ),
}
