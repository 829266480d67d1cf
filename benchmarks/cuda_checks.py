"""Checks that need a CUDA GPU; prints one line each and exits 1 if one fails (2 without a GPU).

    python benchmarks/cuda_checks.py            # all
    python benchmarks/cuda_checks.py seq2seq    # only 3.
    python benchmarks/cuda_checks.py attention  # only 4.
    python benchmarks/cuda_checks.py unpad      # only 5.
    python benchmarks/cuda_checks.py precision  # only 6.
    python benchmarks/cuda_checks.py length     # only 7.
    python benchmarks/cuda_checks.py hybrids    # only 8.
    python benchmarks/cuda_checks.py compiled   # only 9.

1. CUDA graphs: greedy decoding with a StaticCache and implicit positions (hfpatch derives them from
   the mask) under ``torch.compile(mode="reduce-overhead")`` gives the same tokens as eager.
   transformers PR #29221 was closed because positions computed inside ``forward`` gave wrong
   generations under CUDA graphs; this is the check that hfpatch does not repeat that.
2. No device sync: hfpatch's own work for a decode step (the patched forward in front of a no-op
   model, so transformers' own syncs do not count), under ``torch.cuda.set_sync_debug_mode("error")``,
   with a DynamicCache, a StaticCache with a full-length mask, and a passed ``cache_position``.
3. Encoder-decoder decoders on the GPU (one per seq2seq family: a position table, a table past the
   pad id, a T5 relative bias made per row, decoder position ids): a right-padded decoder prefix
   continued by one token equals each row alone (fp32, TF32 off), and the decode step makes as many
   device syncs with hfpatch as on stock (counted under ``set_sync_debug_mode("warn")``: the model's
   own syncs count on both sides).
4. The attention paths on the GPU: SDPA on CUDA and the real FlashAttention-2 (where ``flash_attn`` is
   installed; transformers' unpadding, varlen and packed code), with Llama and GPT-2: left padding in one
   call, a right-padded cached prefix continued by 1 and by 3 tokens, a row packing three sequences with
   no mask, with an all-ones mask and given by its lengths (the collator's flash kwargs); Mistral with a
   window of 4 past a right-padded cached prefix. Each real token against its sequence alone (fp32 for
   SDPA, bf16's tolerance for FlashAttention-2), or, where hfpatch says it does not keep a packed row, its
   warning given. tests/test_flash.py runs the same integration on the CPU with kernels written in torch.
   Prints what it measured.
5. ``apply(unpad=True)`` on the GPU, SDPA and FlashAttention-2: the training step and the no-grad scoring
   call of 16 right-padded sequences (Llama, 4 layers x 256, 27 % of the slots real tokens, as
   benchmarks/RESULTS.md's CPU rows), unpadded vs padded: the loss (equal within 1e-5 in fp32 SDPA; bf16's
   tolerance for FlashAttention-2) and the speed-up (CUDA events, median of 11; printed, not checked).
6. Mixed precision on the GPU: ``torch.autocast("cuda", bf16 / fp16)`` over fp32 weights, and bf16
   weights, with SDPA (and FlashAttention-2 where installed, bf16): a packed row of three sequences and
   ``apply(unpad=True)`` on a right-padded batch, each sequence against itself alone in the same regime,
   at the regime's tolerance (hfpatch/tolerances.py), and a training step under autocast that runs
   (tests/test_precision.py runs the same on the CPU).
7. A packed row at length on the GPU (benchmarks/scale.py's rows): Llama (4 layers x 256), bf16, SDPA, rows
   of 8 x 512 to 8 x 16,384 tokens packed, against the sequences' own batch (no mask) and against torch's
   ``varlen_attn`` over the same layout (the attention alone, where torch has it: CUDA, bf16/fp16): time
   (CUDA events, median of 5) and peak memory (``max_memory_allocated``), and each sequence's logits
   against its own batch row at bf16's tolerance; and its device syncs (``set_sync_debug_mode("warn")``)
   at most one more than the sequences' own batch's (the call's one host read).
8. Models whose layers carry a state (hfpatch.mixers) on the GPU: Qwen3.5 (gated delta rule), LFM2 (short
   convolution), Mamba (selective SSM, no attention), Nemotron-H (Mamba2), RWKV and xLSTM (their state
   handed to the layers), fp32, TF32 off, on
   transformers' torch paths (``USE_HUB_KERNELS=0``; what a device without fla, causal-conv1d and
   mamba_ssm runs): a row packing three sequences (no mask, the collator's ``cu_seq_lens_*`` and its
   ``seq_idx``), a right-padded cached prefix continued by 1 and by 3 tokens, left padding in one call, and
   ``apply(unpad=True)``'s prefill and one step, each real token against its sequence alone; a packed
   call's device syncs at most one more than its sequences' own batch's. Where fla / causal_conv1d /
   mamba_ssm import, transformers' own kernel path given the lengths runs beside it: its result against
   the sequences alone and both times (printed, not checked).
9. A compiled packed row on the GPU: Llama (4 layers x 256), bf16, SDPA, ``torch.compile(fullgraph=True)``
   (inductor), rows of 8 x 1,024 and 8 x 4,096 tokens packed against the same model compiled on the
   sequences' own batch: time (CUDA events, median of 5, the compilation not counted), peak memory, each
   sequence's logits at bf16's tolerance, and its device syncs at most one more a layer type than the own
   batch's (the custom op reads the layout once a call: ``hfpatch::sdpa_by_sequence``); a compiled
   ``apply(unpad=True)`` call (``torch.compile(model)``: its host read a graph break) of 8 rows of 8 x 1,024
   and 8 x 4,096 slots, one full, against its sequences each run alone compiled (time, memory, logits at
   bf16's tolerance, zeros at the pads, device syncs at most two more); and a compiled training step (fp32,
   TF32 off) whose loss equals the sequences' own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings

import torch

import hfpatch
from hfpatch._compat import cache_name, new_static_cache, output_cache
from hfpatch._context import Pin
from hfpatch.forward import make_forward
from hfpatch.plans import read_plan
from hfpatch.verification.result import TOLERANCE
from hfpatch.verification.scenarios import encoder_input
from hfpatch.verification.tiny import PAD, VOCAB, tiny_model, tiny_seq2seq


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
    pin = Pin(adapter.arch)
    pin.pinned = True
    own = make_forward(adapter, lambda self, **kwargs: kwargs, plan, pin)
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


def _syncs(call) -> tuple[object, int]:
    """``call()``'s result and how many device syncs it made."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def seq2seq_step(arch: str) -> bool:
    """A right-padded decoder prefix (rows of 4 and 2 tokens) continued by one token, on the GPU."""
    model = tiny_seq2seq(arch).cuda()
    encoder = encoder_input(model, 2).cuda()
    rows = [[11, 12, 13, 14, 15], [21, 22, 23]]
    prefix = torch.tensor([rows[0][:4], rows[1][:2] + [PAD, PAD]], device="cuda")
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], device="cuda")
    step = torch.tensor([[rows[0][4]], [rows[1][2]]], device="cuda")
    full = torch.cat([mask, torch.ones_like(step)], 1)
    source = {model.main_input_name: encoder}

    def continued() -> tuple[list[torch.Tensor], int]:
        """Each row's real-token logits through the two cached calls, and the syncs of the second."""
        with torch.no_grad():
            first = model(**source, decoder_input_ids=prefix, decoder_attention_mask=mask)
            cache = {cache_name(model): output_cache(first), "use_cache": True}
            last, syncs = _syncs(
                lambda: model(**source, decoder_input_ids=step, decoder_attention_mask=full, **cache)
            )
        logits = first.logits, last.logits
        return [torch.cat([logits[0][0], logits[1][0]]), torch.cat([logits[0][1, :2], logits[1][1]])], syncs

    with hfpatch.patched():
        got, patched_syncs = continued()
    with hfpatch.unpatched(), torch.no_grad():
        _, stock_syncs = continued()
        alone = [
            model(**{model.main_input_name: encoder[r : r + 1]}, decoder_input_ids=prefix.new_tensor([row]))
            .logits[0]
            for r, row in enumerate(rows)
        ]  # fmt: skip
    diff = max((a - g).abs().max().item() for a, g in zip(alone, got))
    print(
        f"{arch}: right-padded decoder prefix + 1 token vs each row alone: {diff:.1e} "
        f"({'exact' if diff <= TOLERANCE else 'WRONG'}); device syncs in the step: "
        f"{patched_syncs} with hfpatch, {stock_syncs} on stock"
    )
    return diff <= TOLERANCE and patched_syncs <= stock_syncs


def _run(model, rows: list[list[int]], chunks, left, device: str = "cuda") -> list[torch.Tensor]:
    """``rows`` as one padded batch split into KV-cached calls (``chunks``: tokens per row per call,
    ``left``: padded on the left); each row's real-token logits."""
    name, cache = cache_name(model), None
    taken, mask, pieces = [0] * len(rows), torch.zeros(len(rows), 0, dtype=torch.long), [[] for _ in rows]
    for counts, lefts in zip(chunks, left):
        width = max(counts)
        ids = torch.full((len(rows), width), PAD)
        real = torch.zeros(len(rows), width, dtype=torch.long)
        starts = [width - n if on_left else 0 for n, on_left in zip(counts, lefts)]
        for r, (n, start) in enumerate(zip(counts, starts)):
            ids[r, start : start + n] = torch.tensor(rows[r][taken[r] : taken[r] + n])
            real[r, start : start + n] = 1
            taken[r] += n
        mask = torch.cat([mask, real], 1)
        with torch.no_grad():
            out = model(
                input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True, **{name: cache}
            )
        cache = output_cache(out)
        for r, (n, start) in enumerate(zip(counts, starts)):
            pieces[r].append(out.logits[r, start : start + n].float())
    return [torch.cat(p) for p in pieces]


def _alone(model, row: list[int], device: str = "cuda") -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([row], device=device)).logits[0].float()


SEQUENCES = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18])
# (name, (chunks, left)) of two rows: padding in one call, a right-padded cached prefix continued
PADDED = (
    ("left padding, one call", (((3, 5),), ((True, False),))),
    ("right-padded prefix + 1 token", (((3, 5), (1, 1)), ((False, False), (False, False)))),
    ("right-padded prefix + 3 tokens", (((2, 5), (3, 3)), ((False, False), (False, False)))),
)


def attention_paths(attention: str) -> bool:
    """Check 4 for one attention: padded, cached and packed calls, and a window past a padded cached
    prefix, each real token against its sequence run alone through the same attention (fp32 for SDPA;
    bf16 for FlashAttention-2, within 3 % of the largest |logit|)."""
    flash = attention.startswith("flash")
    dtype = torch.bfloat16 if flash else torch.float32
    ok = True

    def report(arch: str, label: str, got: list, want: list, warned: bool = False) -> None:
        nonlocal ok
        diff = max((g - w).abs().max().item() for g, w in zip(got, want))
        scale = max(w.abs().max().item() for w in want)
        bound = TOLERANCE if not flash else 3e-2 * max(1.0, scale)
        passed = diff <= bound or warned
        ok &= passed
        said = " (hfpatch: not kept, warned)" if warned else ""
        print(f"{attention}, {arch}, {label}: max|diff| {diff:.2g}{said} {'ok' if passed else 'WRONG'}")

    import transformers

    from hfpatch.verification.tiny import tiny_config

    for arch in ("llama", "gpt2", "mistral"):
        try:
            if arch == "mistral":  # a window of 4, by position over the unpadded keys
                config = tiny_config("mistral", {"sliding_window": 4})
                config._attn_implementation = attention
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", dtype).eval()
            else:
                model = tiny_model(arch, attention=attention).to("cuda", dtype)
        except (ImportError, ValueError) as exc:
            print(f"{attention}, {arch}: not run ({str(exc)[:120]})")
            continue
        if arch == "mistral":
            rows = [list(range(5, 10)), list(range(10, 19))]
            chunks, left = ((3, 8), (2, 1)), ((False, False), (False, False))
            report(arch, "a window of 4 past a right-padded prefix", _run(model, rows, chunks, left),
                   [_alone(model, row) for row in rows])  # fmt: skip
            continue
        for label, (chunks, left) in PADDED:
            rows = [list(range(20, 20 + sum(c[r] for c in chunks))) for r in range(2)]
            report(arch, label, _run(model, rows, chunks, left), [_alone(model, row) for row in rows])
        ids = torch.tensor([sum(SEQUENCES, [])], device="cuda")
        positions = torch.tensor([[i for seq in SEQUENCES for i in range(len(seq))]], device="cuda")
        want = [_alone(model, seq) for seq in SEQUENCES]
        spans = [sum(len(s) for s in SEQUENCES[:i]) for i in range(len(SEQUENCES))]
        collator = transformers.DataCollatorWithFlattening(
            return_position_ids=False, return_flash_attn_kwargs=True
        )
        batch = collator([{"input_ids": s} for s in SEQUENCES])  # (max_length_*: ints)
        by_lengths = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        by_lengths.pop("labels")
        packed = (
            ("packed, no mask", {"input_ids": ids, "position_ids": positions}),
            ("packed, an all-ones mask", {"input_ids": ids, "position_ids": positions,
                                          "attention_mask": torch.ones_like(ids)}),
            ("packed, by its lengths (the collator's flash kwargs)", by_lengths),
        )  # fmt: skip
        for label, kwargs in packed:
            with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits = model(**kwargs).logits[0].float()
            warned = any("not kept to its sequences" in str(w.message) for w in caught)
            got = [logits[start : start + len(seq)] for start, seq in zip(spans, SEQUENCES)]
            report(arch, label, got, want, warned)
    return ok


def unpadded(attention: str) -> bool:
    """Check 5 for one attention: the unpadded training step and scoring call against the padded ones."""
    import statistics

    from harness import SMALL  # (the CPU rows' model and lengths)
    from packed import skewed_lengths

    flash = attention.startswith("flash")
    dtype = torch.bfloat16 if flash else torch.float32
    try:
        model = tiny_model("llama", sizes=SMALL, attention=attention).to("cuda", dtype)
    except (ImportError, ValueError) as exc:
        print(f"unpad, {attention}: not run ({str(exc)[:120]})")
        return True
    lengths = skewed_lengths(0.27)
    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(16, 256, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n], mask[r, :n] = torch.randint(1, 1000, (n,), generator=generator), 1
    ids, mask = ids.cuda(), mask.cuda()
    labels = ids.masked_fill(mask == 0, -100)

    def train() -> float:
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.item()

    def score() -> float:
        model.eval()
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits.float().sum().item()

    def timed(call, unpad: bool) -> tuple[float, float]:
        hfpatch.apply(unpad=unpad)
        try:
            value = call()
            times = []
            for _ in range(11):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return value, statistics.median(times)
        finally:
            hfpatch.apply(unpad=False)

    ok = True
    for label, call in (("training step", train), ("scoring call", score)):
        (padded, padded_ms), (ours, ours_ms) = timed(call, False), timed(call, True)
        bound = 1e-5 if not flash else 3e-2
        same = abs(padded - ours) <= bound * max(1.0, abs(padded)) if label == "training step" else True
        ok &= same
        loss = (
            f"; loss {ours:.6f} vs {padded:.6f} {'ok' if same else 'WRONG'}"
            if label.startswith("training")
            else ""
        )
        print(f"unpad, {attention}, {label} ({sum(lengths)} of 4096 real): {padded_ms:.1f} ms padded, "
              f"{ours_ms:.1f} ms unpadded ({padded_ms / ours_ms:.2f}x){loss}")  # fmt: skip
    return ok


def precision(attention: str, device: str = "cuda") -> bool:
    """Check 6 for one attention: packed and unpadded calls in each regime against each sequence alone."""
    regimes = {"autocast bf16": (torch.float32, torch.bfloat16), "bf16 weights": (torch.bfloat16, None)}
    if not attention.startswith("flash"):
        regimes["autocast fp16"] = (torch.float32, torch.float16)
    ok = True
    for name, (weights, autocast) in regimes.items():
        try:
            model = tiny_model("llama", attention=attention).to(device, weights)
        except (ImportError, ValueError) as exc:
            print(f"precision, {attention}: not run ({str(exc)[:120]})")
            return True
        ok &= _in_regime(model, f"precision, {attention}, {name}", autocast, device)
    return ok


def _in_regime(model, label: str, autocast, device: str) -> bool:
    from hfpatch.tolerances import bound

    def regime():
        return torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()

    def alone(seq):
        with torch.no_grad(), regime(), hfpatch.unpatched():
            return model(input_ids=torch.tensor([list(seq)], device=device)).logits[0].float()

    want = [alone(seq) for seq in SEQUENCES]
    lengths = [len(seq) for seq in SEQUENCES]
    ids = torch.tensor([sum(map(list, SEQUENCES), [])], device=device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    width = max(lengths)
    padded = torch.tensor([list(s) + [PAD] * (width - len(s)) for s in SEQUENCES], device=device)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long().to(device)
    with torch.no_grad(), regime():
        packed = model(input_ids=ids, position_ids=positions).logits[0].float().split(lengths)
        hfpatch.apply(unpad=True)
        try:
            out = model(input_ids=padded, attention_mask=mask).logits.float()
        finally:
            hfpatch.apply(unpad=False)
    unpadded = [out[r, :n] for r, n in enumerate(lengths)]
    limit = bound(autocast or next(model.parameters()).dtype, max(w.abs().max().item() for w in want))
    ok = True
    for layout, got in (("packed row", packed), ("unpad=True", unpadded)):
        worst = max((g - w).abs().max().item() for g, w in zip(got, want))
        ok &= worst <= limit
        print(f"{label}, {layout}: {worst:.2e} (tolerance {limit:.1e}) {'ok' if worst <= limit else 'WRONG'}")
    model.train()
    hfpatch.apply(unpad=True)
    try:
        with regime():
            loss = model(
                input_ids=padded, attention_mask=mask, labels=padded.masked_fill(mask == 0, -100)
            ).loss
        loss.backward()
    finally:
        hfpatch.apply(unpad=False)
    print(f"{label}, unpadded training step: runs (loss {loss.item():.4f})")
    return ok


def at_length() -> bool:
    """Check 7: packed rows at length against the sequences' own batch, and torch's varlen attention."""
    from harness import SMALL

    sizes = {**SMALL, "max_position_embeddings": 1 << 15}
    model = tiny_model("llama", sizes=sizes, attention="sdpa").to("cuda", torch.bfloat16)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    return all([_at_length(model, length, varlen_attn) for length in (512, 2048, 4096, 16384)])


def _timed(call) -> tuple[float, float, object]:
    """Median of 5 CUDA-event timings (ms), the peak memory over the calls (MiB), the last output."""
    import statistics

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, times = None, []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20, out


def _at_length(model, length: int, varlen_attn) -> bool:
    from hfpatch.tolerances import bound

    ids = torch.randint(1, 1000, (8, length), device="cuda")
    positions = torch.arange(length, device="cuda").repeat(8)[None]
    with torch.no_grad():
        own_ms, own_mib, own = _timed(lambda: model(input_ids=ids, use_cache=False).logits)
        ours_ms, ours_mib, ours = _timed(
            lambda: model(input_ids=ids.reshape(1, -1), position_ids=positions, use_cache=False).logits
        )
        # the call's one host read (issue 41): a packed call's device syncs at most one more than its own batch's
        _, own_syncs = _syncs(lambda: model(input_ids=ids, use_cache=False))
        _, our_syncs = _syncs(
            lambda: model(input_ids=ids.reshape(1, -1), position_ids=positions, use_cache=False)
        )
    limit = bound(torch.bfloat16, own.float().abs().max().item())
    worst = (ours.reshape(8, length, -1).float() - own.float()).abs().max().item()
    synced = our_syncs <= own_syncs + 1
    line = (f"length, 8 x {length}: packed {ours_ms:.1f} ms / {ours_mib:.0f} MiB, own {own_ms:.1f} ms / "
            f"{own_mib:.0f} MiB ({ours_ms / own_ms:.2f}x, {ours_mib / max(own_mib, 1):.2f}x memory); "
            f"{worst:.2e} (tolerance {limit:.1e}) {'ok' if worst <= limit else 'WRONG'}; device syncs "
            f"{our_syncs} against {own_syncs} {'ok' if synced else 'TOO MANY'}")  # fmt: skip
    if varlen_attn is not None:  # the attention alone, one layer's shapes: the physical limit's reference
        q = torch.randn(8 * length, 4, 64, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, 8 * length + 1, length, device="cuda", dtype=torch.int32)
        grouped = q.view(8, length, 4, 64).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sdpa_ms, _, _ = _timed(lambda: sdpa(grouped, grouped, grouped, is_causal=True))
        varlen_ms, _, _ = _timed(lambda: varlen_attn(q, q, q, cu, cu, length, length))
        line += f"; one layer's attention: SDPA by sequence {sdpa_ms:.2f} ms, varlen_attn {varlen_ms:.2f} ms"
    print(line)
    return worst <= limit and synced


# (RWKV and xLSTM: their layers handed the state itself; RecurrentGemma returns no cache to continue)
HYBRIDS = ("qwen3_5_text", "lfm2", "mamba", "nemotron_h", "rwkv", "xlstm")


def hybrids(device: str = "cuda") -> bool:
    """Check 8: packed, padded, continued and unpadded calls of models with state layers on the GPU."""
    import importlib.util

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    kernels = [name for name in ("fla", "causal_conv1d", "mamba_ssm") if importlib.util.find_spec(name)]
    print(
        f"hybrids: kernels importable here: {', '.join(kernels) or 'none'} (hfpatch's path runs either way)"
    )
    return all([_hybrid(arch, bool(kernels), device) for arch in HYBRIDS])


def _verdict(label: str, worst: float, noise: float = 0.0) -> bool:
    """One line; the tolerance is fp32's, or four times the recurrence's own noise in pieces (``noise``)."""
    limit = max(TOLERANCE, 4 * noise)
    print(f"hybrids, {label}: {worst:.2e} (tolerance {limit:.1e}) {'ok' if worst <= limit else 'WRONG'}")
    return worst <= limit


def _split_noise(model, rows, chunks, device: str) -> float:
    """fp32's own noise of a recurrence run in pieces (a chunked scan, then steps: two algorithms): each
    row alone, unpadded, on stock, its first call's tokens in one call and the rest one at a time (the path
    every model continues right: some restart their state in a cached call of several), against it in one
    call."""
    worst, name = 0.0, cache_name(model)
    with hfpatch.unpatched(), torch.no_grad():
        for r, row in enumerate(rows):
            cache, taken, pieces = None, 0, []
            counts = [c[r] for c in chunks if c[r]]
            for n in counts[:1] + [1] * sum(counts[1:]):  # (no mask: every token real)
                out = model(input_ids=torch.tensor([row[taken : taken + n]], device=device), use_cache=True,
                            **{name: cache})  # fmt: skip
                cache, taken = output_cache(out), taken + n
                pieces.append(out.logits[0].float())
            worst = max(worst, (torch.cat(pieces) - _alone(model, row[:taken], device)).abs().max().item())
    return worst


def _hybrid(arch: str, kernels: bool, device: str) -> bool:
    import transformers

    model = tiny_model(arch, attention="eager").to(device)
    alone = [_alone(model, list(seq), device) for seq in SEQUENCES]
    starts = [0, len(SEQUENCES[0]), len(SEQUENCES[0]) + len(SEQUENCES[1])]
    features = [{"input_ids": list(seq)} for seq in SEQUENCES]

    def batch(**options) -> dict:
        made = transformers.DataCollatorWithFlattening(return_position_ids=False, **options)(features)
        return {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in made.items() if k != "labels"
        }

    positions = torch.cat([torch.arange(len(s)) for s in SEQUENCES])[None].to(device)
    packed = {"input_ids": torch.tensor([sum(SEQUENCES, [])], device=device), "position_ids": positions}
    calls = {
        "no mask": packed,
        "cu_seq_lens": batch(return_flash_attn_kwargs=True),
        "seq_idx": batch(return_seq_idx=True),
    }
    ok = True
    for label, kwargs in calls.items():
        with torch.no_grad():
            logits = model(**kwargs).logits[0].float()
        worst = max((logits[s : s + len(a)] - a).abs().max().item() for s, a in zip(starts, alone))
        ok &= _verdict(f"{arch}, packed, {label}", worst)
    rows = [list(range(5, 13)), list(range(20, 28))]  # (8 tokens each: every PADDED scenario fits)
    for label, (chunks, left) in PADDED:
        got = _run(model, rows, chunks, left, device)
        worst = max((g - _alone(model, r[: len(g)], device)).abs().max().item() for g, r in zip(got, rows))
        ok &= _verdict(f"{arch}, {label}", worst, _split_noise(model, rows, chunks, device))
    hfpatch.apply(unpad=True)
    try:
        got = _run(model, rows, ((3, 5), (1, 1)), ((True, True), (False, False)), device)
    finally:
        hfpatch.apply(unpad=False)
    worst = max((g - _alone(model, r[: len(g)], device)).abs().max().item() for g, r in zip(got, rows))
    noise = _split_noise(model, rows, ((3, 5), (1, 1)), device)
    ok &= _verdict(f"{arch}, unpad=True, a left-padded prefill + 1 step", worst, noise)
    if device == "cuda":
        own = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in SEQUENCES], batch_first=True).to(
            device
        )
        with torch.no_grad():
            _, own_syncs = _syncs(lambda: model(input_ids=own, use_cache=False))
            _, our_syncs = _syncs(lambda: model(**packed, use_cache=False))
        synced = our_syncs <= own_syncs + 1
        print(f"hybrids, {arch}: a packed call's device syncs {our_syncs} against {own_syncs} "
              f"{'ok' if synced else 'TOO MANY'}")  # fmt: skip
        ok &= synced
    if kernels:  # transformers' own packed path, its kernels given the lengths (printed, not checked)
        given = {**calls["cu_seq_lens"], "seq_idx": calls["seq_idx"]["seq_idx"]}
        with torch.no_grad():
            try:
                with hfpatch.unpatched():
                    theirs_ms, _, theirs = _timed(lambda: model(**given).logits[0].float())
                ours_ms, _, _ = _timed(lambda: model(**packed).logits)
                worst = max((theirs[s : s + len(a)] - a).abs().max().item() for s, a in zip(starts, alone))
                print(f"hybrids, {arch}: the kernels' packed path {theirs_ms:.1f} ms ({worst:.2e} off), "
                      f"hfpatch's {ours_ms:.1f} ms")  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a kernel this device or release does not run
                print(f"hybrids, {arch}: the kernels' packed path did not run: {type(exc).__name__}: {exc}")
    return ok


def _logits(run, **kwargs) -> torch.Tensor:
    return run(**kwargs, use_cache=False).logits


def _compiled_unpadded(run, length: int) -> bool:
    """A compiled ``unpad=True`` call of 8 rows of ``8 x length`` slots (one full, the others ``length``
    long) against its sequences each run alone, compiled: time, memory, logits, device syncs (the call's
    one host read and the custom op's one a layer type, over the sequences' own)."""
    from hfpatch.tolerances import bound

    ids = torch.randint(1, 1000, (8, 8 * length), device="cuda")
    mask = torch.zeros_like(ids)
    mask[0], mask[1:, :length] = 1, 1
    sizes = [8 * length] + [length] * 7
    with torch.no_grad():
        call = functools.partial(_logits, run, input_ids=ids, attention_mask=mask)
        alone = [functools.partial(_logits, run, input_ids=ids[r : r + 1, :n]) for r, n in enumerate(sizes)]
        call(), [one() for one in alone]  # (compiles them)
        own = [_timed(one) for one in alone]
        ours_ms, ours_mib, ours = _timed(call)
        _, our_syncs = _syncs(call)
        own_syncs = sum(_syncs(one)[1] for one in alone)
    own_ms, own_mib = sum(t[0] for t in own), max(t[1] for t in own)
    limit = bound(torch.bfloat16, max(t[2].float().abs().max().item() for t in own))
    worst = max(
        (ours[r, :n].float() - t[2][0].float()).abs().max().item() for r, (n, t) in enumerate(zip(sizes, own))
    )
    pads = bool((ours[mask == 0] == 0).all())  # (run on the real tokens: a pad's logits are zeros)
    synced = our_syncs <= own_syncs + 2
    print(f"compiled unpad=True, 8 rows of {8 * length} slots: {ours_ms:.1f} ms / {ours_mib:.0f} MiB, alone "
          f"{own_ms:.1f} ms / {own_mib:.0f} MiB ({ours_ms / own_ms:.2f}x); {worst:.2e} (tolerance "
          f"{limit:.1e}) {'ok' if worst <= limit else 'WRONG'}; {'unpadded' if pads else 'PADDED'}; device "
          f"syncs {our_syncs} against {own_syncs} {'ok' if synced else 'TOO MANY'}")  # fmt: skip
    return worst <= limit and pads and synced


def compiled() -> bool:
    """Check 9: compiled packed rows against the sequences' own batch compiled, a compiled training step."""
    from hfpatch.tolerances import bound

    from harness import SMALL

    sizes = {**SMALL, "max_position_embeddings": 1 << 13}
    model = tiny_model("llama", sizes=sizes, attention="sdpa").to("cuda", torch.bfloat16)
    run = torch.compile(model, fullgraph=True)
    ok = True
    for length in (1024, 4096):
        ids = torch.randint(1, 1000, (8, length), device="cuda")
        positions = torch.arange(length, device="cuda").repeat(8)[None]
        with torch.no_grad():
            packed = functools.partial(_logits, run, input_ids=ids.reshape(1, -1), position_ids=positions)
            own_call = functools.partial(_logits, run, input_ids=ids)
            packed(), own_call()  # (compiles both)
            own_ms, own_mib, own = _timed(own_call)
            ours_ms, ours_mib, ours = _timed(packed)
            _, own_syncs = _syncs(own_call)
            _, our_syncs = _syncs(packed)
        limit = bound(torch.bfloat16, own.float().abs().max().item())
        worst = (ours.reshape(8, length, -1).float() - own.float()).abs().max().item()
        synced = our_syncs <= own_syncs + 1
        print(f"compiled, 8 x {length}: packed {ours_ms:.1f} ms / {ours_mib:.0f} MiB, own {own_ms:.1f} ms / "
              f"{own_mib:.0f} MiB ({ours_ms / own_ms:.2f}x); {worst:.2e} (tolerance {limit:.1e}) "
              f"{'ok' if worst <= limit else 'WRONG'}; device syncs {our_syncs} against {own_syncs} "
              f"{'ok' if synced else 'TOO MANY'}")  # fmt: skip
        ok &= worst <= limit and synced
    hfpatch.apply(unpad=True)
    try:
        run = torch.compile(model)  # (not fullgraph: an unpadded call's host read is a graph break)
        for length in (1024, 4096):
            ok &= _compiled_unpadded(run, length)
    finally:
        hfpatch.apply(unpad=False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = tiny_model("llama", sizes=SMALL, attention="sdpa").to("cuda").train()
    lengths = (50, 300, 7, 130)
    rows = [torch.randint(1, 1000, (n,), device="cuda") for n in lengths]
    labels = torch.cat([torch.cat([torch.tensor([-100], device="cuda"), row[1:]]) for row in rows])[None]
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    loss = torch.compile(model, fullgraph=True)(
        input_ids=torch.cat(rows)[None], position_ids=positions, labels=labels, use_cache=False
    ).loss
    loss.backward()
    with torch.no_grad():
        total = sum(model(input_ids=row[None], labels=row[None]).loss * (len(row) - 1) for row in rows)
    want = (total / sum(n - 1 for n in lengths)).item()
    print(f"compiled training step: loss {loss.item():.6f}, its sequences alone {want:.6f}")
    return ok and abs(loss.item() - want) <= TOLERANCE


def main(argv: list[str]) -> int:
    if argv not in (
        [], ["seq2seq"], ["attention"], ["unpad"], ["precision"], ["length"], ["hybrids"], ["compiled"]
    ):  # fmt: skip
        print(
            "usage: python benchmarks/cuda_checks.py "
            "[seq2seq | attention | unpad | precision | length | hybrids | compiled]"
        )
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: these checks need a GPU")
        return 2
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}"
    )
    hfpatch.apply()
    ok = True
    if argv in ([], ["attention"]):
        ok &= attention_paths("sdpa") & attention_paths("flash_attention_2")
        if argv:
            return 0 if ok else 1
    if argv in ([], ["unpad"]):
        ok &= unpadded("sdpa") & unpadded("flash_attention_2")
        if argv:
            return 0 if ok else 1
    if argv in ([], ["precision"]):
        ok &= precision("sdpa") & precision("flash_attention_2")
        if argv:
            return 0 if ok else 1
    if argv in ([], ["length"]):
        ok &= at_length()
        if argv:
            return 0 if ok else 1
    if argv in ([], ["hybrids"]):
        ok &= hybrids()
        if argv:
            return 0 if ok else 1
    if argv in ([], ["compiled"]):
        ok &= compiled()
        if argv:
            return 0 if ok else 1
    decoder_only = (
        () if argv else ("gemma", "llama", "gpt2", "mistral")
    )  # mistral: a window of 4 (by position)
    for arch in decoder_only:
        ok &= no_sync(arch)
        ok &= cuda_graphs(arch)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    _, control = _syncs(lambda: torch.ones(1, device="cuda").item())  # one sync: the count must see it
    print(f"control: .item() makes {control} device sync(s) as counted here")
    ok &= control >= 1
    for arch in ("bart", "m2m_100", "t5", "whisper"):  # a table, past the pad id, relative bias, ids
        ok &= seq2seq_step(arch)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
