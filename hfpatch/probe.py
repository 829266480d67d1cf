"""The invariant probe: ``hfpatch.verify(model)`` runs padded, KV-cached batches stock vs patched and
measures every real token's logits against the row run alone, unpadded, in one call.

The helpers here (tiny random models, running a padded batch in KV-cached chunks, the unpadded
reference) are what the doctor, the test suite and the compat matrix use, so they all check the same
thing. Nothing here is imported by ``apply()``.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import torch

from . import engine
from .gates import Adapter

__all__ = [
    "SCENARIOS",
    "TOLERANCE",
    "Scenario",
    "Verification",
    "cache_kwarg",
    "max_diff",
    "output_cache",
    "random_case",
    "run_alone",
    "run_batched",
    "static_cache",
    "tiny_model",
    "verify",
]

TOLERANCE = 1e-5  # fp32, max |logit difference| at any real token: the one tolerance of every check
WRONG = 1e-4  # a stock difference above this is a wrong result, not float noise
PAD = 0  # pad id; most tiny models' embedding row for it is zero (padding_idx), as in real checkpoints
VOCAB = 97
INIT = 0.1  # larger than the usual 0.02, so that a wrong position shows as a clearly wrong logit

# Tiny sizes, applied to every config field of these names that the config class has.
_TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64, "n_embd": 64, "d_model": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "initializer_range": INIT,
    "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
}  # fmt: skip
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")


def tiny_config(arch: str, sizes: Optional[dict[str, Any]] = None) -> Any:
    """A tiny config of model type ``arch``: 2 layers, hidden 64, 4 heads (2 KV heads), vocab 97,
    pad id 0, plus the adapter's own ``tiny`` overrides. Sub-configs (text, vision, audio) are shrunk
    the same way. ``sizes`` replaces some of the tiny sizes (same field names; the benchmarks' models)."""
    import transformers

    adapter = engine.adapter_for(arch)
    # a copy: config classes edit the lists and dicts they are given in place
    overrides = copy.deepcopy(dict(adapter.tiny)) if adapter is not None else {}
    default = transformers.AutoConfig.for_model(arch)
    if adapter is not None and arch != adapter.arch and hasattr(_field(default, "text_config"), "to_dict"):
        # an alias that wraps the patched text model: the adapter's own overrides are for its text config
        text = {name: overrides.pop(name) for name in list(overrides) if name not in _SUB_CONFIGS}
        overrides["text_config"] = {**text, **overrides.get("text_config", {})}
    return _shrunk(type(default), default, overrides, {**_TINY, **(sizes or {})})


def _shrunk(config_class: type, default: Any, overrides: dict, tiny: dict) -> Any:
    kwargs = {
        name: value
        for name, value in tiny.items()
        if _field(default, name) is not None and not _read_only(config_class, name)
    }
    if _field(default, "kv_lora_rank") is not None:  # MLA: one KV head per query head
        kwargs["num_key_value_heads"] = tiny["num_attention_heads"]
    params = inspect.signature(config_class.__init__).parameters
    for name in _SUB_CONFIGS:
        sub = _field(default, name)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[name] = _shrunk(type(sub), sub, overrides.pop(name, {}), tiny).to_dict()
        elif sub is None and name not in params:
            overrides.pop(name, None)  # a sub-config override for the wrapper an alias has (see tiny_config)
    kwargs.update(overrides)
    return config_class(**kwargs)


def _field(config: Any, name: str) -> Any:
    """``config.name`` (``None`` where the config has none); ``...`` for a per-layer field of a
    heterogeneous config, which raises on global access: the tiny config sets it for every layer."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError (not an AttributeError)
        return ...


def _read_only(config_class: type, name: str) -> bool:
    """A field the config class derives itself (a property without a setter): it cannot be passed."""
    attribute = inspect.getattr_static(config_class, name, None)
    return isinstance(attribute, property) and attribute.fset is None


def tiny_model(
    arch: str, seed: int = 0, attention: Optional[str] = None, sizes: Optional[dict[str, Any]] = None
) -> Any:
    """A tiny random-weight causal LM of model type ``arch`` (:func:`tiny_config`), fp32, eval mode;
    ``attention``: ``"eager"`` or ``"sdpa"`` (default: the release's own default)."""
    import transformers

    config = tiny_config(arch, sizes)
    if attention is not None:
        config._attn_implementation = attention  # chosen at init; older releases read only this field
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def cache_kwarg(model: Any) -> Optional[str]:
    """The name this release gives the cache argument: ``cache`` (5.24+), ``past_key_values``, or
    ``None`` for a model without a KV cache."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def static_cache(model: Any, batch: int, length: int, device: str = "cpu") -> Any:
    """A ``StaticCache`` of ``length`` slots for ``model``; its constructor's keywords changed across
    releases (``max_batch_size`` then ``batch_size``, ``device`` and ``dtype`` later inferred)."""
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
    """The cache a forward call returned, from ``.cache`` (5.24+) or ``.past_key_values`` (read as
    keys: 5.24's ``past_key_values`` property logs a deprecation)."""
    keys = output.keys()
    return next((output[key] for key in ("cache", "past_key_values") if key in keys), None)


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
    cache_name: Optional[str] = None,
    **extra: Any,
) -> list[torch.Tensor]:
    """Run ``rows`` as one padded batch, split into KV-cached calls; return each row's real-token logits.

    Args:
        model: the model, or any callable taking the model's keyword arguments.
        rows: the real tokens of each row.
        chunks: ``chunks[c][r]``: how many of row ``r``'s next tokens go into call ``c`` (0 allowed).
        left: ``left[c][r]``: in call ``c``, pad row ``r`` on the left (else on the right).
        cache: the cache to start from (``None``: the model's default).
        mask_width: pad every mask with zeros to this many columns (a static cache's full length).
        pass_cache_position: pass each call's cache slots explicitly as ``cache_position``.
        cache_name: the cache argument's name (default: read from ``model``'s signature).
        extra: more keyword arguments for every call.
    """
    batch = len(rows)
    taken = [0] * batch
    mask = torch.zeros(batch, 0, dtype=torch.long)
    pieces: list[list[torch.Tensor]] = [[] for _ in rows]
    name = cache_name or cache_kwarg(model)
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
        cache_kwargs = {name: cache, "use_cache": True} if name is not None else {}
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=call_mask, **cache_kwargs, **extra)
        returned = output_cache(out) if name is not None else None
        cache = returned if returned is not None else cache  # some releases return a new cache object
        for r, (n, start) in enumerate(zip(counts, starts)):
            pieces[r].append(out.logits[r, start : start + n])
    return [torch.cat(p) for p in pieces]


def max_diff(model: Any, rows: Sequence[Sequence[int]], batched: Sequence[torch.Tensor]) -> float:
    """Largest |logit difference| at any real token between ``batched`` and each row run alone."""
    return max((run_alone(model, row) - got).abs().max().item() for row, got in zip(rows, batched))


class Scenario(NamedTuple):
    name: str
    lengths: tuple[int, ...]  # real tokens per row
    chunks: tuple[tuple[int, ...], ...]
    left: tuple[tuple[bool, ...], ...]
    cached: bool = True  # more than one call: needs a KV cache
    holes: bool = True  # pads between real tokens (else only before them: RoPE is blind to that shift)


SCENARIOS = (
    # transformers #18104: a right-padded cached prefix, then one more token per row
    Scenario("right-padded prefix + 1 token", (4, 5), ((3, 4), (1, 1)), ((False, False), (False, False))),
    Scenario("left padding, one call", (3, 6), ((3, 6),), ((True, True),), cached=False, holes=False),
    Scenario(
        "variable prefixes and suffixes",
        (5, 5, 3),
        ((3, 4, 1), (2, 1, 2)),
        ((False,) * 3, (False, True, False)),
    ),
    # a left-padded prompt in the cache, continued by several tokens (4.36-4.37's SDPA mask code)
    Scenario(
        "left-padded prefix + 2 tokens", (4, 6), ((2, 4), (2, 2)), ((True, True), (False, False)), holes=False
    ),
)


def scenario_rows(scenario: Scenario, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in scenario.lengths]


def random_case(rng: Any, max_batch: int = 3, max_calls: int = 3, max_new: int = 4) -> tuple:
    """One random padded, KV-cached batch: ``(rows, chunks, left)`` for :func:`run_batched`. ``rng`` is a
    ``random.Random`` or a hypothesis ``draw``-backed object with the same ``randint``/``random``."""
    batch, calls = rng.randint(1, max_batch), rng.randint(1, max_calls)
    chunks = [[rng.randint(0, max_new) for _ in range(batch)] for _ in range(calls)]
    for r in range(batch):  # every row has at least one real token
        if sum(c[r] for c in chunks) == 0:
            chunks[0][r] = rng.randint(1, max_new)
    left = [[rng.random() < 0.5 for _ in range(batch)] for _ in range(calls)]
    rows = [[rng.randint(1, VOCAB - 1) for _ in range(sum(c[r] for c in chunks))] for r in range(batch)]
    return rows, chunks, left


class Row(NamedTuple):
    scenario: str
    stock: float  # max |diff| on stock transformers (nan: it raised)
    patched: float  # the same with hfpatch
    error: str = ""  # what raised, if something did


class Verification(NamedTuple):
    """What :func:`verify` found: one :class:`Row` per scenario, the verdict, and the notes (the
    adapter's state, declared limits). ``print()`` it for a table."""

    arch: str
    state: str
    rows: tuple[Row, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Every scenario exact with hfpatch (max |diff| <= 1e-5, fp32)."""
        return bool(self.rows) and all(row.patched <= TOLERANCE for row in self.rows)

    @property
    def stock_wrong(self) -> bool:
        return any(not row.stock <= WRONG for row in self.rows)

    @property
    def verdict(self) -> str:
        if not self.rows:
            return "not checked"
        if self.ok:
            return "fixed by hfpatch" if self.stock_wrong else "right on stock and with hfpatch"
        if self.state == engine.APPLIED:
            return "WRONG with hfpatch"
        return "wrong: hfpatch does not patch it"

    def __str__(self) -> str:
        lines = [f"{self.arch}: {self.verdict} (hfpatch state: {self.state})"]
        header = f"  {'scenario':44}  {'stock max|diff|':>16}  {'hfpatch max|diff|':>18}"
        lines += [header, "  " + "-" * (len(header) - 2)]
        for row in self.rows:
            lines.append(f"  {row.scenario:44}  {row.stock:16.2e}  {row.patched:18.2e}  {row.error}".rstrip())
        lines += [f"  note: {note}" for note in self.notes]
        lines.append(
            f"  exact = every hfpatch max|diff| <= {TOLERANCE:g} (fp32, vs each row run alone, unpadded)"
        )
        return "\n".join(lines)


def verify(model: Union[str, os.PathLike, Any], static: bool = True) -> Verification:
    """Probe ``model`` for the padding and KV-cache bug, stock vs hfpatch.

    ``model`` is a causal-LM instance, a local checkpoint directory (loaded with ``from_pretrained``),
    or a model type (``"qwen2"``: built tiny from its config). The scenarios (:data:`SCENARIOS`): left
    padding in one call, a right-padded cached prefix + 1 token, variable prefixes and suffixes, a
    left-padded cached prefix + 2 tokens, and the variable one again with a ``StaticCache`` where the
    model takes one (cached ones only where the model returns a cache). Each is run on stock and with
    hfpatch applied to this model's adapter (then the state found is restored), and every real token's
    logits are compared with its row run alone. Works for any causal LM: for one hfpatch does not
    patch, the patched column says what positions from the mask would give (explicit ``position_ids``).

    >>> result = hfpatch.verify("qwen2")   # doctest: +SKIP
    >>> result.ok, print(result)           # doctest: +SKIP
    """
    model = _load(model)
    model_type = getattr(model.config, "model_type", "?")
    adapter = _adapter_of_class(model) or engine.adapter_for(model_type)
    status = engine.status()
    entry = status.get(adapter.arch) if adapter is not None else status.get(model_type)
    notes = list(_limits(model, adapter))
    if entry is not None and entry.reason and entry.state != engine.APPLIED:
        notes.append(entry.reason)
    probes = _scenarios(model, static and adapter is not None)
    rows = [_run_scenario(model, adapter, probe) for probe in probes]
    if len(probes) < len(SCENARIOS):
        notes.append("the model returns no KV cache to continue from: the cached scenarios are not probed")
    if adapter is None:
        state = entry.state if entry is not None else "unknown to hfpatch"
        if "position_ids" in inspect.signature(model.forward).parameters:
            notes.append("no adapter: the hfpatch column passes positions from the mask by hand")
        else:
            notes.append("no adapter, and the model takes no position_ids: the hfpatch column is stock's")
    else:
        state = entry.state
        if state != engine.APPLIED:
            notes.append(f"the {adapter.arch!r} adapter is {state} here: its column is what patched() gives")
    return Verification(model_type, state, tuple(rows), tuple(notes))


def _load(model: Any) -> Any:
    if not isinstance(model, (str, os.PathLike)):
        return model.eval()
    if os.path.isdir(model):
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    return tiny_model(str(model))


def _adapter_of_class(model: Any) -> Optional[Adapter]:
    """The adapter of the outermost module of ``model`` whose class is a declared target."""
    targets = {(a.module, a.cls): a for a in engine.registry().values()}
    for module in model.modules():
        adapter = targets.get((type(module).__module__, type(module).__name__))
        if adapter is not None:
            return adapter
    return None


def _limits(model: Any, adapter: Optional[Adapter]) -> list[str]:
    config = getattr(model.config, "text_config", None) or model.config
    notes = list(adapter.limits) if adapter is not None else []
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    if window:
        notes.append(
            f"sliding window / chunked attention ({window} tokens): the window counts cache columns, so a "
            "hole from a padded cached prefix inside the window stays wrong (not probed here)"
        )
    return notes


class _Probe(NamedTuple):
    name: str
    scenario: Scenario
    cache: Any  # a factory: () -> initial cache, or None
    mask_width: Optional[int]


def _scenarios(model: Any, static: bool) -> list[_Probe]:
    name = cache_kwarg(model) if _returns_a_cache(model) else None
    probes = [_Probe(s.name, s, None, None) for s in SCENARIOS if name is not None or not s.cached]
    if static and name is not None and _takes_static_cache(model):
        variable = SCENARIOS[2]
        probes.append(
            _Probe(f"{variable.name}, StaticCache", variable, lambda: static_cache(model, 3, 16), 16)
        )
    return probes


def _returns_a_cache(model: Any) -> bool:
    """The model hands back a KV cache to continue from (some keep their state inside instead)."""
    name = cache_kwarg(model)
    if name is None:
        return False
    with torch.no_grad():
        return output_cache(model(input_ids=torch.tensor([[5, 6]]), use_cache=True)) is not None


def _takes_static_cache(model: Any) -> bool:
    import transformers

    if not hasattr(transformers, "StaticCache") or hasattr(model, "_setup_cache"):
        return False  # none before 4.38; 4.38-4.40 attach it to the layers instead
    try:
        rows = scenario_rows(SCENARIOS[0])
        run_batched(model, rows, ((1, 1),), ((False, False),), cache=static_cache(model, 2, 8))
        return True
    except Exception:  # noqa: BLE001 - the model's own cache type (recurrent state, old release): no static probe
        return False


def _run_scenario(model: Any, adapter: Optional[Adapter], probe: _Probe) -> Row:
    rows = scenario_rows(probe.scenario)
    results = []
    errors = []
    for use_patch in (False, True):
        try:
            if adapter is None:
                by_hand = use_patch and "position_ids" in inspect.signature(model.forward).parameters
                got = _batched(_PositionsByHand(model) if by_hand else model, model, rows, probe)
            elif use_patch:
                with engine.patched(adapter.arch):
                    got = _batched(model, model, rows, probe)
            else:
                with engine.unpatched(adapter.arch):
                    got = _batched(model, model, rows, probe)
            results.append(max_diff(model, rows, got))
        except Exception as exc:  # noqa: BLE001 - a crash is a result of the probe
            results.append(float("nan"))
            errors.append(f"{'hfpatch' if use_patch else 'stock'}: {type(exc).__name__}: {exc}"[:160])
    return Row(probe.name, results[0], results[1], "; ".join(errors))


def _batched(caller: Any, model: Any, rows: list, probe: _Probe) -> list:
    cache = probe.cache() if probe.cache is not None else None
    return run_batched(
        caller, rows, probe.scenario.chunks, probe.scenario.left, cache=cache, mask_width=probe.mask_width,
        cache_name=cache_kwarg(model),
    )  # fmt: skip


class _PositionsByHand:
    """Calls ``model`` with ``position_ids = cumsum(mask) - 1`` at the new tokens' columns: what hfpatch
    would do, for a model it does not patch."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, **kwargs: Any) -> Any:
        from .positions import new_token_positions

        mask, ids = kwargs["attention_mask"], kwargs["input_ids"]
        kwargs["position_ids"] = new_token_positions(mask, ids.shape[1])
        return self.model(**kwargs)
