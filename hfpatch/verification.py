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
from .tiny import PAD, VOCAB, tiny_model
from .windows import configured_window, positional, smallest_window

__all__ = [
    "SCENARIOS",
    "TOLERANCE",
    "WRONG",
    "CannotVerify",
    "Row",
    "Scenario",
    "Verification",
    "cache_name",
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


class CannotVerify(ValueError):
    """``verify`` cannot run on this input: no such checkpoint directory, an unknown model type, or a
    model that is not a causal LM (the message says which, in one line)."""


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
        if by_hand_ok:
            return "wrong on stock; positions from the mask would fix it, but hfpatch does not patch it"
        return "wrong on stock, and positions from the mask do not fix it (hfpatch does not patch it)"

    def __str__(self) -> str:
        lines = [f"{self.arch}: {self.verdict} (hfpatch state: {self.state})"]
        second = "hfpatch max|diff|" if self.patches else "positions by hand"
        header = f"  {'scenario':44}  {'stock max|diff|':>16}  {second:>18}"
        lines += [header, "  " + "-" * (len(header) - 2)]
        for row in self.rows:
            lines.append(f"  {row.scenario:44}  {row.stock:16.2e}  {row.patched:18.2e}  {row.error}".rstrip())
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
    it. Raises :class:`CannotVerify` (a ``ValueError``) for no such directory, an unknown model type,
    or a model that is not a causal LM.

    >>> result = hfpatch.verify("qwen2")   # doctest: +SKIP
    >>> result.ok, print(result)           # doctest: +SKIP
    """
    model = _load(model)
    model_type = getattr(model.config, "model_type", "?")
    _check_causal(model, model_type)
    adapter = _adapter_of_class(model) or engine.adapter_for(model_type)
    entry = engine.status().get(adapter.arch if adapter is not None else model_type)
    notes = list(_limits(model, adapter))
    if entry is not None and entry.reason and entry.state != engine.APPLIED:
        notes.append(entry.reason)
    patches = adapter is not None and entry is not None and entry.support in ("tested", "untested newer")
    probes = _probes(model, adapter, static and adapter is not None)
    rows = tuple(_run_scenario(model, adapter if patches else None, *probe) for probe in probes)
    if len(probes) < len(SCENARIOS):
        notes.append("the model returns no KV cache to continue from: the cached scenarios are not probed")
    state = entry.state if entry is not None else "unknown to hfpatch"
    if adapter is None and "position_ids" not in inspect.signature(model.forward).parameters:
        notes.append("the model takes no position_ids: the second column is stock's")
    elif patches and entry.state != engine.APPLIED:
        notes.append(
            f"the {adapter.arch!r} adapter is {entry.state} here: its column is what patched() gives"
        )
    return Verification(model_type, state, rows, tuple(notes), patches)


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
            return transformers.AutoModelForCausalLM.from_pretrained(text, **{dtype: torch.float32}).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise CannotVerify(
                f"{text}: cannot load a causal LM from this directory: {_first_line(exc)}"
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
    try:
        return tiny_model(text)
    except ValueError as exc:
        release = installed_transformers()
        message = (
            f"{text}: transformers {release} has no causal-LM class for it (hfpatch covers decoder-only LMs)"
        )
        raise CannotVerify(message) from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _check_causal(model: Any, model_type: str) -> None:
    """A causal LM's output at a token does not depend on later tokens: change the last token of a
    sequence and compare the outputs before it. A masked LM or an encoder fails this."""
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
    if (first - second).abs().max().item() > TOLERANCE:
        raise CannotVerify(
            f"{model_type}: not a causal LM (a token's output depends on later tokens): hfpatch covers "
            "decoder-only models"
        )


def _adapter_of_class(model: Any) -> Optional[Adapter]:
    """The adapter of the outermost module of ``model`` whose class is a declared target."""
    targets = {(a.module, a.cls): a for a in engine.registry().values()}
    for module in model.modules():
        adapter = targets.get((type(module).__module__, type(module).__name__))
        if adapter is not None:
            return adapter
    return None


def _limits(model: Any, adapter: Optional[Adapter]) -> list[str]:
    notes = list(adapter.limits) if adapter is not None else []
    window = smallest_window(model, adapter.cls if adapter is not None else None)
    configured = configured_window(model)
    if configured and (adapter is None or not positional(model, adapter.cls)):
        if not any("sliding window" in note for note in notes):
            text = f"sliding window / chunked attention ({configured} tokens) left to transformers here"
            notes.append(f"{text}: where its mask applies it, by cache column, a hole from a padded "
                         "cached prefix inside the window stays wrong")  # fmt: skip
    elif window and window > MAX_WINDOW_PROBE:
        notes.append(f"sliding window / chunked attention ({window} tokens): not probed here")
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


def _probes(
    model: Any, adapter: Optional[Adapter], static: bool
) -> list[tuple[str, Scenario, Optional[Callable[[], Any]], Optional[int]]]:
    """(name, scenario, cache factory, mask width) for each scenario this model can run."""
    name = cache_name(model) if _returns_a_cache(model) else None
    probes = [(s.name, s, None, None) for s in SCENARIOS if name is not None or not s.cached]
    if static and name is not None and _takes_static_cache(model):
        variable = SCENARIOS[2]
        factory = lambda: new_static_cache(model, len(variable.lengths), STATIC_SLOTS)  # noqa: E731
        probes.append((f"{variable.name}, StaticCache", variable, factory, STATIC_SLOTS))
    window = None
    if adapter is not None and positional(model, adapter.cls):
        window = smallest_window(model, adapter.cls)
    if name is not None and window is not None and window <= MAX_WINDOW_PROBE:  # holes inside a window
        lengths = (window + 6, window + 3)
        beyond = Scenario(f"right-padded prefix past the window ({window}) + 2", lengths,
                          ((window + 4, window + 1), (2, 2)), ((False, False), (True, False)))  # fmt: skip
        probes.append((beyond.name, beyond, None, None))
    scaled = scaled_rope(model)
    if scaled is not None and scaled[1] <= MAX_ROPE_PROBE:  # a short row batched with one past the context
        kind, threshold = scaled
        lengths = (max(2, threshold // 2), threshold + 8)
        crossing = Scenario(f"{kind}: rows of {lengths[0]} and {lengths[1]} tokens, one call", lengths,
                            (lengths,), ((False, False),), cached=False)  # fmt: skip
        probes.append((crossing.name, crossing, None, None))
    return probes


def _run_scenario(
    model: Any, adapter: Optional[Adapter], name: str, scenario: Scenario, cache: Any, width: Optional[int]
) -> Row:
    rows = scenario_rows(scenario)
    results, errors = [], []
    for side in ("stock", "hfpatch"):
        try:
            if adapter is None:  # not patched here: stock, then positions from the mask by hand
                by_hand = side == "hfpatch" and "position_ids" in inspect.signature(model.forward).parameters
                with engine.unpatched():
                    got = _run(
                        _PositionsByHand(model) if by_hand else model, model, rows, scenario, cache, width
                    )
            else:
                context = engine.unpatched(adapter.arch) if side == "stock" else engine.patched(adapter.arch)
                with context:
                    got = _run(model, model, rows, scenario, cache, width)
            with engine.unpatched():
                results.append(max(_diff(model, row, out) for row, out in zip(rows, got)))
        except Exception as exc:  # noqa: BLE001 - a crash is a result of the probe
            results.append(float("nan"))
            errors.append(f"{side}: {type(exc).__name__}: {_first_line(exc)}"[:160])
    return Row(name, results[0], results[1], "; ".join(errors))


def _run(
    call: Callable[..., Any], model: Any, rows: list, scenario: Scenario, cache: Any, width: Optional[int]
) -> list[torch.Tensor]:
    """Run ``rows`` as one padded batch in the scenario's KV-cached calls; each row's real outputs."""
    batch, taken = len(rows), [0] * len(rows)
    mask = torch.zeros(batch, 0, dtype=torch.long)
    pieces: list[list[torch.Tensor]] = [[] for _ in rows]
    name = cache_name(model)
    cache = cache() if cache is not None else None
    for counts, lefts in zip(scenario.chunks, scenario.left):
        new = max(counts)
        ids = torch.full((batch, new), PAD)
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
        kwargs = {name: cache, "use_cache": True} if name is not None else {}
        with torch.no_grad():
            out = call(input_ids=ids, attention_mask=call_mask, **kwargs)
        returned = output_cache(out) if kwargs else None
        cache = returned if returned is not None else cache  # some releases return a new cache object
        for r, (n, start) in enumerate(zip(counts, starts)):
            pieces[r].append(_outputs(out)[r, start : start + n])
    return [torch.cat(p) for p in pieces]


def _diff(model: Any, row: Sequence[int], got: torch.Tensor) -> float:
    with torch.no_grad():
        alone = _outputs(model(input_ids=torch.tensor([list(row)])))[0]
    return (alone - got).abs().max().item()


def _outputs(out: Any) -> torch.Tensor:
    """Logits, or a base model's hidden states."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


class _PositionsByHand:
    """Calls ``model`` with ``position_ids`` from the mask: what hfpatch would do, for a model it does not
    patch."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, **kwargs: Any) -> Any:
        kwargs["position_ids"] = new_token_positions(kwargs["attention_mask"], kwargs["input_ids"].shape[1])
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


def _returns_a_cache(model: Any) -> bool:
    """The model hands back a KV cache to continue from (some keep their state inside instead)."""
    if cache_name(model) is None:
        return False
    with torch.no_grad():
        return output_cache(model(input_ids=torch.tensor([[5, 6]]), use_cache=True)) is not None


def _takes_static_cache(model: Any) -> bool:
    import transformers

    if not hasattr(transformers, "StaticCache") or attaches_static_caches(model):
        return False  # none before 4.38; 4.38-4.40 attach it to the layers instead
    try:
        with torch.no_grad():
            model(
                input_ids=torch.tensor([[5, 6]]),
                use_cache=True,
                **{cache_name(model): new_static_cache(model, 1, 8)},
            )
        return True
    except Exception:  # noqa: BLE001 - the model's own cache type (recurrent state, old release): no static probe
        return False
