"""``python -m hfpatch``: versions, adapter states, and a live before/after check on tiny random models.

The helpers here (tiny models, running a padded batch in KV-cached chunks, the unpadded reference)
are also what the test suite uses, so the doctor checks exactly what the tests check.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import engine

__all__ = [
    "SCENARIOS",
    "Scenario",
    "cache_kwarg",
    "main",
    "max_diff",
    "output_cache",
    "run_alone",
    "run_batched",
    "static_cache",
    "tiny_model",
]

TOLERANCE = 1e-5
PAD = 0  # pad id; Llama/Gemma's embedding row for it is zero (padding_idx), as in real checkpoints
VOCAB = 97
INIT = 0.1  # larger than the usual 0.02, so that a wrong position shows as a clearly wrong logit


def tiny_model(arch: str, seed: int = 0, attention: Optional[str] = None) -> Any:
    """A 2-layer, hidden-32 random-weight LM of ``arch`` ("gpt2", "llama", "gemma"), fp32, eval mode;
    ``attention``: "eager" or "sdpa" where the release chooses (default: the release's own default)."""
    import transformers

    torch.manual_seed(seed)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4, initializer_range=INIT,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif arch in ("llama", "gemma"):
        common = dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=INIT,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if arch == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        else:
            model = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=8, **common))
    else:
        raise ValueError(f"arch: expected 'gpt2', 'llama' or 'gemma', got {arch!r}")
    if attention is not None:  # rebuild with the same weights: the attention class is chosen at init
        config = model.config
        config._attn_implementation = attention
        rebuilt = type(model)(config)
        rebuilt.load_state_dict(model.state_dict())
        model = rebuilt
    return model.float().eval()


def cache_kwarg(model: Any) -> str:
    """The name this release gives the cache argument: ``cache`` (5.24+) or ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def static_cache(model: Any, batch: int, length: int, device: str = "cpu") -> Any:
    """A ``StaticCache`` of ``length`` slots for ``model``; its constructor's keywords changed across
    releases (``max_batch_size`` then ``batch_size``, ``device`` and ``dtype`` later inferred)."""
    import inspect

    import transformers

    params = inspect.signature(transformers.StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": length}
    for name, value in (
        ("max_batch_size", batch),
        ("batch_size", batch),
        ("device", device),
        ("dtype", torch.float32),
    ):
        if name in params:
            kwargs[name] = value
    try:
        return transformers.StaticCache(**kwargs)
    except TypeError as exc:  # 4.54-4.55 take the layers' batch_size, device and dtype through **kwargs
        if "batch_size" not in str(exc):
            raise
        return transformers.StaticCache(**kwargs, batch_size=batch, device=device, dtype=torch.float32)


def output_cache(output: Any) -> Any:
    """The cache a forward call returned, from ``.cache`` (5.24+) or ``.past_key_values``."""
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


def run_alone(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of one sequence, unpadded, in one call: the reference."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(tokens)])).logits[0]


def run_batched(
    model: Any,
    rows: Sequence[Sequence[int]],
    chunks: Sequence[Sequence[int]],
    left: Sequence[Sequence[bool]],
    cache: Any = None,
    mask_width: Optional[int] = None,
    pass_cache_position: bool = False,
    **extra: Any,
) -> list[torch.Tensor]:
    """Run ``rows`` as one padded batch, split into KV-cached calls; return each row's real-token logits.

    Args:
        rows: the real tokens of each row.
        chunks: ``chunks[c][r]``: how many of row ``r``'s next tokens go into call ``c`` (0 allowed).
        left: ``left[c][r]``: in call ``c``, pad row ``r`` on the left (else on the right).
        cache: the cache to start from (``None``: the model's default).
        mask_width: pad every mask with zeros to this many columns (a static cache's full length).
        pass_cache_position: pass each call's cache slots explicitly as ``cache_position``.
        extra: more keyword arguments for every call.
    """
    batch = len(rows)
    taken = [0] * batch
    mask = torch.zeros(batch, 0, dtype=torch.long)
    pieces: list[list[torch.Tensor]] = [[] for _ in rows]
    name = cache_kwarg(model)
    for counts, lefts in zip(chunks, left):
        width = max(counts)
        if width == 0:
            continue
        ids = torch.full((batch, width), PAD)
        new = torch.zeros(batch, width, dtype=torch.long)
        starts = [width - n if is_left else 0 for n, is_left in zip(counts, lefts)]
        for r, (n, start) in enumerate(zip(counts, starts)):
            ids[r, start : start + n] = torch.tensor(rows[r][taken[r] : taken[r] + n], dtype=torch.long)
            new[r, start : start + n] = 1
            taken[r] += n
        mask = torch.cat([mask, new], dim=1)
        call_mask = mask
        if mask_width is not None:
            call_mask = torch.cat([mask, mask.new_zeros(batch, mask_width - mask.shape[1])], dim=1)
        if pass_cache_position:
            extra["cache_position"] = torch.arange(mask.shape[1] - width, mask.shape[1])
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=call_mask, use_cache=True, **{name: cache}, **extra)
        returned = output_cache(out)  # a new object on some releases (4.38-4.40 copy caches into new ones)
        cache = returned if returned is not None else cache
        for r, (n, start) in enumerate(zip(counts, starts)):
            pieces[r].append(out.logits[r, start : start + n])
    return [torch.cat(p) for p in pieces]


def max_diff(model: Any, rows: Sequence[Sequence[int]], batched: Sequence[torch.Tensor]) -> float:
    """Largest |logit difference| at any real token between ``batched`` and each row run alone."""
    return max((run_alone(model, row) - got).abs().max().item() for row, got in zip(rows, batched))


@dataclass(frozen=True)
class Scenario:
    name: str
    lengths: tuple[int, ...]  # real tokens per row
    chunks: tuple[tuple[int, ...], ...]
    left: tuple[tuple[bool, ...], ...]


SCENARIOS = (
    # transformers #18104: a right-padded cached prefix, then one more token per row
    Scenario("right-padded prefix + 1 token", (4, 5), ((3, 4), (1, 1)), ((False, False), (False, False))),
    Scenario("left padding, one call", (3, 6), ((3, 6),), ((True, True),)),
    Scenario(
        "variable prefixes and suffixes",
        (5, 5, 3),
        ((3, 4, 1), (2, 1, 2)),
        ((False,) * 3, (False, True, False)),
    ),
)


def scenario_rows(scenario: Scenario, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in scenario.lengths]


def check(arch: str, model: Any = None) -> list[tuple[str, float, float]]:
    """For each seed scenario: (name, max |diff| on stock transformers, max |diff| with hfpatch)."""
    model = model if model is not None else tiny_model(arch)
    results = []
    for scenario in SCENARIOS:
        rows = scenario_rows(scenario)
        diffs = []
        for use_patch in (False, True):
            context = engine.patched(arch) if use_patch else _stock(arch)
            with context:
                diffs.append(max_diff(model, rows, run_batched(model, rows, scenario.chunks, scenario.left)))
        results.append((scenario.name, diffs[0], diffs[1]))
    return results


class _stock:
    """Temporarily revert ``arch`` (restored on exit if it was applied)."""

    def __init__(self, arch: str) -> None:
        self.arch = arch

    def __enter__(self) -> None:
        self.was_applied = engine.status()[self.arch].state == engine.APPLIED
        engine.revert()

    def __exit__(self, *exc: Any) -> None:
        if self.was_applied:
            engine.apply()


def main(argv: Optional[Sequence[str]] = None) -> int:
    import transformers

    engine.apply()
    models = {}
    for entry in engine.status().adapters:
        if entry.state == engine.WAITING:
            models[entry.arch] = tiny_model(entry.arch)  # imports the modeling module: the hook patches it
    status = engine.status()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"Python {platform.python_version()}, {versions}")
    print()
    print(status)
    print()
    header = f"{'arch':6}  {'scenario':32}  {'stock max|diff|':>16}  {'hfpatch max|diff|':>18}  result"
    print(header)
    print("-" * len(header))
    failed = False
    for entry in status.adapters:
        if entry.state != engine.APPLIED:
            print(f"{entry.arch:6}  (not checked: {entry.state})")
            continue
        for name, stock, fixed in check(entry.arch, models.get(entry.arch)):
            ok = fixed <= TOLERANCE
            failed |= not ok
            verdict = "fixed" if ok and stock > TOLERANCE else "ok" if ok else "FAIL"
            print(f"{entry.arch:6}  {name:32}  {stock:16.2e}  {fixed:18.2e}  {verdict}")
    print()
    print(
        f"hfpatch passes if every hfpatch max|diff| <= {TOLERANCE:g} (fp32, vs each row run alone, unpadded)"
    )
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
