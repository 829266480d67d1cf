"""``hfpatch.verify(model)``: run padded, KV-cached batches on stock transformers and with hfpatch, and
measure every real token's output against its row run alone, unpadded, in one call.

Both sides run in the calling thread only (``unpatched()`` and ``patched()`` are thread-local): other
threads using the same model meanwhile keep what they had.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from packaging.version import Version

from . import engine
from .declarations import Adapter
from .plans import attaches_static_caches
from .positions import new_token_positions
from .rope import per_row_scaling, scaled_rope
from .support import installed_transformers
from .tiny import PAD, VOCAB, seq2seq_auto_class, tiny_model, tiny_multimodal, tiny_seq2seq
from .windows import configured_window, positional, smallest_window

__all__ = [
    "SCENARIOS",
    "TOLERANCE",
    "WRONG",
    "CannotVerify",
    "Inputs",
    "Row",
    "Scenario",
    "Verification",
    "cache_name",
    "encoder_input",
    "new_static_cache",
    "output_cache",
    "verify",
]

TOLERANCE = 1e-5  # fp32, max |difference| at any real token: exact (the one tolerance of every check)
WRONG = 1e-3  # a difference above this is a wrong result, not float noise (between the two: noise)
STATIC_SLOTS = 16
MAX_ROPE_PROBE = 1024  # longest original context the rope scenario probes (a row past it, in one call)
MAX_WINDOW_PROBE = 1024  # longest window the window scenario probes (a right-padded prefix past it)
_V4_56 = Version("4.56")  # from_pretrained's torch_dtype became dtype
# the attention a tiny image-text-to-text model of these types is built with for ``verify TYPE``, where
# the release's default hits a declared limit of the adapter (the limit stays in the notes)
TINY_ATTENTION = {"paligemma": "eager"}  # SDPA from 5.9: wrong with the right positions, on stock alike


class CannotVerify(ValueError):
    """``verify`` cannot run on this input: no such checkpoint directory, an unknown model type, or a
    model that is neither a causal LM, an image-text-to-text model nor an encoder-decoder model (the
    message says which, in one line)."""


class Scenario(NamedTuple):
    name: str
    lengths: tuple[int, ...]  # real tokens per row
    chunks: tuple[tuple[int, ...], ...]  # chunks[c][r]: row r's tokens in call c
    left: tuple[tuple[bool, ...], ...]  # left[c][r]: row r is padded on the left in call c
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
    """The token ids of a scenario's rows (fixed by ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in scenario.lengths]


class Row(NamedTuple):
    scenario: str
    stock: float  # max |diff| on stock transformers (nan: it raised)
    patched: float  # with hfpatch; for a model hfpatch does not patch, with positions from the mask by hand
    error: str = ""  # what raised, if something did


class Verification(NamedTuple):
    """What :func:`verify` found: one :class:`Row` per scenario, whether hfpatch patches the model,
    its state, and notes (declared limits, why a scenario is not probed). ``print()`` it for a table."""

    arch: str
    state: str
    rows: tuple[Row, ...]
    notes: tuple[str, ...]
    patches: bool = True  # an adapter of hfpatch patches this model on the installed release
    by_hand: bool = True  # not patched: the second column passed positions by hand (False: it takes none)

    @property
    def ok(self) -> bool:
        """What the model gives with hfpatch is exact in every scenario (max |diff| <= 1e-5, fp32): the
        patched column where hfpatch patches the model, stock's where it does not."""
        column = [row.patched if self.patches else row.stock for row in self.rows]
        return bool(column) and all(value <= TOLERANCE for value in column)

    @property
    def stock_wrong(self) -> bool:
        return any(not row.stock <= WRONG for row in self.rows)

    @property
    def verdict(self) -> str:
        if not self.rows:
            return "not checked"
        by_hand_ok = all(row.patched <= TOLERANCE for row in self.rows)
        if self.patches:
            if self.ok:
                return "fixed by hfpatch" if self.stock_wrong else "right on stock and with hfpatch"
            return "WRONG with hfpatch"
        if self.ok:
            return "right on stock (hfpatch does not patch it)"
        if not self.by_hand:
            return "wrong on stock (hfpatch does not patch it; it takes no positions to pass by hand)"
        if by_hand_ok:
            return "wrong on stock; positions from the mask would fix it, but hfpatch does not patch it"
        return "wrong on stock, and positions from the mask do not fix it (hfpatch does not patch it)"

    def __str__(self) -> str:
        lines = [f"{self.arch}: {self.verdict} (hfpatch state: {self.state})"]
        second = "hfpatch max|diff|" if self.patches else "positions by hand"
        width = max([44, *(len(row.scenario) for row in self.rows)])
        header = f"  {'scenario':{width}}  {'stock max|diff|':>16}  {second:>18}"
        lines += [header, "  " + "-" * (len(header) - 2)]
        for row in self.rows:
            line = f"  {row.scenario:{width}}  {row.stock:16.2e}  {row.patched:18.2e}  {row.error}"
            lines.append(line.rstrip())
        lines += [f"  note: {note}" for note in self.notes]
        lines.append(f"  exact = max|diff| <= {TOLERANCE:g} (fp32, vs each row run alone, unpadded)")
        return "\n".join(lines)


def verify(model: Union[str, os.PathLike, Any], static: bool = True) -> Verification:
    """Probe ``model`` for the padding and KV-cache bug, stock vs hfpatch.

    ``model`` is a causal-LM instance (or a base model: its hidden states are compared), a local
    checkpoint directory (loaded with ``from_pretrained``), or a model type (``"qwen2"``: built tiny
    from its config). The scenarios (:data:`SCENARIOS`): left padding in one call, a right-padded
    cached prefix + 1 token, variable prefixes and suffixes, a left-padded cached prefix + 2 tokens,
    and the variable one again with a ``StaticCache`` where the model takes one (cached ones only
    where the model returns a cache). Each runs on stock and with hfpatch's patch for this model, in
    this thread only, and every real token is compared with its row run alone. For a model hfpatch
    does not patch, the second column passes positions from the mask by hand: whether they would fix
    it. An encoder-decoder model (``config.is_encoder_decoder``: BART, T5, Whisper ...) runs the same
    scenarios on its decoder (``decoder_input_ids``, ``decoder_attention_mask``), each row with its own
    fixed, unpadded encoder input (token ids, or speech features built from the config), then a
    left-padded encoder input where the encoder takes token ids and a mask (its hidden states compared).
    An image-text-to-text model (PaliGemma, Qwen2-VL, LLaVA ...) runs the decoder-only scenarios on its
    text path (``input_ids`` and ``attention_mask``, no image); a prefix LM among them (PaliGemma on
    releases where a call's tokens attend each other both ways) is compared with each row alone through
    the same cached calls, with a mask of ones. Raises :class:`CannotVerify` (a ``ValueError``) for no
    such directory, an unknown model type, or a model that is none of those.

    >>> result = hfpatch.verify("qwen2")   # doctest: +SKIP
    >>> result.ok, print(result)           # doctest: +SKIP
    """
    built = isinstance(model, str) and not os.path.isdir(model)  # a model type: built tiny here
    model = _load(model)
    model_type = getattr(model.config, "model_type", "?")
    seq2seq = _is_seq2seq(model)
    inputs = _seq2seq_inputs(model, model_type) if seq2seq else DECODER_ONLY
    notes = []
    if seq2seq:
        _check_runs(model, model_type, inputs)
    elif not _check_causal(model, model_type, prefix_lm=_is_multimodal(model)):
        inputs = inputs._replace(prefix_lm=True)
        notes.append("a prefix LM (a call's tokens attend each other both ways): each row alone runs "
                     "through the same cached calls, with a mask of ones")  # fmt: skip
    adapter = _adapter_of_class(model) or engine.adapter_for(model_type)
    entry = engine.status().get(adapter.arch if adapter is not None else model_type)
    if adapter is not None and model_type not in (adapter.arch, *adapter.aliases):
        notes.append(f"{model_type} runs {adapter.cls}, patched by the {adapter.arch!r} adapter")
    attention = TINY_ATTENTION.get(model_type)
    if built and attention is not None:
        notes.append(f"built tiny with {attention} attention")
    probed = not seq2seq or _decoder_takes_positions(adapter)
    notes += _limits(model, adapter, probed=probed, rope=not seq2seq)
    if entry is not None and entry.reason and entry.state != engine.APPLIED:
        notes.append(entry.reason)
    patches = adapter is not None and entry is not None and entry.support in ("tested", "untested newer")
    probes = _probes(model, adapter, static and adapter is not None, inputs)
    if seq2seq:
        probes += _encoder_probes(model, inputs, notes)
        if static and adapter is not None and not any(probe[2] is not None for probe in probes):
            notes.append("the decoder takes no StaticCache here: not probed")
    rows = tuple(_run_scenario(model, adapter if patches else None, *probe) for probe in probes)
    if seq2seq and patches and not adapter.family.seq2seq:
        notes.append(f"the {adapter.arch!r} adapter patches the decoder ({adapter.cls}) only: the encoder's "
                     "positions are transformers' (pad encoder inputs on the right)")  # fmt: skip
    if not any(probe[1].cached for probe in probes):
        notes.append("the model returns no KV cache to continue from: the cached scenarios are not probed")
    state = entry.state if entry is not None else "unknown to hfpatch"
    by_hand = patches or inputs.positions in inspect.signature(model.forward).parameters
    if not by_hand:
        notes.append(f"the model takes no {inputs.positions}: the second column is stock's")
    elif patches and entry.state != engine.APPLIED:
        notes.append(
            f"the {adapter.arch!r} adapter is {entry.state} here: its column is what patched() gives"
        )
    return Verification(model_type, state, rows, tuple(notes), patches, by_hand)


# --- loading and checking the input ------------------------------------------------------------------


def _load(model: Any) -> Any:
    if not isinstance(model, (str, os.PathLike)):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model: expected a transformers model, a checkpoint directory or a model type, "
                            f"got {type(model).__name__}")  # fmt: skip
        return model.eval()
    text = os.fspath(model)
    import transformers

    if os.path.isdir(text):
        dtype = "dtype" if installed_transformers() >= _V4_56 else "torch_dtype"  # 4.56 renamed it
        try:
            config = transformers.AutoConfig.from_pretrained(text)
            if getattr(config, "is_encoder_decoder", False):
                auto = seq2seq_auto_class(config.model_type)
            elif _image_text_to_text(config.model_type) and config.model_type not in _causal_lm_types():
                auto = transformers.AutoModelForImageTextToText
            else:
                auto = transformers.AutoModelForCausalLM
            return auto.from_pretrained(text, **{dtype: torch.float32}).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise CannotVerify(
                f"{text}: cannot load a causal LM, an image-text-to-text or an encoder-decoder model from "
                f"this directory: "
                f"{_first_line(exc)}"
            ) from exc
    if os.sep in text or text.startswith(".") or (os.altsep and os.altsep in text):
        raise CannotVerify(f"{text}: no such checkpoint directory")
    known = list(getattr(transformers, "CONFIG_MAPPING", {}).keys())
    if text not in known:
        close = difflib.get_close_matches(text, known, n=3)
        hint = (
            f"; did you mean {' or '.join(close)}?"
            if close
            else " (python -m hfpatch architectures lists them)"
        )
        raise CannotVerify(f"{text}: not a checkpoint directory, nor a model type of transformers "
                           f"{installed_transformers()}{hint}")  # fmt: skip
    release = installed_transformers()
    try:
        encoder_decoder = getattr(transformers.AutoConfig.for_model(text), "is_encoder_decoder", False)
    except Exception:  # noqa: BLE001 - a config that needs its parts (encoder-decoder): built below or not
        encoder_decoder = False
    if encoder_decoder:
        try:
            return tiny_seq2seq(text)
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises building it, in one line
            raise CannotVerify(
                f"{text}: cannot build a tiny encoder-decoder model on transformers {release}: "
                f"{_first_line(exc)}"
            ) from exc
    if _image_text_to_text(text) and text not in _causal_lm_types():
        try:
            return tiny_multimodal(text, attention=TINY_ATTENTION.get(text))
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises building it, in one line
            raise CannotVerify(
                f"{text}: cannot build a tiny image-text-to-text model on transformers {release}: "
                f"{_first_line(exc)}"
            ) from exc
    try:
        return tiny_model(text)
    except ValueError as exc:
        message = (
            f"{text}: transformers {release} has no causal-LM class for it, and it is neither an "
            "image-text-to-text nor an encoder-decoder model (hfpatch covers decoder-only LMs, the text "
            "path of vision-language models and encoder-decoder models' decoders)"
        )
        raise CannotVerify(message) from exc


def _mapping(name: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, name, {})


def _causal_lm_types() -> dict[str, Any]:
    return _mapping("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")


def _image_text_to_text(model_type: str) -> bool:
    """``model_type`` has an image-text-to-text class (``AutoModelForImageTextToText``)."""
    return model_type in _mapping("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")


def _is_multimodal(model: Any) -> bool:
    """An image-text-to-text model, whose text path runs the decoder-only scenarios."""
    return _image_text_to_text(getattr(model.config, "model_type", ""))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _check_causal(model: Any, model_type: str, prefix_lm: bool = False) -> bool:
    """A causal LM's output at a token does not depend on later tokens: change the last token of a
    sequence and compare the outputs before it. A masked LM or an encoder fails this: raises, unless
    ``prefix_lm`` (an image-text-to-text model: a prefix LM, whose call attends both ways), False."""
    ids = torch.tensor([[5, 6, 7, 8]])
    other = ids.clone()
    other[0, -1] = 9
    try:
        with torch.no_grad(), engine.unpatched():
            first, second = (_outputs(model(input_ids=x))[0, :-1] for x in (ids, other))
    except Exception as exc:  # noqa: BLE001 - the model cannot run a plain call: report it in one line
        raise CannotVerify(
            f"{model_type}: a plain call model(input_ids=...) fails: {_first_line(exc)}"
        ) from exc
    if (first - second).abs().max().item() <= TOLERANCE:
        return True
    if not prefix_lm:
        raise CannotVerify(
            f"{model_type}: not a causal LM (a token's output depends on later tokens): hfpatch covers "
            "decoder-only models"
        )
    return False


def _check_runs(model: Any, model_type: str, inputs: Inputs) -> None:
    """An encoder-decoder model runs a plain call: two decoder tokens after one row's encoder input."""
    try:
        with torch.no_grad(), engine.unpatched():
            model(**{inputs.ids: inputs.tokens(torch.tensor([[5, 6]]))}, **inputs.row(0, 1))
    except Exception as exc:  # noqa: BLE001 - the model cannot run a plain call: report it in one line
        names = ", ".join(name for name, _ in inputs.fixed)
        raise CannotVerify(
            f"{model_type}: a plain call model({names}=..., {inputs.ids}=...) fails: {_first_line(exc)}"
        ) from exc


def _adapter_of_class(model: Any) -> Optional[Adapter]:
    """The adapter of the outermost module of ``model`` whose class is a declared target."""
    targets = {(a.module, a.cls): a for a in engine.registry().values()}
    for module in model.modules():
        adapter = targets.get((type(module).__module__, type(module).__name__))
        if adapter is not None:
            return adapter
    return None


def _limits(model: Any, adapter: Optional[Adapter], probed: bool = True, rope: bool = True) -> list[str]:
    """The adapter's declared limits, and (``probed``: a model whose windows the scenarios reach; ``rope``:
    and its rope scaling, a decoder-only model's) what its config sets that the scenarios do not probe."""
    notes = list(adapter.limits) if adapter is not None else []
    if not probed:
        return notes
    window = smallest_window(model, adapter.cls if adapter is not None else None)
    configured = configured_window(model)
    if configured and (adapter is None or not positional(model, adapter.cls)):
        if not any("sliding window" in note for note in notes):
            text = f"sliding window / chunked attention ({configured} tokens) left to transformers here"
            notes.append(f"{text}: where its mask applies it, by cache column, a hole from a padded "
                         "cached prefix inside the window stays wrong")  # fmt: skip
    elif window and window > MAX_WINDOW_PROBE:
        notes.append(f"sliding window / chunked attention ({window} tokens): not probed here")
    if not rope:
        return notes
    scaled = scaled_rope(model)
    if scaled is not None:
        kind, threshold = scaled
        if not per_row_scaling(kind):
            notes.append(f"{kind} rope scales rows by the batch's longest on transformers "
                         f"{installed_transformers()} (per row from 4.51, dynamic from 4.56)")  # fmt: skip
        if threshold > MAX_ROPE_PROBE:
            notes.append(f"{kind} rope past the original context ({threshold} tokens): not probed here")
    return notes


# --- the scenarios -----------------------------------------------------------------------------------


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

    def tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[batch, tokens]`` as the model takes them."""
        return ids[..., None].expand(*ids.shape, self.channels).contiguous() if self.channels else ids

    def cache_kwargs(self, name: Optional[str], cache: Any) -> dict[str, Any]:
        """The cache argument (``name``: the release's, None for no cache) and the ``use_cache`` flag."""
        flag = {"use_cache": True} if self.use_cache else {}
        return {name: cache, **flag} if name is not None else {}

    def row(self, r: int, batch: int) -> dict[str, torch.Tensor]:
        """The fixed inputs of rows ``r .. r + batch``."""
        return {name: value[r : r + batch] for name, value in self.fixed}

    def outputs(self, out: Any) -> torch.Tensor:
        """``[batch, tokens, ...]``: audio codes' logits ``[batch * channels, tokens, vocab]`` regrouped."""
        if self.encoder:
            return out.encoder_last_hidden_state
        logits = _outputs(out)
        if self.channels:
            return logits.reshape(-1, self.channels, *logits.shape[1:]).transpose(1, 2)
        return logits


DECODER_ONLY = Inputs()
Probe = tuple[str, Scenario, Optional[Callable[[], Any]], Optional[int], Inputs]
ENCODER_ROWS = 3  # encoder inputs built per row: enough for every scenario
ENCODER_SCENARIO = Scenario(
    "encoder: left padding, one call", (5, 3), ((5, 3),), ((True, True),), cached=False, holes=False
)


def _decoder_takes_positions(adapter: Optional[Adapter]) -> bool:
    """A seq2seq decoder whose forward takes ``position_ids`` (T5Gemma ...): its windows are hfpatch's to
    decide, as a decoder-only model's (the others have none)."""
    return adapter is not None and adapter.family.seq2seq and adapter.family.hands_to is None


def _is_seq2seq(model: Any) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _seq2seq_inputs(model: Any, model_type: str) -> Inputs:
    """The decoder's inputs, each row with its own unpadded encoder input."""
    try:
        encoder = encoder_input(model, ENCODER_ROWS)
    except (AttributeError, TypeError) as exc:
        raise CannotVerify(
            f"{model_type}: cannot build its encoder input from the config: {_first_line(exc)}"
        ) from exc
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


def _probes(model: Any, adapter: Optional[Adapter], static: bool, inputs: Inputs) -> list[Probe]:
    """(name, scenario, cache factory, mask width, inputs) for each scenario this model can run."""
    seq2seq = _is_seq2seq(model)
    prefix = "decoder: " if seq2seq else ""
    cached = _cache_inputs(model, inputs)
    name, inputs = (cache_name(model), cached) if cached is not None else (None, inputs)
    probes = [(prefix + s.name, s, None, None, inputs) for s in SCENARIOS if name is not None or not s.cached]
    if static and name is not None and _takes_static_cache(model, inputs):
        variable = SCENARIOS[2]
        factory = lambda: _static_cache(model, len(variable.lengths), STATIC_SLOTS)  # noqa: E731
        # decoder-only: a mask of every slot (a compiled decode loop's); a decoder: of past + new (generate's)
        width = None if seq2seq else STATIC_SLOTS
        probes.append((f"{prefix}{variable.name}, StaticCache", variable, factory, width, inputs))
    window = None
    if adapter is not None and positional(model, adapter.cls):
        window = smallest_window(model, adapter.cls)
    if name is not None and window is not None and window <= MAX_WINDOW_PROBE:  # holes inside a window
        lengths = (window + 6, window + 3)
        beyond = Scenario(f"{prefix}right-padded prefix past the window ({window}) + 2", lengths,
                          ((window + 4, window + 1), (2, 2)), ((False, False), (True, False)))  # fmt: skip
        probes.append((beyond.name, beyond, None, None, inputs))
    if seq2seq:  # rope scaling of a decoder: not probed yet
        return probes
    scaled = scaled_rope(model)
    if scaled is not None and scaled[1] <= MAX_ROPE_PROBE:  # a short row batched with one past the context
        kind, threshold = scaled
        lengths = (max(2, threshold // 2), threshold + 8)
        crossing = Scenario(f"{kind}: rows of {lengths[0]} and {lengths[1]} tokens, one call", lengths,
                            (lengths,), ((False, False),), cached=False)  # fmt: skip
        probes.append((crossing.name, crossing, None, None, inputs))
    return probes


def _encoder_probes(model: Any, decoder: Inputs, notes: list[str]) -> list[Probe]:
    """A left-padded encoder input, where the encoder takes token ids and a mask; each row with its own
    decoder tokens, unpadded. Its hidden states at real tokens are compared."""
    params = inspect.signature(model.forward).parameters
    if model.main_input_name != "input_ids" or "attention_mask" not in params:
        notes.append(f"the encoder takes {model.main_input_name}: encoder padding is not probed")
        return []
    tokens = torch.tensor([row[:3] for row in _rows(ENCODER_SCENARIO, decoder.pad)])  # 3 decoder tokens each
    inputs = Inputs(fixed=(("decoder_input_ids", decoder.tokens(tokens)),), pad=decoder.pad, encoder=True)
    return [(ENCODER_SCENARIO.name, ENCODER_SCENARIO, None, None, inputs)]


def _rows(scenario: Scenario, pad: int) -> list[list[int]]:
    """The scenario's rows (:func:`scenario_rows`), none of their tokens the pad id."""
    return [[token if token != pad else pad + 1 for token in row] for row in scenario_rows(scenario)]


def _run_scenario(
    model: Any,
    adapter: Optional[Adapter],
    name: str,
    scenario: Scenario,
    cache: Any,
    width: Optional[int],
    inputs: Inputs = DECODER_ONLY,
) -> Row:
    rows = _rows(scenario, inputs.pad)
    results, errors = [], []
    for side in ("stock", "hfpatch"):
        try:
            if adapter is None:  # not patched here: stock, then positions from the mask by hand
                by_hand = (
                    side == "hfpatch" and inputs.positions in inspect.signature(model.forward).parameters
                )
                with engine.unpatched():
                    call = _PositionsByHand(model, inputs) if by_hand else model
                    got = _run(call, model, rows, scenario, cache, width, inputs)
            else:
                context = engine.unpatched(adapter.arch) if side == "stock" else engine.patched(adapter.arch)
                with context:
                    got = _run(model, model, rows, scenario, cache, width, inputs)
            with engine.unpatched():
                results.append(
                    max(
                        _diff(model, r, row, out, inputs, [chunk[r] for chunk in scenario.chunks])
                        for r, (row, out) in enumerate(zip(rows, got))
                    )
                )
        except Exception as exc:  # noqa: BLE001 - a crash is a result of the probe
            results.append(float("nan"))
            errors.append(f"{side}: {type(exc).__name__}: {_first_line(exc)}"[:160])
    return Row(name, results[0], results[1], "; ".join(errors))


def _run(
    call: Callable[..., Any],
    model: Any,
    rows: list,
    scenario: Scenario,
    cache: Any,
    width: Optional[int],
    inputs: Inputs = DECODER_ONLY,
) -> list[torch.Tensor]:
    """Run ``rows`` as one padded batch in the scenario's KV-cached calls; each row's real outputs."""
    batch, taken = len(rows), [0] * len(rows)
    mask = torch.zeros(batch, 0, dtype=torch.long)
    pieces: list[list[torch.Tensor]] = [[] for _ in rows]
    name = cache_name(model) if scenario.cached else None
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


def _diff(
    model: Any,
    r: int,
    row: Sequence[int],
    got: torch.Tensor,
    inputs: Inputs = DECODER_ONLY,
    counts: Sequence[int] = (),
) -> float:
    """Row ``r`` alone (its tokens unpadded, its own fixed inputs, one call, no mask) against ``got``; a
    prefix LM's row alone runs through the same calls (``counts``: its tokens in each), a mask of ones."""
    calls = [n for n in counts if n] if inputs.prefix_lm else [len(row)]
    name = cache_name(model) if len(calls) > 1 else None
    cache, taken, pieces = None, 0, []
    for n in calls:
        ids = torch.tensor([list(row[taken : taken + n])])
        taken += n
        mask = {inputs.mask: torch.ones(1, taken, dtype=torch.long)} if inputs.prefix_lm else {}
        kwargs = inputs.cache_kwargs(name, cache)
        with torch.no_grad():
            out = model(**{inputs.ids: inputs.tokens(ids)}, **inputs.row(r, 1), **mask, **kwargs)
        cache = output_cache(out) if kwargs else None
        pieces.append(inputs.outputs(out)[0])
    return (torch.cat(pieces) - got).abs().max().item()


def _outputs(out: Any) -> torch.Tensor:
    """Logits, or a base model's hidden states."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


class _PositionsByHand:
    """Calls ``model`` with positions from the mask (``position_ids``, or an encoder-decoder model's
    ``decoder_position_ids``): what hfpatch would do, for a model it does not patch."""

    def __init__(self, model: Any, inputs: Inputs = DECODER_ONLY) -> None:
        self.model, self.inputs = model, inputs

    def __call__(self, **kwargs: Any) -> Any:
        mask, ids = kwargs[self.inputs.mask], kwargs[self.inputs.ids]
        kwargs[self.inputs.positions] = new_token_positions(mask, ids.shape[1])
        return self.model(**kwargs)


# --- what differs between releases: the cache's name, where it is returned, StaticCache's constructor ---


def cache_name(model: Any) -> Optional[str]:
    """``cache`` (5.24+), ``past_key_values``, or ``None`` for a model without a KV cache."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def output_cache(output: Any) -> Any:
    """The cache a call returned, from ``.cache`` (5.24+) or ``.past_key_values`` (read as keys: 5.24's
    ``past_key_values`` property logs a deprecation)."""
    keys = output.keys()
    return next((output[key] for key in ("cache", "past_key_values") if key in keys), None)


def new_static_cache(model: Any, batch: int, length: int, device: str = "cpu") -> Any:
    """A ``StaticCache`` of ``length`` slots for ``model``; its constructor's keywords changed across
    releases (``max_batch_size`` then ``batch_size``, ``device`` and ``dtype`` later inferred)."""
    import transformers

    params = inspect.signature(transformers.StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": length}
    for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", device),
                        ("dtype", torch.float32)):  # fmt: skip
        if name in params:
            kwargs[name] = value
    try:
        return transformers.StaticCache(**kwargs)
    except TypeError as exc:  # 4.54-4.55 take the layers' batch_size, device and dtype through **kwargs
        if "batch_size" not in str(exc):
            raise
        return transformers.StaticCache(**kwargs, batch_size=batch, device=device, dtype=torch.float32)


def _cache_inputs(model: Any, inputs: Inputs = DECODER_ONLY) -> Optional[Inputs]:
    """``inputs`` (or with ``use_cache=True`` passed, where the config does not say it) where the model
    hands back a KV cache to continue from; None where it does not (some keep their state inside)."""
    if cache_name(model) is None:
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


def _static_cache(model: Any, batch: int, length: int) -> Any:
    """A ``StaticCache``; for an encoder-decoder model, its decoder's self-attention cache inside an
    ``EncoderDecoderCache`` (the cross-attention's grows), as ``generate(cache_implementation="static")``
    makes it."""
    import transformers

    cache = new_static_cache(model, batch, length)
    if _is_seq2seq(model):
        return transformers.EncoderDecoderCache(cache, transformers.DynamicCache())
    return cache


def _takes_static_cache(model: Any, inputs: Inputs = DECODER_ONLY) -> bool:
    import transformers

    if not hasattr(transformers, "StaticCache") or attaches_static_caches(model):
        return False  # none before 4.38; 4.38-4.40 attach it to the layers instead
    seq2seq = _is_seq2seq(model)
    if seq2seq and not hasattr(transformers, "EncoderDecoderCache"):
        return False
    # a decoder's probe passes a padded mask of past + new: some releases' SDPA path takes none with a
    # StaticCache (an all-ones mask is dropped before it counts)
    mask = {inputs.mask: torch.tensor([[0, 1]])} if seq2seq else {}
    try:
        with torch.no_grad():
            model(
                **{inputs.ids: inputs.tokens(torch.tensor([[5, 6]]))},
                **inputs.row(0, 1),
                **mask,
                use_cache=True,
                **{cache_name(model): _static_cache(model, 1, 8)},
            )
        return True
    except Exception:  # noqa: BLE001 - the model's own cache type (recurrent state, old release): no static probe
        return False
