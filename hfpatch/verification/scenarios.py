"""The scenarios ``verify`` runs, and the machinery that runs them: rows of token ids padded into one
batch, split into KV-cached calls, each row's real outputs compared with the row run alone, unpadded.
What differs between a decoder-only model and the decoder (or encoder) of an encoder-decoder model is
an :class:`Inputs`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import torch

from .._compat import attaches_static_caches, cache_name, new_static_cache, output_cache
from ..caches import attends
from ..positions import new_token_positions
from ..tolerances import FP32, NOISE_CAP, WRONG
from .tiny import PAD, VOCAB

__all__ = [
    "DECODER_ONLY",
    "ENCODER_SCENARIO",
    "SCENARIOS",
    "Inputs",
    "PositionsByHand",
    "Scenario",
    "MORE_SCENARIOS",
    "PACKED_SCENARIOS",
    "Probe",
    "probes",
    "run_alone",
    "cache_inputs",
    "control_noise",
    "noise_tolerance",
    "encoder_input",
    "is_seq2seq",
    "ModelProbes",
    "model_probes",
    "outputs",
    "rows_of",
    "run_batch",
    "scenario_rows",
    "seq2seq_inputs",
    "static_cache",
    "takes_static_cache",
]


class Scenario(NamedTuple):
    """Rows of real tokens, padded into one batch and split into calls (KV-cached where more than one)."""

    name: str
    lengths: tuple[int, ...]  # real tokens per row
    chunks: tuple[tuple[int, ...], ...]  # chunks[c][r]: row r's tokens in call c
    left: tuple[tuple[bool, ...], ...]  # left[c][r]: row r is padded on the left in call c
    cached: bool = True  # more than one call: needs a KV cache
    # a packed batch: the batch row each sequence (each of ``lengths``) is packed into, one after the other
    # with positions restarting, rows right-padded to the longest; () for one sequence a row
    packed_into: tuple[int, ...] = ()
    mask: bool = True  # pass the 2-D mask (a packed batch: without one where no row is padded)


SCENARIOS = (
    # transformers #18104: a right-padded cached prefix, then one more token per row
    Scenario("right-padded prefix + 1 token", (4, 5), ((3, 4), (1, 1)), ((False, False), (False, False))),
    Scenario("left padding, one call", (3, 6), ((3, 6),), ((True, True),), cached=False),
    Scenario(
        "variable prefixes and suffixes",
        (5, 5, 3),
        ((3, 4, 1), (2, 1, 2)),
        ((False,) * 3, (False, True, False)),
    ),
    # a left-padded prompt in the cache, continued by several tokens (4.36-4.37's SDPA mask code)
    Scenario("left-padded prefix + 2 tokens", (4, 6), ((2, 4), (2, 2)), ((True, True), (False, False))),
)
# what hfpatch.testing runs besides: right padding in one call, a right-padded prefix continued by
# several tokens, and rows split into four cached calls, padded left or right in each
MORE_SCENARIOS = (
    Scenario("right padding, one call", (3, 6), ((3, 6),), ((False, False),), cached=False),
    Scenario("right-padded prefix + 3 tokens", (5, 7), ((2, 4), (3, 3)), ((False, False), (False, False))),
    Scenario(
        "four cached calls",
        (6, 4, 5),
        ((2, 1, 2), (1, 2, 0), (2, 0, 2), (1, 1, 1)),
        ((False, True, False), (True, False, False), (False, False, True), (False, True, False)),
    ),
)


def packed(name: str, lengths: tuple[int, ...], rows: tuple[int, ...], mask: bool) -> Scenario:
    """A batch of ``lengths`` sequences packed into the batch ``rows`` (one a sequence), in one call."""
    return Scenario(name, lengths, (lengths,), ((False,) * len(lengths),), False, rows, mask)


# rows that pack several sequences, positions restarting (DataCollatorWithFlattening's batch, TRL's
# padding_free), each sequence against itself alone
PACKED_SCENARIOS = (
    packed("packed: three sequences in a row, no mask", (6, 3, 5), (0, 0, 0), mask=False),
    packed("packed: three sequences in a row, an all-ones mask", (4, 5, 2), (0, 0, 0), mask=True),
    packed("packed: two right-padded rows", (5, 3, 4, 2), (0, 0, 1, 1), mask=True),
)


def scenario_rows(scenario: Scenario, seed: int = 1, vocab: int = VOCAB) -> list[list[int]]:
    """The token ids of a scenario's rows (fixed by ``seed``), below ``vocab``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in scenario.lengths]


class Probe(NamedTuple):
    """One scenario as it runs on a model."""

    name: str
    scenario: Scenario
    cache: Optional[Callable[[], Any]] = None  # makes the cache the first call starts from (a StaticCache)
    width: Optional[int] = None  # pad every mask with zeros to this many columns (a static cache's)
    inputs: Any = None  # Inputs (None: a decoder-only model's)
    family: str = ""  # what it checks: PADDING, CACHED, STATIC, WINDOW, ROPE or PACKED (hfpatch.testing's)


PADDING, CACHED, STATIC, WINDOW, ROPE, PACKED = "padding", "cached", "static", "window", "rope", "packed"


def probes(
    scenarios: Sequence[Scenario],
    inputs: Any,
    cached: bool,
    prefix: str = "",
    static: Optional[Callable[[int, int], Any]] = None,
    static_width: bool = True,
    window: Optional[int] = None,
    rope: Optional[tuple[str, int]] = None,
    packs: bool = True,
) -> list[Probe]:
    """The probes of a model: ``scenarios`` (the cached ones where the model returns a cache), the
    variable one again with a static cache where ``static`` makes one (``static(batch, slots)``; with a
    mask of every slot where ``static_width``, else of past + new), a right-padded prefix past the
    ``window`` where there is one to probe, and rows on both sides of a scaled ``rope``'s original
    context (its kind and that context); packed scenarios where ``packs`` (a decoder-only model)."""
    found = [
        Probe(
            prefix + s.name,
            s,
            inputs=inputs,
            family=PACKED if s.packed_into else CACHED if s.cached else PADDING,
        )
        for s in scenarios
        if (cached or not s.cached) and (not s.packed_into or packs)
    ]
    if static is not None and cached:
        variable = SCENARIOS[2]
        factory = functools.partial(static, len(variable.lengths), STATIC_SLOTS)
        width = STATIC_SLOTS if static_width else None
        found.append(Probe(f"{prefix}{variable.name}, StaticCache", variable, factory, width, inputs, STATIC))
    if cached and window is not None and window <= MAX_WINDOW_PROBE:  # holes inside a window
        lengths = (window + 6, window + 3)
        beyond = Scenario(f"{prefix}right-padded prefix past the window ({window}) + 2", lengths,
                          ((window + 4, window + 1), (2, 2)), ((False, False), (True, False)))  # fmt: skip
        found.append(Probe(beyond.name, beyond, inputs=inputs, family=WINDOW))
    if rope is not None and rope[1] <= MAX_ROPE_PROBE:  # a short row batched with one past the context
        kind, threshold = rope
        lengths = (max(2, threshold // 2), threshold + 8)
        name = f"{prefix}{kind}: rows of {lengths[0]} and {lengths[1]} tokens, one call"
        crossing = Scenario(name, lengths, (lengths,), ((False, False),), cached=False)
        found.append(Probe(crossing.name, crossing, inputs=inputs, family=ROPE))
    return found


class ModelProbes(NamedTuple):
    """What :func:`model_probes` found: the probes, whether the model returns a KV cache (else no
    cached scenario is among them), and whether it takes a StaticCache (where one was asked for)."""

    probes: list[Probe]
    cached: bool
    takes_static: bool


def model_probes(
    model: Any,
    scenarios: Sequence[Scenario],
    inputs: Any,
    static: bool,
    window: Optional[int] = None,
    rope: Optional[tuple[str, int]] = None,
    packs: bool = True,
) -> ModelProbes:
    """The probes of ``model`` (for ``verify`` and ``hfpatch.testing`` alike): its cached scenarios
    where it returns a cache, the StaticCache one where ``static`` asks and it takes one (a mask of every
    slot for a decoder-only model, of past + new for a decoder, as generate() gives each), and those of
    :func:`probes`; an encoder-decoder model's decoder scenarios are named so."""
    seq2seq = is_seq2seq(model)
    cached = cache_inputs(model, inputs)
    inputs = cached if cached is not None else inputs
    takes = static and cached is not None and takes_static_cache(model, inputs)
    found = probes(
        scenarios,
        inputs,
        cached=cached is not None,
        prefix="decoder: " if seq2seq else "",
        static=functools.partial(static_cache, model) if takes else None,
        static_width=not seq2seq,
        window=window,
        rope=rope,
        packs=packs,
    )
    return ModelProbes(found, cached is not None, takes)


STATIC_SLOTS = 16
MAX_ROPE_PROBE = 1024  # longest original context the rope scenario probes (a row past it, in one call)
MAX_WINDOW_PROBE = 1024  # longest window the window scenario probes (a right-padded prefix past it)


class Inputs(NamedTuple):
    """What differs between a decoder-only model and the decoder (or encoder) of an encoder-decoder one:
    the names of the padded inputs, each row's own fixed inputs besides, the pad id, what is compared."""

    ids: str = "input_ids"  # the padded token ids
    mask: str = "attention_mask"  # their 2-D mask, past + new tokens
    positions: str = "position_ids"  # what the second column passes by hand, for a model not patched
    fixed: tuple[tuple[str, torch.Tensor], ...] = ()  # (name, [rows, ...]): row r's own, unpadded
    pad: int = PAD
    encoder: bool = False  # compare the encoder's hidden states (else logits, or a base model's states)
    # pass use_cache=True; an encoder-decoder model's config says it already (SwitchTransformers hands the
    # flag to its encoder too, which raises)
    use_cache: bool = True
    channels: int = (
        0  # decoder inputs of audio codes [batch, tokens, channels] (Dia): each token on every one
    )
    # a prefix LM: each row alone runs through the scenario's same cached calls, with a mask of ones (in
    # one call, its tokens would attend each other both ways)
    prefix_lm: bool = False
    # a model that runs only without the cache it makes itself (BLT on 5.24: plain_call): uncached calls
    # pass use_cache=False, and the cached scenarios are not run
    uncached: bool = False

    def tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[batch, tokens]`` as the model takes them."""
        return ids[..., None].expand(*ids.shape, self.channels).contiguous() if self.channels else ids

    def cache_kwargs(self, name: Optional[str], cache: Any) -> dict[str, Any]:
        """The cache argument (``name``: the release's, None for no cache) and the ``use_cache`` flag."""
        if name is None:
            return {"use_cache": False} if self.uncached else {}
        flag = {"use_cache": True} if self.use_cache else {}
        return {name: cache, **flag}

    def row(self, r: int, batch: int) -> dict[str, torch.Tensor]:
        """The fixed inputs of rows ``r .. r + batch``."""
        return {name: value[r : r + batch] for name, value in self.fixed}

    def outputs(self, out: Any) -> torch.Tensor:
        """``[batch, tokens, ...]``: audio codes' logits ``[batch * channels, tokens, vocab]`` regrouped."""
        if self.encoder:
            return out.encoder_last_hidden_state
        logits = outputs(out)
        if self.channels:
            return logits.reshape(-1, self.channels, *logits.shape[1:]).transpose(1, 2)
        return logits


DECODER_ONLY = Inputs()
ENCODER_ROWS = 3  # encoder inputs built per row: enough for every scenario
ENCODER_SCENARIO = Scenario(
    "encoder: left padding, one call", (5, 3), ((5, 3),), ((True, True),), cached=False
)


def is_seq2seq(model: Any) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def seq2seq_inputs(model: Any) -> Inputs:
    """The decoder's inputs, each row with its own unpadded encoder input (``TypeError`` or
    ``AttributeError`` where the config does not say how to build it)."""
    encoder = encoder_input(model, ENCODER_ROWS)
    decoder = getattr(model.config, "decoder_config", None)  # Dia's (the others keep theirs on the config)
    pad = next(
        (
            p
            for p in (getattr(c, "pad_token_id", None) for c in (model.config, decoder))
            if isinstance(p, int)
        ),
        PAD,
    )
    channels = getattr(decoder, "num_channels", None) or 0  # audio codes: [batch, tokens, channels]
    fixed = ((model.main_input_name, encoder),)
    names = ("decoder_input_ids", "decoder_attention_mask", "decoder_position_ids")
    return Inputs(*names, fixed, pad, use_cache=False, channels=channels)


def encoder_input(model: Any, rows: int, seed: int = 0) -> torch.Tensor:
    """Random encoder inputs of an encoder-decoder model, one per row, none padded, from its config:
    token ids, raw audio (``input_values``), or speech features: Whisper's ``[mel bins, frames]`` (twice
    its encoder's positions), else ``[frames, features]`` with the features the config names."""
    generator = torch.Generator().manual_seed(seed)
    config, name = model.config, model.main_input_name
    if name == "inputs":  # a wrapper of any encoder (speech-encoder-decoder): what its encoder takes
        name, config = model.get_encoder().main_input_name, model.get_encoder().config
    if name == "input_ids":
        return torch.randint(3, VOCAB, (rows, 5), generator=generator)
    if name == "input_values":
        return torch.randn(rows, 4000, generator=generator)
    if getattr(config, "num_mel_bins", None) and getattr(config, "max_source_positions", None):
        return torch.randn(rows, config.num_mel_bins, 2 * config.max_source_positions, generator=generator)
    candidates = (
        getattr(getattr(config, "encoder_config", None), "num_mel_bins", None),  # Parakeet encoders
        getattr(config, "input_feat_per_channel", 0) * getattr(config, "input_channels", 0),  # Speech2Text
        getattr(config, "feature_projection_input_dim", None),  # SeamlessM4T's speech encoder
    )
    features = next((value for value in candidates if value), None)
    if features is None:
        raise TypeError(f"{type(config).__name__} names no count of {name} features this probe knows")
    return torch.randn(rows, 64, features, generator=generator)


def rows_of(scenario: Scenario, pad: int, vocab: int = VOCAB) -> list[list[int]]:
    """The scenario's rows (:func:`scenario_rows`), none of their tokens the pad id."""
    rows = scenario_rows(scenario, vocab=vocab)
    return [[token if token != pad else (pad + 1) % vocab or 1 for token in row] for row in rows]


def run_batch(
    call: Callable[..., Any],
    rows: list,
    scenario: Scenario,
    cache_kw: Optional[str],
    cache: Optional[Callable[[], Any]] = None,
    width: Optional[int] = None,
    inputs: Inputs = None,  # type: ignore[assignment]
) -> list[torch.Tensor]:
    """Run ``rows`` as one padded batch in the scenario's calls (KV-cached under ``cache_kw``, the
    first starting from ``cache()`` where given); each row's real outputs, in order."""
    inputs = inputs or DECODER_ONLY
    if scenario.packed_into:
        return run_packed(call, rows, scenario, inputs)
    batch, taken = len(rows), [0] * len(rows)
    mask = torch.zeros(batch, 0, dtype=torch.long)
    pieces: list[list[torch.Tensor]] = [[] for _ in rows]
    name = cache_kw if scenario.cached else None
    cache = cache() if cache is not None else None
    for counts, lefts in zip(scenario.chunks, scenario.left):
        new = max(counts)
        ids = torch.full((batch, new), inputs.pad)
        real = torch.zeros(batch, new, dtype=torch.long)
        starts = [new - n if is_left else 0 for n, is_left in zip(counts, lefts)]
        for r, (n, start) in enumerate(zip(counts, starts)):
            ids[r, start : start + n] = torch.tensor(rows[r][taken[r] : taken[r] + n])
            real[r, start : start + n] = 1
            taken[r] += n
        mask = torch.cat([mask, real], dim=1)
        call_mask = (
            mask if width is None else torch.cat([mask, mask.new_zeros(batch, width - mask.shape[1])], 1)
        )
        kwargs = inputs.cache_kwargs(name, cache)
        with torch.no_grad():
            out = call(
                **{inputs.ids: inputs.tokens(ids), inputs.mask: call_mask}, **inputs.row(0, batch), **kwargs
            )
        returned = output_cache(out) if kwargs else None
        cache = returned if returned is not None else cache  # some releases return a new cache object
        for r, (n, start) in enumerate(zip(counts, starts)):
            pieces[r].append(inputs.outputs(out)[r, start : start + n])
    return [torch.cat(p) for p in pieces]


def run_packed(
    call: Callable[..., Any], rows: list, scenario: Scenario, inputs: Inputs
) -> list[torch.Tensor]:
    """Run the sequences ``rows`` packed as ``scenario.packed_into`` says, in one call with the positions
    restarting at each (and the 2-D mask where the scenario passes one: a padded batch always); each
    sequence's outputs, in order."""
    batch = max(scenario.packed_into) + 1
    lines: list[list[int]] = [[] for _ in range(batch)]
    where = []
    for r, into in enumerate(scenario.packed_into):
        where.append((into, len(lines[into])))
        lines[into] += list(rows[r])
    width = max(len(line) for line in lines)
    ids = torch.full((batch, width), inputs.pad)
    positions = torch.zeros(batch, width, dtype=torch.long)
    real = torch.zeros(batch, width, dtype=torch.long)
    for r, (into, start) in enumerate(where):
        n = len(rows[r])
        ids[into, start : start + n] = torch.tensor(rows[r])
        positions[into, start : start + n] = torch.arange(n)
        real[into, start : start + n] = 1
    kwargs = {inputs.ids: inputs.tokens(ids), inputs.positions: positions, **inputs.cache_kwargs(None, None)}
    if scenario.mask or not bool(real.all()):
        kwargs[inputs.mask] = real
    with torch.no_grad():
        out = inputs.outputs(call(**kwargs, **inputs.row(0, batch)))
    return [out[into, start : start + len(rows[r])] for r, (into, start) in enumerate(where)]


def run_alone(
    call: Callable[..., Any],
    r: int,
    row: Sequence[int],
    cache_kw: Optional[str],
    inputs: Inputs = None,  # type: ignore[assignment]
    counts: Sequence[int] = (),
) -> torch.Tensor:
    """Row ``r`` alone: its tokens unpadded, its own fixed inputs, one call, no mask; a prefix LM's row
    runs through the same calls (``counts``: its tokens in each), with a mask of ones. Its outputs."""
    inputs = inputs or DECODER_ONLY
    calls = [n for n in counts if n] if inputs.prefix_lm else [len(row)]
    name = cache_kw if len(calls) > 1 else None
    cache, taken, pieces = None, 0, []
    for n in calls:
        ids = torch.tensor([list(row[taken : taken + n])])
        taken += n
        mask = {inputs.mask: torch.ones(1, taken, dtype=torch.long)} if inputs.prefix_lm else {}
        kwargs = inputs.cache_kwargs(name, cache)
        with torch.no_grad():
            out = call(**{inputs.ids: inputs.tokens(ids)}, **inputs.row(r, 1), **mask, **kwargs)
        cache = output_cache(out) if kwargs else None
        pieces.append(inputs.outputs(out)[0])
    return torch.cat(pieces)


def outputs(out: Any) -> torch.Tensor:
    """Logits, or a base model's hidden states."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


class PositionsByHand:
    """Calls ``model`` with positions from the mask (``position_ids``, or an encoder-decoder model's
    ``decoder_position_ids``): what hfpatch would do, for a model it does not patch."""

    def __init__(self, model: Any, inputs: Inputs = DECODER_ONLY) -> None:
        self.model, self.inputs = model, inputs

    def __call__(self, **kwargs: Any) -> Any:
        mask, ids = kwargs[self.inputs.mask], kwargs[self.inputs.ids]
        kwargs[self.inputs.positions] = new_token_positions(mask, ids.shape[1])
        return self.model(**kwargs)


def cache_inputs(model: Any, inputs: Inputs = DECODER_ONLY) -> Optional[Inputs]:
    """``inputs`` (or with ``use_cache=True`` passed, where the config does not say it) where the model
    hands back a KV cache to continue from; None where it does not (some keep their state inside)."""
    if cache_name(model) is None or inputs.uncached:
        return None
    tries = [inputs] if inputs.use_cache else [inputs, inputs._replace(use_cache=True)]
    for i, attempt in enumerate(tries):
        flag = {"use_cache": True} if attempt.use_cache else {}
        try:
            with torch.no_grad():
                out = model(
                    **{attempt.ids: attempt.tokens(torch.tensor([[5, 6]]))}, **attempt.row(0, 1), **flag
                )
        except Exception:  # noqa: BLE001 - the flag passed on where it is not taken: no cache to probe
            if i == 0:
                raise
            return None
        if output_cache(out) is not None:
            return attempt
    return None


def static_cache(model: Any, batch: int, length: int) -> Any:
    """A ``StaticCache``; for an encoder-decoder model, its decoder's self-attention cache inside an
    ``EncoderDecoderCache`` (the cross-attention's grows), as ``generate(cache_implementation="static")``
    makes it."""
    import transformers

    cache = new_static_cache(model, batch, length)
    if is_seq2seq(model):
        return transformers.EncoderDecoderCache(cache, transformers.DynamicCache())
    return cache


def takes_static_cache(model: Any, inputs: Inputs = DECODER_ONLY) -> bool:
    import transformers

    if not hasattr(transformers, "StaticCache") or attaches_static_caches(model):
        return False  # none before 4.38; 4.38-4.40 attach it to the layers instead
    seq2seq = is_seq2seq(model)
    if seq2seq and not hasattr(transformers, "EncoderDecoderCache"):
        return False
    # a decoder's probe passes a padded mask of past + new: some releases' SDPA path takes none with a
    # StaticCache (an all-ones mask is dropped before it counts)
    mask = {inputs.mask: torch.tensor([[0, 1]])} if seq2seq else {}
    try:
        with torch.no_grad():  # a model whose own cache holds no attention layer (5.x Mamba's): no static one
            ids = inputs.tokens(torch.tensor([[5, 6]]))
            own = output_cache(model(**{inputs.ids: ids}, **inputs.row(0, 1), use_cache=True))
        if getattr(own, "layers", None) and not any(attends(layer) for layer in own.layers):
            return False
        if own is not None and not isinstance(own, (tuple, list, transformers.cache_utils.Cache)):
            return False  # (a cache class of its own: xLSTM's, 4.x Mamba's)
        with torch.no_grad():
            model(
                **{inputs.ids: inputs.tokens(torch.tensor([[5, 6]]))},
                **inputs.row(0, 1),
                **mask,
                use_cache=True,
                **{cache_name(model): static_cache(model, 1, 8)},
            )
        return True
    except Exception:  # noqa: BLE001 - the model's own cache type (recurrent state, old release): no static probe
        return False


def control_noise(
    call: Callable, rows: list, scenario: Scenario, cache_kw: Optional[str], inputs: Any, alone: list
) -> float:
    """A scenario's controls, against the same rows alone (``alone``), each changing no position: its
    rows right-padded into one batch in one call, and (a cached scenario) each row alone, unpadded,
    through the scenario's cached calls. The larger is the outputs' own fp32 noise at these lengths and
    splits; 0 where a control is itself off by more than WRONG (a model wrong even there has none)."""
    control = Scenario(
        "control", tuple(map(len, rows)), (tuple(map(len, rows)),), ((False,) * len(rows),), False
    )
    got = run_batch(call, rows, control, cache_kw, None, None, inputs)
    if scenario.cached and cache_kw is not None and not inputs.prefix_lm:
        split = inputs._replace(prefix_lm=True)  # a row through its calls, a mask of ones: no padding
        got += [
            run_alone(call, r, row, cache_kw, split, [c[r] for c in scenario.chunks])
            for r, row in enumerate(rows)
        ]
        alone = [*alone, *alone]
    noise = max(((g.float() - a.float()).abs().max().item() for g, a in zip(got, alone)), default=0.0)
    return noise if noise <= WRONG else 0.0


def noise_tolerance(
    call: Callable, rows: list, scenario: Scenario, cache_kw: Optional[str], inputs: Any, alone: list
) -> float:
    """The fp32 tolerance of a scenario from its controls (:func:`control_noise`): FP32, or four times
    their noise where that is more, at most NOISE_CAP (a wrong position is 1e-2 off or more); FP32 where
    a control cannot run."""
    try:
        noise = control_noise(call, rows, scenario, cache_kw, inputs, alone)
    except Exception:  # noqa: BLE001 - no control: the fixed tolerance decides
        return FP32
    return max(FP32, min(4 * noise, NOISE_CAP))
