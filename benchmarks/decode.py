"""What hfpatch adds to a forward call and a decode step: derived positions vs positions passed by hand
(an eager padded forward, eager decode steps, hfpatch's own work timed alone and by profile), an
encoder-decoder step, StaticCache slots, a step past a sliding window, steps with the positions passed as
``generate()`` passes them, and a compiled step."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hfpatch
from hfpatch._compat import cache_name, new_static_cache, output_cache
from hfpatch._context import Pin
from hfpatch.forward import make_forward
from hfpatch.plans import SLOTS, read_plan
from hfpatch.positions import positions_from_mask
from hfpatch.verification.tiny import tiny_model, tiny_seq2seq

from harness import (
    ARCHS,
    COLD_CALLS,
    DECODE_STEPS,
    SMALL,
    STATIC_CYCLE,
    Sections,
    interleaved,
    median_ratio,
    padded_batch,
    seconds,
    small_model,
    stock_if,
)


def eager_padded_forward(batch: int, length: int) -> list[str]:
    """Derived positions vs the same call with positions passed by hand (both patched)."""
    return [_eager_padded_row(arch, batch, length) for arch in ARCHS]


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
    us = _own_work_us(arch, model.base_model, {"input_ids": ids, "attention_mask": mask})
    return (
        f"| {arch} | {batch} x {length} | {ms_a:.2f} | {ms_b:.2f} | **{ratio:.3f}** "
        f"| {us:.0f} ({100 * us / (ms_b * 1000):.2f} %) |"
    )


def _own_forward(arch: str, base: Any) -> Callable[..., Any]:
    """The patched forward with a no-op model behind it: what hfpatch adds to a call (argument
    handling + deriving positions from the mask), and nothing else."""
    adapter = hfpatch.registry()[arch]
    plan = read_plan(adapter, type(base).forward.__wrapped__, type(base))  # the original (functools.wraps)
    pin = Pin(arch)
    pin.pinned = True
    return make_forward(adapter, lambda self, **kwargs: kwargs, plan, pin)


def _own_work_us(arch: str, base: Any, kwargs: dict) -> float:
    """hfpatch's own work, timed alone: median over 1000 back-to-back calls (hot caches), in µs."""
    own = _own_forward(arch, base)
    times = []
    for _ in range(1000):
        start = time.perf_counter()
        own(base, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def eager_decode_steps(prompt: int) -> list[str]:
    """One eager decode step (one new token after ``prompt`` cached ones, mask given): derived
    positions vs positions passed by hand, both patched, timed alone and interleaved. DynamicCache:
    the cache is cropped back to the prompt after every call, outside the timing, so each call is the
    same step. StaticCache with a full-length mask: each call is the next real step."""
    rows = []
    for arch in ARCHS:
        model = small_model(arch)
        for batch, kind in ((1, "DynamicCache"), (8, "DynamicCache"), (8, "StaticCache")):
            rows.append(_decode_row(model, arch, batch, prompt, kind))
        rows.append(_decode_row(model, arch, 8, prompt, "DynamicCache", control=True))
    return rows


def _decode_row(model: Any, arch: str, batch: int, prompt: int, kind: str, control: bool = False) -> str:
    """One row: side 0 lets hfpatch derive the positions, side 1 passes them by hand. ``control``:
    both sides pass them by hand (an A/A run: the noise floor of the ratio)."""
    static = kind == "StaticCache"
    ids, mask = padded_batch(batch, prompt)
    name = cache_name(model)
    capacity = prompt + STATIC_CYCLE
    by_hand = (control, True)
    # one cache and one mask for both sides: two would sit at different addresses, which alone
    # shifts a side's time by about 1 % (seen in the A/A rows when each side had its own)
    run: dict = {"cache": new_static_cache(model, batch, capacity) if static else None}

    def prefill() -> None:  # outside the timing
        full = torch.zeros(batch, capacity if static else prompt, dtype=torch.long)
        full[:, :prompt] = mask
        if static:
            run["cache"].reset()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=full, use_cache=True, **{name: run["cache"]})
        run.update(cache=output_cache(out), full=full, filled=prompt)

    prefill()
    token = torch.ones(batch, 1, dtype=torch.long)

    def prepare(side: int) -> dict:  # outside the timing
        if static:
            run["full"][:, run["filled"]] = 1
            call_mask, upto = run["full"], run["filled"] + 1
        else:
            call_mask = torch.cat([run["full"], torch.ones(batch, 1, dtype=torch.long)], dim=1)
            upto = prompt + 1
        kwargs = {"input_ids": token, "attention_mask": call_mask, "use_cache": True, name: run["cache"]}
        if by_hand[side]:
            kwargs["position_ids"] = positions_from_mask(call_mask[:, :upto])[:, upto - 1 : upto]
        return kwargs

    def finish() -> None:  # outside the timing
        if not static:
            run["cache"].crop(-1)  # drop the step just taken
            return
        run["filled"] += 1
        if run["filled"] == capacity:  # full: start again from the prompt
            prefill()

    def timed(side: int) -> float:
        kwargs = prepare(side)
        with torch.no_grad():
            spent = seconds(lambda: model(**kwargs))
        finish()
        return spent

    paired = interleaved(timed)
    ms_a, ms_b = paired.ms(0), paired.ms(1)
    ratio, low, high = paired.ratio()
    if control:
        return (
            f"| {arch} (A/A: by hand vs by hand) | {kind} | {batch} x 1 (after {prompt}) | {ms_a:.3f} | "
            f"{ms_b:.3f} | **{ratio:.3f}** ({low:.2f}-{high:.2f}) | - | - | - |"
        )
    kwargs = prepare(0)
    hot = _own_work_us(arch, model.base_model, kwargs)
    # the same work where it runs in a decode loop: right after a model step, whose weights and
    # kernels have pushed hfpatch's code and data out of the CPU caches; and, for scale, a single
    # tensor op there (a sum over the mask: less than any derivation of positions needs)
    own, cold, one_op = _own_forward(arch, model.base_model), [], []
    for i in range(2 * COLD_CALLS):
        with torch.no_grad():
            model(**prepare(1))  # untimed
        finish()
        kwargs = prepare(0)
        start = time.perf_counter()
        if i % 2:
            kwargs["attention_mask"].sum(-1, keepdim=True)
        else:
            own(model.base_model, **kwargs)
        (one_op if i % 2 else cold).append(time.perf_counter() - start)
    us, op_us = statistics.median(cold) * 1e6, statistics.median(one_op) * 1e6
    return (
        f"| {arch} | {kind} | {batch} x 1 (after {prompt}) | {ms_a:.3f} | {ms_b:.3f} | **{ratio:.3f}** "
        f"({low:.2f}-{high:.2f}) | {hot:.0f} | {us:.0f} ({100 * us / (ms_b * 1000):.1f} %) | {op_us:.0f} |"
    )


SEQ2SEQ_SMALL = {
    "vocab_size": 1000, "d_model": 256, "encoder_layers": 4, "decoder_layers": 4, "num_layers": 4,
    "num_decoder_layers": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_heads": 4,
    "encoder_ffn_dim": 688, "decoder_ffn_dim": 688, "d_ff": 688, "d_kv": 64, "max_position_embeddings": 1024,
}  # fmt: skip


def seq2seq_decode_steps(batch: int, source: int, prompt: int) -> list[str]:
    """One decoder step of an encoder-decoder model (one new token after ``prompt`` cached ones, a
    right-padded decoder prefix, mask of past + new, the encoder's output passed): hfpatch vs stock
    (``hfpatch.unpatched()``, the same model), interleaved on one cache cropped back after each call.
    BART: positions handed to its table; T5: the relative bias made per row (one ``compute_bias`` over
    every offset, then a gather per row). Stock gives wrong logits here; the row compares cost only."""
    rows = []
    for arch in ("bart", "t5"):
        model = tiny_seq2seq(arch, **SEQ2SEQ_SMALL)
        rows.append(_seq2seq_row(model, arch, batch, source, prompt))
    rows.append(_seq2seq_row(model, "t5", batch, source, prompt, control=True))
    return rows


def _seq2seq_row(model: Any, arch: str, batch: int, source: int, prompt: int, control: bool = False) -> str:
    generator = torch.Generator().manual_seed(0)
    source_ids = torch.randint(3, 1000, (batch, source), generator=generator)
    ids, mask = padded_batch(batch, prompt)
    mask = mask.flip(-1)  # right padding: the pads are holes before the new token
    name = cache_name(model)
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=source_ids)
        out = model(
            encoder_outputs=encoded, decoder_input_ids=ids, decoder_attention_mask=mask, use_cache=True
        )
    cache = output_cache(out)
    kwargs = {
        "encoder_outputs": encoded,
        "decoder_input_ids": torch.ones(batch, 1, dtype=torch.long),
        "decoder_attention_mask": torch.cat([mask, mask.new_ones(batch, 1)], 1),
        "use_cache": True,
        name: cache,
    }
    contexts = (
        (hfpatch.unpatched, hfpatch.unpatched) if control else (contextlib.nullcontext, hfpatch.unpatched)
    )

    def timed(side: int) -> float:
        with torch.no_grad(), contexts[side]():
            spent = seconds(lambda: model(**kwargs))
        cache.crop(-1)  # outside the timing: the same step again
        return spent

    paired = interleaved(timed)
    ratio, low, high = paired.ratio()
    label = f"{arch} (A/A: stock vs stock)" if control else arch
    return (
        f"| {label} | {batch} x 1 (after {prompt}; source {source}) | {paired.ms(0):.3f} | {paired.ms(1):.3f} "
        f"| **{ratio:.3f}** ({low:.2f}-{high:.2f}) |"
    )


def static_slots_decode(prompt: int, capacities: tuple[int, ...]) -> list[str]:
    """transformers 4.38-5.3, where ``cache_position`` is a parameter: a StaticCache decode step with
    a full-length mask and neither ``position_ids`` nor ``cache_position`` (hfpatch derives the slot
    from its count and the positions from the mask) vs stock transformers fed both (``unpatched()``:
    the original forward), interleaved on one cache, for a short and a long cache. What hfpatch adds
    must not grow with the cache's length."""
    model = small_model("llama")
    owner = type(model.base_model)
    if read_plan(hfpatch.registry()["llama"], owner.forward, owner).era != SLOTS:
        return []
    rows = [_static_slots_row(model, 1, prompt, capacity) for capacity in capacities]
    return rows + [_static_slots_row(model, 1, prompt, capacities[-1], control=True)]


def _static_slots_row(model: Any, batch: int, prompt: int, capacity: int, control: bool = False) -> str:
    """One row: hfpatch deriving the slot and positions vs stock fed both; ``control``: stock fed both
    on both sides (an A/A run: the noise floor of the difference)."""
    ids, mask = padded_batch(batch, prompt)
    name = cache_name(model)
    run: dict = {"cache": new_static_cache(model, batch, capacity)}
    cycle = min(capacity - prompt, DECODE_STEPS + 4)

    def prefill() -> None:  # outside the timing; hfpatch's count of the slots restarts from the prompt
        run["cache"].reset()
        full = torch.zeros(batch, capacity, dtype=torch.long)
        full[:, :prompt] = mask
        with torch.no_grad():
            model(input_ids=ids, attention_mask=full[:, :prompt], use_cache=True, **{name: run["cache"]})
        run.update(full=full, filled=prompt)

    prefill()
    token = torch.ones(batch, 1, dtype=torch.long)

    def step() -> None:  # before each pair: the slot both sides fill
        run["full"][:, run["filled"]] = 1

    def timed(side: int) -> float:
        filled = run["filled"]
        kwargs = {"input_ids": token, "attention_mask": run["full"], "use_cache": True, name: run["cache"]}
        stock = side == 1 or control
        if stock:  # stock, fed what hfpatch would derive
            kwargs["position_ids"] = positions_from_mask(run["full"][:, : filled + 1])[:, filled:]
            kwargs["cache_position"] = torch.arange(filled, filled + 1)
        with torch.no_grad(), hfpatch.unpatched() if stock else contextlib.nullcontext():
            return seconds(lambda: model(**kwargs))

    def advance() -> None:  # after each pair
        run["filled"] += 1
        if run["filled"] - prompt == cycle:
            prefill()

    paired = interleaved(timed, before=step, after=advance)
    ms_a, ms_b = paired.ms(0), paired.ms(1)
    extra = statistics.median(a - b for a, b in zip(paired.a, paired.b)) * 1e6
    if control:
        own = "-"
    else:  # hfpatch's own work on such a step, timed alone (its count of the slots put back each time)
        kwargs = {"input_ids": token, "attention_mask": run["full"], "use_cache": True, name: run["cache"]}
        counter, forward, spent = run["cache"]._hfpatch_written, _own_forward("llama", model.base_model), []
        level = counter.clone()
        for _ in range(1000):
            counter.copy_(level)
            start = time.perf_counter()
            forward(model.base_model, **kwargs)
            spent.append(time.perf_counter() - start)
        counter.copy_(level)
        own = f"{statistics.median(spent) * 1e6:.0f}"
    label = "llama (A/A: stock vs stock)" if control else "llama"
    return (
        f"| {label} | {capacity} | {batch} x 1 (after {prompt}) | {ms_a:.3f} | {ms_b:.3f} | {extra:.0f} "
        f"| **{statistics.median(paired.ratios()):.3f}** | {own} |"
    )


def window_decode(batch: int, prompt: int, window: int, steps: int = 301) -> list[str]:
    """A decode step past a sliding window: Mistral (4 layers, hidden 256, window ``window``), a
    right-padded prompt longer than the window, one token a step. hfpatch deriving the positions (its
    windows by position: full cache layers, position masks) vs stock transformers with the positions
    passed by hand (its sliding layers and column masks, wrong past the window for the padded rows).
    Each side has its own cache; their steps are interleaved."""
    model = tiny_model("mistral", sizes={**SMALL, "sliding_window": window}, attention="sdpa")
    ids, mask = padded_batch(batch, prompt)
    mask = mask.flip(-1)  # right padding: the pads become holes once the prompt is continued
    name = cache_name(model)
    sides = []
    for by_hand in (False, True):
        with torch.no_grad(), stock_if(by_hand):
            extra = {"position_ids": positions_from_mask(mask)} if by_hand else {}
            out = model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)
        sides.append({"cache": output_cache(out), "mask": mask, "by_hand": by_hand})
    token = torch.ones(batch, 1, dtype=torch.long)

    def timed(side: int) -> float:
        run = sides[side]
        run["mask"] = torch.cat([run["mask"], run["mask"].new_ones(batch, 1)], 1)
        kwargs = {"input_ids": token, "attention_mask": run["mask"], "use_cache": True, name: run["cache"]}
        if run["by_hand"]:
            kwargs["position_ids"] = positions_from_mask(run["mask"])[:, -1:]
        with torch.no_grad(), stock_if(run["by_hand"]):
            return seconds(lambda: model(**kwargs))

    paired = interleaved(timed, steps)
    kv = [
        sum(t.numel() * t.element_size() for layer in s["cache"].layers for t in (layer.keys, layer.values))
        for s in sides
    ]
    return [
        f"| mistral (window {window}) | {batch} x 1 (after {prompt}, {steps} steps) | {paired.ms(0):.3f} "
        f"| {paired.ms(1):.3f} | **{statistics.median(paired.ratios()):.3f}** | {kv[0] / 2**20:.1f} | {kv[1] / 2**20:.1f} |"
    ]


def given_positions_window_step(batch: int, prompt: int, window: int, steps: int = 301) -> list[str]:
    """A decode step as ``generate()`` makes it (positions passed) on Mistral with a window, a
    left-padded batch (no holes): hfpatch checks the mask for holes and leaves the call to stock, vs
    stock itself; and an A/A row (stock vs stock)."""
    model = tiny_model("mistral", sizes={**SMALL, "sliding_window": window}, attention="sdpa")
    ids, mask = padded_batch(batch, prompt)
    name = cache_name(model)
    token = torch.ones(batch, 1, dtype=torch.long)
    rows = []
    for label, stock_sides in ((f"mistral (window {window})", (False, True)), ("mistral (A/A: stock vs stock)", (True, True))):  # fmt: skip
        sides = []
        for stock in stock_sides:
            with torch.no_grad(), stock_if(stock):
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))
            sides.append({"cache": output_cache(out), "mask": mask, "stock": stock})
        paired = interleaved(functools.partial(_given_positions_step, model, sides, token, name), steps)
        ratio, low, high = paired.ratio()
        rows.append(
            f"| {label} | {batch} x 1 (after {prompt}, {steps} steps) | {paired.ms(0):.3f} | {paired.ms(1):.3f} "
            f"| **{ratio:.3f}** ({low:.2f}-{high:.2f}) |"
        )
    return rows


def _given_positions_step(model: Any, sides: list, token: torch.Tensor, name: str, side: int) -> float:
    run = sides[side]
    run["mask"] = torch.cat([run["mask"], run["mask"].new_ones(token.shape[0], 1)], 1)
    positions = positions_from_mask(run["mask"])[:, -1:]
    kwargs = {
        "input_ids": token,
        "attention_mask": run["mask"],
        "position_ids": positions,
        name: run["cache"],
    }
    with torch.no_grad(), stock_if(run["stock"]):
        return seconds(lambda: model(**kwargs, use_cache=True))


def compiled_decode_step(batch: int, prompt: int, steps: int) -> list[str]:
    """One compiled decode step, hfpatch deriving positions from the mask vs stock transformers fed
    explicit position_ids (and cache_position where the release has it). Both use a StaticCache and a
    full-length mask, so each compiles once; steps of the two are interleaved. The two models are
    copies; the stock one runs the original ``LlamaModel.forward`` (bound on the instance), so nothing
    is patched or reverted between steps."""
    model = small_model("llama")
    original = type(model.model).forward.__wrapped__  # the patch keeps it (functools.wraps)
    stock_model = copy.deepcopy(model)
    stock_model.model.forward = types.MethodType(original, stock_model.model)
    ids, mask = padded_batch(batch, prompt)
    capacity = prompt + steps + 8
    params = inspect.signature(original).parameters
    pass_cache_position = "cache_position" in params

    def runner(model: Any, patched: bool) -> Callable[[], Any]:
        cache = new_static_cache(model, batch, capacity)
        full = torch.zeros(batch, capacity, dtype=torch.long)
        full[:, :prompt] = mask
        state = {"filled": prompt, "next": None}
        cache_arg = {cache_name(model): cache}
        explicit = _explicit(full, prompt, 0, prompt, pass_cache_position, not patched)
        with torch.no_grad():  # prefill, eager
            out = model(input_ids=ids, attention_mask=full, use_cache=True, **cache_arg, **explicit)
        state["next"] = out.logits[:, -1:].argmax(-1)
        compiled = torch.compile(model, fullgraph=True)

        def step() -> Any:
            filled = state["filled"]
            full[:, filled] = 1
            explicit = _explicit(full, filled + 1, filled, 1, pass_cache_position, not patched)
            with torch.no_grad():
                out = compiled(
                    input_ids=state["next"], attention_mask=full, use_cache=True, **cache_arg, **explicit
                )
            state["next"] = out.logits[:, -1:].argmax(-1)
            state["filled"] = filled + 1
            return out

        return step

    stock_step, patched_step = runner(stock_model, patched=False), runner(model, patched=True)
    stock_step(), patched_step()  # compile both
    ratio, ms_a, ms_b = median_ratio(patched_step, stock_step, repeats=steps - 4)
    return [f"| llama | {batch} x 1 (after {prompt}) | {ms_a:.3f} | {ms_b:.3f} | **{ratio:.3f}** |"]


def _explicit(full: torch.Tensor, upto: int, start: int, n: int, cache_position: bool, wanted: bool) -> dict:
    if not wanted:
        return {}
    kwargs = {"position_ids": positions_from_mask(full[:, :upto])[:, start : start + n].contiguous()}
    if cache_position:
        kwargs["cache_position"] = torch.arange(start, start + n)
    return kwargs


PROFILED = {  # a Llama of 12 layers, hidden 768 (GPT-2 small's size): the decode step the profile row is stated for
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64, "max_position_embeddings": 2048,
    "initializer_range": 0.02,
}  # fmt: skip


PROFILE_STEPS, PROFILE_RUNS = 200, 5


PACKAGE = str(Path(hfpatch.__file__).resolve().parent)


def profiled_decode_step(prompt: int) -> list[str]:
    """hfpatch's own Python work on an eager decode step, by profile: cProfile's own time (tottime) of
    every function in hfpatch's package per step, with the tensor ops those functions call counted apart
    (a tensor method is a C function cProfile times on its own), positions derived and passed by hand.
    Controls, measured the same way: a bare pass-through wrapper on the base model's and the rotary
    class's forward (what any wrapper costs: the floor), and the transformers rope wrapper
    (``dynamic_rope_update``) that hfpatch's rotary forward takes the place of."""
    model = tiny_model("llama", sizes=PROFILED, attention="sdpa")
    rows = []
    for batch in (1, 8):
        ids, mask = padded_batch(batch, prompt)
        step = _profiled_step(model, ids, mask)
        derived, passed = step(by_hand=False), step(by_hand=True)
        floor = _pass_through_floor(model, step)
        rows.append(
            f"| llama 12 x 768 | {batch} x 1 (after {prompt}) | **{derived[0]:.1f}** | **{passed[0]:.1f}** "
            f"| {derived[1]}: {derived[2]:.0f} | {floor[0]:.1f} | {floor[1]:.1f} |"
        )
    return rows


def _profiled_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Callable[..., tuple]:
    """A function of ``by_hand`` giving (hfpatch's tottime per step in µs, the tensor ops it calls per
    step, their time per step in µs), medians of :data:`PROFILE_RUNS` runs of :data:`PROFILE_STEPS`."""
    import cProfile
    import pstats

    name = cache_name(model)
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))
    token = torch.ones(ids.shape[0], 1, dtype=torch.long)
    full = torch.cat([mask, torch.ones_like(token)], 1)
    by_hand_positions = positions_from_mask(full)[:, -1:]

    def measure(by_hand: bool, files: Callable[[str], bool] = lambda f: f.startswith(PACKAGE)) -> tuple:
        kwargs = {"input_ids": token, "attention_mask": full, "use_cache": True, name: cache}
        if by_hand:
            kwargs["position_ids"] = by_hand_positions
        runs = []
        for _ in range(PROFILE_RUNS):
            profile = cProfile.Profile()
            for _ in range(PROFILE_STEPS):
                with torch.no_grad():
                    profile.enable()
                    model(**kwargs)
                    profile.disable()
                cache.crop(-1)  # the same step again, outside the profile
            stats = pstats.Stats(profile).stats
            own = sum(entry[2] for function, entry in stats.items() if files(function[0]))
            ops = calls = 0
            for function, entry in stats.items():
                if function[0] == "~":  # a C function: the tensor ops hfpatch's functions call
                    for caller, (_, count, tottime, _) in entry[4].items():
                        if files(caller[0]):
                            ops, calls = ops + tottime, calls + count
            runs.append((own / PROFILE_STEPS * 1e6, round(calls / PROFILE_STEPS), ops / PROFILE_STEPS * 1e6))
        return tuple(statistics.median(values) for values in zip(*runs))

    return measure


def _pass_through_floor(model: Any, step: Callable[..., tuple]) -> tuple[float, float]:
    """(A bare pass-through wrapper on the base model's and the rotary class's forward, by the same
    profile: the floor of any wrapper; transformers' own rope wrapper, which hfpatch's rotary forward
    replaces), µs per step; hfpatch reverted meanwhile."""
    base, rotary = type(model.base_model), type(model.base_model.rotary_emb)
    hfpatch.revert()
    saved = base.__dict__["forward"], rotary.__dict__["forward"]
    try:
        for owner, original in zip((base, rotary), saved):
            owner.forward = _pass_through(original)
        floor = step(by_hand=True, files=lambda f: f == __file__)[0]
    finally:
        base.forward, rotary.forward = saved
    rope = step(by_hand=True, files=lambda f: f.endswith("modeling_rope_utils.py"))[0]
    hfpatch.apply()
    return floor, rope


def _pass_through(original: Callable) -> Callable:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    return forward


def _crop(sides: list) -> None:
    """Take back the step just taken on each side (its cache and its mask), outside the timing."""
    for side in sides:
        side["cache"].crop(-1)
        side["mask"] = side["mask"][:, : side["prompt"]]


def plain_decode_with_positions(batch: int, prompt: int, steps: int = 1001) -> list[str]:
    """A decode step as ``generate()`` makes it (``position_ids`` passed, one new token) on Llama with
    no window: hfpatch looks for packed rows (one new token: by shape, none) and leaves the call to
    stock, vs stock itself; and an A/A row."""
    model = small_model("llama")
    ids, mask = padded_batch(batch, prompt)
    name = cache_name(model)
    token = torch.ones(batch, 1, dtype=torch.long)
    rows = []
    for label, stock_sides in (("llama", (False, True)), ("llama (A/A: stock vs stock)", (True, True))):
        sides = []
        for stock in stock_sides:
            with torch.no_grad(), stock_if(stock):
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))
            sides.append({"cache": output_cache(out), "mask": mask, "stock": stock, "prompt": prompt})

        step = functools.partial(_given_positions_step, model, sides, token, name)
        paired = interleaved(step, steps, after=functools.partial(_crop, sides))
        ratio, low, high = paired.ratio()
        extra = statistics.median(a - b for a, b in zip(paired.a, paired.b)) * 1e6
        rows.append(
            f"| {label} | {batch} x 1 (after {prompt}) | {paired.ms(0):.3f} | {paired.ms(1):.3f} "
            f"| **{ratio:.3f}** ({low:.2f}-{high:.2f}) | {extra:+.1f} |"
        )
    return rows


SECTIONS: Sections = {
    "## Eager forward on a padded batch: derived positions vs positions passed by hand": (
        [
            "Both calls go through the patched forward; the first lets hfpatch derive `position_ids`",
            "from the mask, the second passes them. The last column times what hfpatch adds (the patched",
            "forward in front of a no-op model).",
            "",
            "| model (4 layers, hidden 256) | batch x tokens | derived (ms) | by hand (ms) | ratio "
            "| hfpatch's own work, timed alone: µs (share of the call) |",
            "|---|---|---|---|---|---|",
        ],
        lambda: eager_padded_forward(8, 128),
    ),
    "## hfpatch's own Python work on an eager decode step, by profile": (
        [
            "Llama, 12 layers, hidden 768, SDPA, one new token after 128 cached (left-padded prompt, a",
            "DynamicCache cropped back after each step, outside the profile), mask of past + new. cProfile's",
            "own time (tottime) of every function in hfpatch's package, per step: the median of",
            f"{PROFILE_RUNS} runs of {PROFILE_STEPS} steps. The tensor ops hfpatch's functions call are C",
            "functions cProfile times apart: their count and time per step are the next column (after a",
            "model step they run with cold CPU caches). Controls, measured the same way, hfpatch reverted:",
            "a bare pass-through wrapper on the base model's and the rotary class's forward (what any",
            "wrapper costs: the floor under the positions-passed column), and transformers' own rope",
            "wrapper (`dynamic_rope_update`), whose place hfpatch's rotary forward takes (so it no longer",
            "runs). Profiling slows every Python call: compare rows, not seconds.",
            "",
            "| model | batch x tokens | hfpatch, positions derived (µs) | hfpatch, positions passed (µs) "
            "| tensor ops hfpatch calls, derived: count: µs | control: pass-through wrappers (µs) "
            "| transformers' rope wrapper, replaced (µs) |",
            "|---|---|---|---|---|---|---|",
        ],
        lambda: profiled_decode_step(128),
    ),
    "## Eager decode step: derived positions vs positions passed by hand": (
        [
            "One new token a call after 128 cached (left-padded prompt), mask given (past + new; a",
            "StaticCache gets its full-length mask), 4 layers, hidden 256, eager, one thread. Only the",
            "forward call is timed; the cache is cropped back (DynamicCache) or the next step taken",
            f"(StaticCache, whose prompt is run again, untimed, every {STATIC_CYCLE} steps) outside the",
            f"timing. {DECODE_STEPS} steps a row, interleaved, on one cache shared by both sides; the ratio is",
            "the median of the per-step ratios (their interquartile range in brackets); the A/A rows run the",
            "same call on both sides: the noise floor of that median. hfpatch's own work (the patched",
            "forward in front of a no-op model) is timed alone, back to back (hot CPU caches), and right",
            "after an untimed model step, as it runs in a decode loop (cold). The last column is one tensor",
            "op (a sum over the mask) timed the same cold way: the unit every eager derivation pays per op.",
            "",
            "| model | cache | batch x tokens | derived (ms) | by hand (ms) | ratio | own work, hot: µs "
            "| own work after a step: µs (share of the call) | one tensor op after a step: µs |",
            "|---|---|---|---|---|---|---|---|---|",
        ],
        lambda: eager_decode_steps(128),
    ),
    "## Encoder-decoder decode step: hfpatch vs stock": (
        [
            "4 encoder and 4 decoder layers, d_model 256, eager, one thread; batch 8, a right-padded",
            "decoder prefix of 128 tokens, then one new token a call (mask of past + new), the encoder's",
            "output (64 source tokens) passed. hfpatch derives the positions (BART: handed to its table;",
            "T5: the relative bias made per row); stock is the same model under `hfpatch.unpatched()`",
            f"(wrong logits, same shapes). {DECODE_STEPS} steps a row, interleaved, on one cache cropped back",
            "after each call (outside the timing); the ratio is the median of the per-step ratios (their",
            "interquartile range in brackets); the A/A row runs stock on both sides.",
            "",
            "| model | batch x tokens | hfpatch (ms) | stock (ms) | ratio |",
            "|---|---|---|---|---|",
        ],
        lambda: seq2seq_decode_steps(8, 64, 128),
    ),
    "## StaticCache decode step on 4.38-5.3: hfpatch's slot count vs explicit inputs, short and long caches": (
        [
            "Run on a release that has `cache_position` (`python benchmarks/bench.py --only static`",
            "in an environment with, e.g., transformers 4.57.6). One new token a call after 128 cached,",
            "batch 1, 4 layers, hidden 256, eager, one thread. hfpatch: a full-length mask and neither",
            "`position_ids` nor `cache_position` (the slot comes from hfpatch's count of the slots",
            "written, the positions from the mask); stock: the original forward fed both. Interleaved on",
            f"one cache, {DECODE_STEPS} steps; *extra* is the median of the per-step differences, the A/A",
            "row its noise floor (both sides stock); the last column is hfpatch's own work on such a step,",
            "timed alone (the patched forward in front of a no-op model).",
            "",
            "| model | cache slots | batch x tokens | hfpatch (ms) | stock, explicit (ms) "
            "| extra per step (µs) | ratio | hfpatch's own work (µs) |",
            "|---|---|---|---|---|---|---|---|",
        ],
        lambda: static_slots_decode(128, (256, 8192)),
    ),
    "## Decode step past a sliding window: windows by position vs transformers' own": (
        [
            "Mistral, 4 layers, hidden 256, SDPA, batch 8, a right-padded prompt of 512 tokens (its pads",
            "become holes once it is continued), one token a step. hfpatch derives the positions (windows by",
            "position: the sliding layers keep every key, the masks compare positions); the other side",
            "is stock transformers with the positions passed by hand: its sliding layers and column masks,",
            "which are wrong past the window for the padded rows. Each side has its own cache; steps",
            "interleaved; the last two columns are the KV cache's size after the steps.",
            "",
            "| model | batch x tokens | hfpatch (ms) | stock, positions by hand (ms) | ratio "
            "| KV cache, hfpatch (MiB) | KV cache, stock (MiB) |",
            "|---|---|---|---|---|---|---|",
        ],
        lambda: window_decode(8, 512, 128),
    ),
    "## Decode step with positions passed (as `generate()` makes it), a window, no holes": (
        [
            "Mistral, 4 layers, hidden 256, SDPA, window 128, batch 8, a left-padded prompt of 512 tokens,",
            "one token a step with `position_ids` passed, as `generate()` passes them. The mask has no holes,",
            "so hfpatch only checks that (a few tensor ops and one read of a value) and leaves the call to",
            "stock: the first row is that check's cost; the A/A row (stock on both sides) its noise floor.",
            "",
            "| model | batch x tokens | hfpatch (ms) | stock (ms) | ratio |",
            "|---|---|---|---|---|",
        ],
        lambda: given_positions_window_step(8, 512, 128),
    ),
    "## Decode step with positions passed, no window: the look for packed rows": (
        [
            "Llama, 4 layers, hidden 256, eager, one thread; one new token a step after a left-padded",
            "prompt of 128, `position_ids` passed as `generate()` passes them; the cache is cropped back",
            f"after each pair (outside the timing). {DECODE_STEPS} steps, interleaved; the last column is",
            "the median of the per-step differences (hfpatch's extra work on such a step).",
            "",
            "| model | batch x tokens | hfpatch (ms) | stock (ms) | ratio (interquartile range) "
            "| extra per step (µs) |",
            "|---|---|---|---|---|---|",
        ],
        lambda: plain_decode_with_positions(8, 128),
    ),
    "## Compiled decode step: hfpatch (mask only) vs stock with explicit inputs": (
        [
            "Llama, 4 layers, hidden 256, inductor, StaticCache with a full-length mask (static shapes,",
            "one graph each); stock is fed `position_ids` (and `cache_position` where the release has",
            "it) computed outside the compiled step.",
            "",
            "| model | batch x tokens | hfpatch (ms) | stock, explicit (ms) | ratio |",
            "|---|---|---|---|---|",
        ],
        lambda: compiled_decode_step(8, 128, 72),
    ),
}
