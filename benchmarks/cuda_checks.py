"""Checks that need a CUDA GPU; prints one line each and exits 1 if one fails (2 without a GPU).

    python benchmarks/cuda_checks.py

1. CUDA graphs: greedy decoding with a StaticCache and implicit positions (hfpatch derives them from
   the mask) under ``torch.compile(mode="reduce-overhead")`` gives the same tokens as eager.
   transformers PR #29221 was closed because positions computed inside ``forward`` gave wrong
   generations under CUDA graphs; this is the check that hfpatch does not repeat that.
2. No device sync: hfpatch's own work for a decode step (the patched forward in front of a no-op
   model, so transformers' own syncs do not count), under ``torch.cuda.set_sync_debug_mode("error")``,
   with a DynamicCache, a StaticCache with a full-length mask, and a passed ``cache_position``.
"""

from __future__ import annotations

import logging
import sys
import types

import torch

import hfpatch
from hfpatch.forward import make_forward
from hfpatch.plans import read_plan
from hfpatch.tiny import FLAGSHIPS, VOCAB, tiny_model
from hfpatch.verification import cache_name, new_static_cache


def greedy(
    model, forward, prompt: torch.Tensor, mask: torch.Tensor, steps: int, capacity: int
) -> torch.Tensor:
    """Prefill eagerly, then ``steps`` single-token calls of ``forward`` with a full-length mask."""
    batch, length = prompt.shape
    cache = new_static_cache(model, batch, capacity, device="cuda")
    full = torch.zeros(batch, capacity, dtype=torch.long, device="cuda")
    full[:, :length] = mask
    name = cache_name(model)
    with torch.no_grad():
        out = model(input_ids=prompt, attention_mask=full, use_cache=True, **{name: cache})
        tokens = [out.logits[:, -1:].argmax(-1)]
        for i in range(steps):
            full[:, length + i] = 1
            out = forward(input_ids=tokens[-1], attention_mask=full.clone(), use_cache=True, **{name: cache})
            tokens.append(out.logits[:, -1:].argmax(-1).clone())
    return torch.cat(tokens, dim=1)


class _Skipped(logging.Handler):
    """Collects inductor's "skipping cudagraphs" warnings (a graph that then runs without CUDA graphs)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "skipping cudagraphs" in record.getMessage():
            self.reasons.append(record.getMessage().splitlines()[0])


def cuda_graphs(arch: str) -> bool:
    model = tiny_model(arch).cuda()
    prompt = torch.randint(1, VOCAB, (3, 10), device="cuda")
    mask = torch.ones(3, 10, dtype=torch.long, device="cuda")
    mask[0, :4] = 0  # left padding
    mask[1, :2] = 0
    eager = greedy(model, model, prompt, mask, steps=24, capacity=48)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    skipped = _Skipped()
    logging.getLogger("torch._inductor").addHandler(skipped)
    try:
        graphs = greedy(model, compiled, prompt, mask, steps=24, capacity=48)
    finally:
        logging.getLogger("torch._inductor").removeHandler(skipped)
    same = torch.equal(eager, graphs)
    used = f"CUDA graphs skipped: {skipped.reasons[0]}" if skipped.reasons else "CUDA graphs used"
    print(f"{arch}: reduce-overhead tokens {'==' if same else '!='} eager (25 steps x 3 rows); {used}")
    return same and not skipped.reasons


def no_sync(arch: str) -> bool:
    """hfpatch's own work on a decode step, in front of a no-op model, raises on any device sync."""
    model = tiny_model(arch).cuda()
    base = model.base_model
    adapter = hfpatch.registry()[arch]
    plan = read_plan(adapter, type(base).forward, type(base))
    own = make_forward(adapter, lambda self, **kwargs: kwargs, plan, types.SimpleNamespace(pinned=True))
    name = cache_name(model)
    prompt = torch.randint(1, VOCAB, (2, 6), device="cuda")
    mask = torch.ones(2, 6, dtype=torch.long, device="cuda")
    mask[0, :2] = 0
    token = torch.ones(2, 1, dtype=torch.long, device="cuda")
    static = new_static_cache(model, 2, 16, device="cuda")
    full = torch.zeros(2, 16, dtype=torch.long, device="cuda")
    full[:, :6] = mask
    full[:, 6] = 1
    with torch.no_grad():
        dynamic = model(input_ids=prompt, attention_mask=mask, use_cache=True).past_key_values
        model(
            input_ids=prompt, attention_mask=full[:, :6], use_cache=True, **{name: static}
        )  # starts the count
    steps = {
        "DynamicCache, mask of past + new": dict(
            attention_mask=torch.cat([mask, token], 1), **{name: dynamic}
        ),
        "StaticCache, full-length mask": dict(attention_mask=full, **{name: static}),
        "StaticCache, cache_position passed": dict(
            attention_mask=full, cache_position=torch.tensor([6], device="cuda"), **{name: static}
        ),
    }
    ok = True
    for what, kwargs in steps.items():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            own(base, input_ids=token, use_cache=True, **kwargs)
            verdict = "no sync"
        except RuntimeError as exc:
            verdict, ok = f"SYNC: {str(exc).splitlines()[0][:150]}", False
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"{arch}: hfpatch's own work, decode step, {what}: {verdict}")
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: these checks need a GPU")
        return 2
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}"
    )
    hfpatch.apply()
    ok = True
    for arch in (*FLAGSHIPS, "mistral"):  # mistral: a sliding window of 4 tokens (windows by position)
        ok &= no_sync(arch)
        ok &= cuda_graphs(arch)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
