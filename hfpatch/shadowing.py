"""``hfpatch.shadow``: check live calls against their rows run alone, while the run goes on.

    with hfpatch.shadow(rate=0.01) as report:    # or HFPATCH_SHADOW=0.01 with hfpatch run / hfpatch.auto
        ...                                      # the live results are unchanged, bit for bit
    report.checked, report.mismatches, report.worst

For a sampled share of the outermost calls of the classes hfpatch patches (in eval mode, with a 2-D
mask that pads some row, without the caller's own positions), one row, chosen at random, is run again
alone and unpadded, with no cache, under ``torch.no_grad()`` (the same weights, dtype and device; no
random number is drawn), and compared at its real tokens with the call's outputs. An uncached call is
sampled with probability ``rate``; a cache whose first call is sampled is followed, its calls' tokens
kept, and every later padded call on it is checked (a cache changed between the calls hfpatch sees, by
beam search or a copy, is let go). A difference beyond the tolerance warns with
:class:`ShadowMismatch`, once per model type and call site, and is counted; ``status().shadow`` has the
process's counts. It checks whatever runs: hfpatch's patch, stock, another library's kernels.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

import torch

from . import engine
from ._compat import CACHE_NAMES, output_cache
from .caches import capacity, first_layer_keys, past_length
from .judge import the_masks_positions
from .observers import SHADOW_COUNTS, call_site, fingerprint
from .packed import packed_rows
from .positions import call_inputs
from .rope import scaled_rope
from .tolerances import FP32, relative

__all__ = ["ShadowMismatch", "ShadowReport", "shadow", "shadow_this_process"]

# arguments a row can be run alone with; any other tensor argument (token types, images) is let go
TAKEN = {"input_ids", "inputs_embeds", "attention_mask", "use_cache", "return_dict", "output_attentions",
         "output_hidden_states", *CACHE_NAMES}  # fmt: skip
# what a task head hands its base model for the loss alone (Trainer's token count): the outputs compared
# do not depend on it, and the row alone runs without it
FOR_THE_LOSS = ("num_items_in_batch",)


PACKED = "packed"  # a check of a packed batch (see _Watcher.before)


class ShadowMismatch(RuntimeWarning):
    """A live call's row differs from the same row run alone, unpadded."""


class ShadowReport:
    """``checked``: rows compared; ``mismatches``: of those, beyond the tolerance; ``worst``: the largest
    |difference| seen; ``skipped``: calls not checked, by reason (sampled out calls are not counted)."""

    def __init__(self) -> None:
        self.checked = 0
        self.mismatches = 0
        self.worst = 0.0
        self.skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def skip(self, why: str) -> None:
        """One call not checked, for ``why`` (counted here and in ``status().shadow``)."""
        with self._lock:
            self.skipped[why] = self.skipped.get(why, 0) + 1
            skipped = SHADOW_COUNTS["skipped"]
            skipped[why] = skipped.get(why, 0) + 1

    def check(self, diff: float, bound: float) -> bool:
        """One row compared: ``diff`` from its row alone, wrong beyond ``bound`` (returned)."""
        with self._lock:
            wrong = diff > bound
            self.checked += 1
            self.worst = max(self.worst, diff)
            self.mismatches += wrong
            SHADOW_COUNTS["checked"] += 1
            SHADOW_COUNTS["mismatches"] += wrong
            SHADOW_COUNTS["worst"] = max(SHADOW_COUNTS["worst"], diff)
        return wrong

    def __repr__(self) -> str:
        return (f"ShadowReport(checked={self.checked}, mismatches={self.mismatches}, "
                f"worst={self.worst:.3g}, skipped={self.skipped})")  # fmt: skip


@contextlib.contextmanager
def shadow(rate: float = 0.01, *, tolerance: Optional[float] = None, seed: int = 0) -> Iterator[ShadowReport]:
    """Check a share ``rate`` (0 to 1) of the live calls inside the block against their rows run alone;
    ``tolerance``: the largest |difference| allowed (default: from the outputs' dtype and size);
    ``seed``: of the sampling (its own generator: the program's random state is not touched)."""
    report = ShadowReport()
    stop = start(report, rate, tolerance, seed)
    try:
        yield report
    finally:
        stop()


def start(report: ShadowReport, rate: float, tolerance: Optional[float] = None, seed: int = 0) -> Any:
    """Start checking every thread's calls into ``report``; returns the function that stops it."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise ValueError(f"rate: expected a share of calls from 0 to 1, got {rate!r}")
    if tolerance is not None and (not isinstance(tolerance, (int, float)) or tolerance < 0):
        raise ValueError(f"tolerance: expected a number >= 0 (or None), got {tolerance!r}")
    return engine.subscribe(_Watcher(report, float(rate), tolerance, seed))


def shadow_this_process(rate: float) -> None:
    """What ``HFPATCH_SHADOW=RATE`` does (read by :mod:`hfpatch.launcher`, which checks the rate):
    check that share of this process's calls; at exit, one line on stderr with the counts (where it
    checked any)."""
    report = ShadowReport()
    stop = start(report, rate)

    def summary() -> None:
        stop()
        if report.checked or report.mismatches:
            print(f"hfpatch shadow (process {os.getpid()}): {report.checked} rows checked, "
                  f"{report.mismatches} mismatches, worst |difference| {report.worst:.2g}",
                  file=sys.stderr)  # fmt: skip

    import atexit

    atexit.register(summary)


class _Followed:
    """A cache being followed: the tokens of every call it has seen, and its first layer's keys as they
    were after the last one (a change in between lets it go)."""

    __slots__ = ("ref", "ids", "stamp")

    def __init__(self, cache: Any, ids: torch.Tensor) -> None:
        self.ref = weakref.ref(cache)
        self.ids = ids
        self.stamp = _stamp(cache)


def _stamp(cache: Any) -> Any:
    keys = first_layer_keys(cache)
    return None if keys is None else (weakref.ref(keys), keys._version)


def _same(stamp: Any, cache: Any) -> bool:
    keys = first_layer_keys(cache)
    if stamp is None or keys is None:
        return stamp is None and keys is None
    return stamp[0]() is keys and stamp[1] == keys._version


class _Caches:
    """The caches the shadow follows: the tokens each has seen, so that a call continuing one is rerun
    as its whole row (a deep copy of a followed cache, a prompt reused, is known again)."""

    def __init__(self) -> None:
        self.followed: dict[int, _Followed] = {}  # id(cache) -> what it holds

    def whole(self, cache: Any, ids: Optional[torch.Tensor], mask: torch.Tensor) -> Any:
        """The tokens of every row so far, the cached ones and ``ids``: None where ``cache`` is not
        followed, :data:`CHANGED` where it changed since the last call seen (it is let go)."""
        followed = self.followed.get(id(cache))
        if followed is None or followed.ref() is not cache:
            followed = self._copied(cache)
            if followed is None:
                return None
        if (
            ids is None
            or not _same(followed.stamp, cache)
            or mask.shape[1] != followed.ids.shape[1] + ids.shape[1]
        ):
            del self.followed[id(cache)]
            return CHANGED
        return torch.cat([followed.ids, ids], dim=1)

    def follow(self, seen: Any, cache: Any, whole: Optional[torch.Tensor], result: Any) -> None:
        """After a call: the cache it returned, with the tokens it now holds."""
        out = None if isinstance(result, (tuple, list)) else output_cache(result)
        if out is None or isinstance(out, (tuple, list)):
            return
        ids = whole if whole is not None else (
            seen.kwargs["input_ids"] if cache is None else
            torch.cat([self.followed[id(cache)].ids, seen.kwargs["input_ids"]], dim=1)
        )  # fmt: skip
        if cache is not None and out is not cache:
            self.followed.pop(id(cache), None)
        before = self.followed.get(id(out))
        self.followed[id(out)] = _Followed(out, ids)
        if before is None or before.ref() is not out:  # forgotten when the cache is
            weakref.finalize(out, self.followed.pop, id(out), None)

    def _copied(self, cache: Any) -> Optional[_Followed]:
        """A followed cache that ``cache`` is a copy of (the same length and newest keys), now followed
        under ``cache`` too; None if none."""
        stamp = fingerprint(cache)
        if stamp is None:
            return None
        for followed in list(self.followed.values()):
            other = followed.ref()
            if other is None or other is cache or not _same(followed.stamp, other):
                continue
            if followed.ids.shape[1] == stamp[0] and fingerprint(other) == stamp:
                copy = _Followed(cache, followed.ids)
                self.followed[id(cache)] = copy
                weakref.finalize(cache, self.followed.pop, id(cache), None)
                return copy
        return None


CHANGED = "changed"  # a followed cache changed between the calls seen (_Caches.whole)


class _Verdicts:
    """Each rerun row's verdict: counted in the report, a warning once per model type and call site
    where it differs beyond the tolerance (given, or testing's for the outputs' dtype and size)."""

    def __init__(self, report: ShadowReport, tolerance: Optional[float]) -> None:
        self.report, self.tolerance = report, tolerance
        self.warned: set[tuple[str, str]] = set()

    def judge(self, seen: Any, rerun: _Rerun) -> None:
        model, alone = seen.model, rerun.alone
        scale = float(alone.abs().max()) if alone.numel() else 1.0
        # testing's tolerances, each a share of the row's largest |output| here (live models' are large)
        bound = self.tolerance if self.tolerance is not None else (
            (relative(alone.dtype) or FP32) * max(1.0, scale)
        )  # fmt: skip
        diff = float((rerun.live.float() - alone.float()).abs().max())
        site, frame = call_site()
        if not self.report.check(diff, bound):
            return
        arch = getattr(model.config, "model_type", seen.adapter.arch)
        if (arch, site) in self.warned:
            return
        self.warned.add((arch, site))
        message = (
            f"hfpatch shadow: {type(model).__name__} ({arch}), row {rerun.row} of a batch of {rerun.batch} "
            f"({rerun.scenario}, {rerun.width} columns): {diff:.2g} from the row run alone (tolerance "
            f"{bound:.1g}); later mismatches here are only counted (hfpatch.status().shadow)"
        )
        if frame is None:
            warnings.warn(message, ShadowMismatch, stacklevel=2)
        else:  # reported at the caller's line, as a warning of its module (filters see it so)
            globals_ = frame.f_globals
            registry = globals_.setdefault("__warningregistry__", {})
            where = (frame.f_code.co_filename, frame.f_lineno, globals_.get("__name__"), registry)
            warnings.warn_explicit(message, ShadowMismatch, *where)


class _Rerun(NamedTuple):
    """One row (or packed sequence) of a live call and the same run alone."""

    live: torch.Tensor
    alone: torch.Tensor
    row: int
    batch: int
    scenario: str
    width: int  # the call's columns


def _rerun_packed(seen: Any, found: Any, result: Any, sequence: int) -> _Rerun:
    """Packed sequence ``sequence`` (its row * the row's length + its segment) run alone with its own
    positions."""
    mask, positions, segment_ids = found.mask, found.positions, found.segment_ids
    key = "input_ids" if seen.kwargs.get("input_ids") is not None else "inputs_embeds"
    real = mask != 0
    segment_ids = segment_ids.expand(real.shape)
    row, segment = divmod(sequence, segment_ids.shape[1])
    columns = (real[row] & (segment_ids[row] == segment)).nonzero().flatten()
    alone_kwargs = {
        key: seen.kwargs[key][row, columns][None],
        "position_ids": positions.expand(real.shape)[row, columns][None],
    }
    if "use_cache" in seen.kwargs:
        alone_kwargs["use_cache"] = False
    with torch.no_grad():
        alone = _outputs(seen.model(**alone_kwargs))[0]
    live = _outputs(result)[row, columns]
    scenario = f"a packed batch, sequence {segment}"
    return _Rerun(live.detach(), alone.detach(), row, mask.shape[0], scenario, mask.shape[1])


def _packed_sequences(found: Any) -> list[int]:
    """Every sequence of a packed batch, as :func:`_rerun_packed` numbers them."""
    mask, segment_ids = found.mask, found.segment_ids
    real = mask != 0
    segment_ids = segment_ids.expand(real.shape)
    return torch.unique(segment_ids[real] + segment_ids.shape[1] * real.nonzero()[:, 0]).tolist()


def _rerun_row(seen: Any, whole: torch.Tensor, result: Any, row: int) -> Optional[_Rerun]:
    """Row ``row``'s real tokens so far (``whole``: cached and new) run alone, against its new ones in
    the call; None where the call has no real token of it."""
    mask = seen.kwargs["attention_mask"]
    num_new = _new_tokens(seen)
    real = mask[row] != 0
    new_real = real[-num_new:]
    count = int(new_real.sum())
    if count == 0:
        return None
    key = "input_ids" if seen.kwargs.get("input_ids") is not None else "inputs_embeds"
    kwargs = {key: whole[row][real][None]}
    if "use_cache" in seen.kwargs:
        kwargs["use_cache"] = False
    with torch.no_grad():
        alone = _outputs(seen.model(**kwargs))[0, -count:]
    live = _outputs(result)[row, -num_new:][new_real]
    past = whole.shape[1] - num_new
    scenario = f"a cached prefix of {past} columns + {num_new} tokens" if past else "one padded call"
    return _Rerun(live.detach(), alone.detach(), row, mask.shape[0], scenario, mask.shape[1])


class _Watcher:
    """The shadow's observer of every patched call: what to rerun is decided before the call
    (:meth:`before`), the reruns made and judged after it (:meth:`after`); never changes the call, never
    raises into it."""

    def __init__(self, report: ShadowReport, rate: float, tolerance: Optional[float], seed: int) -> None:
        self.report, self.rate = report, rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.caches = _Caches()
        self.verdicts = _Verdicts(report, tolerance)
        self.scaled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, seen: Any, call: Any) -> Any:
        if self.rate == 0.0:
            return call()
        try:
            check = self.before(seen)
        except Exception as exc:  # noqa: BLE001 - a check must never break the run
            check = None
            self.skip(f"the check failed: {type(exc).__name__}")
        result = call()
        try:
            self.after(seen, check, result)
        except Exception as exc:  # noqa: BLE001
            self.skip(f"the check failed: {type(exc).__name__}")
        return result

    def skip(self, why: str) -> None:
        self.report.skip(why)

    def sample(self, n: int = 0) -> float:
        with self.lock:
            return self.random.randrange(n) if n else self.random.random()

    def before(self, seen: Any) -> Optional[tuple]:
        """What to check after the call: (the cache it continues, or :data:`PACKED`; the tokens of the
        whole rows so far, or the packed rows found; follow the cache it returns?), or None."""
        kwargs, model = seen.kwargs, seen.model
        mask = kwargs.get("attention_mask")
        ids, tokens = kwargs.get("input_ids"), call_inputs(kwargs)
        found = packed_rows(kwargs, tokens) if kwargs.get("position_ids") is not None else None
        if found is None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            return None  # no padding to check (or a 4-D mask: the caller's own)
        given = kwargs.get("position_ids")
        slots = kwargs.get("cache_position")
        if found is None and slots is not None and not _slots_after_the_cache(slots, seen.cache, tokens):
            return self.skip("the caller's cache_position")
        family = seen.adapter.family
        if family.hands_to is not None or family.seq2seq or family.multimodal:
            return self.skip("a decoder of an encoder-decoder model, or a multimodal wrapper")
        if model.training:
            return self.skip("training mode (dropout)")
        if any(
            isinstance(v, torch.Tensor)
            for k, v in kwargs.items()
            if k not in TAKEN and k not in ("position_ids", "cache_position", *FOR_THE_LOSS)
        ):
            return self.skip("other inputs")
        if self._scaled(model):
            return self.skip("rope scaled by length (running a row alone would change its state)")
        if tokens is None:
            return None
        if found is not None:  # a packed batch: its sequences, each against itself alone
            return (PACKED, found, False) if self.sample() < self.rate else None
        cache, num_new = seen.cache, tokens.shape[1]
        if given is not None and not the_masks_positions(given, mask, num_new):
            return self.skip("the caller's own positions (not the mask's)")
        if cache is None or (capacity(cache) is None and past_length(cache) == 0):
            if mask.shape[1] != num_new or self.sample() >= self.rate:
                return None
            follow = ids is not None and kwargs.get("use_cache", True) is not False
            return (None, tokens, follow) if bool((mask == 0).any()) else (None, None, follow)
        whole = self.caches.whole(cache, ids, mask)
        if whole is CHANGED:
            return self.skip("a cache changed between the calls seen")
        if whole is None:
            return None
        return (cache, whole if bool((mask == 0).any()) else None, True)

    def after(self, seen: Any, check: Optional[tuple], result: Any) -> None:
        if check is None:
            return
        cache, whole, follow = check
        if cache is PACKED:  # one sequence, chosen at random (every one at rate 1)
            sequences = _packed_sequences(whole)
            chosen = sequences if self.rate >= 1.0 else [sequences[self.sample(len(sequences))]]
            for sequence in chosen:
                self.verdicts.judge(seen, _rerun_packed(seen, whole, result, sequence))
            return
        if whole is not None:  # one row chosen at random (every row at rate 1)
            batch = seen.kwargs["attention_mask"].shape[0]
            for row in range(batch) if self.rate >= 1.0 else (self.sample(batch),):
                rerun = _rerun_row(seen, whole, result, row)
                if rerun is not None:
                    self.verdicts.judge(seen, rerun)
        if follow:
            self.caches.follow(seen, cache, whole, result)

    def _scaled(self, model: Any) -> bool:
        found = self.scaled.get(model)
        if found is None:
            found = self.scaled[model] = scaled_rope(model) is not None
        return found


def _slots_after_the_cache(slots: Any, cache: Any, tokens: Any) -> bool:
    """Whether a ``cache_position`` names the slots right after a growing cache's tokens (what
    ``generate()`` passes on 4.38-5.3): the usual call, checked as one without it."""
    if tokens is None or capacity(cache) is not None or not isinstance(slots, torch.Tensor):
        return False
    expected = torch.arange(tokens.shape[1], device=slots.device) + past_length(cache)
    return slots.reshape(-1).shape == expected.shape and bool((slots.reshape(-1) == expected).all())


def _new_tokens(seen: Any) -> int:
    return call_inputs(seen.kwargs).shape[1]


def _outputs(result: Any) -> torch.Tensor:
    """What a forward returned to compare: its logits, else its last hidden state (a base model)."""
    if isinstance(result, (tuple, list)):
        return result[0]
    logits = getattr(result, "logits", None)
    return logits if logits is not None else result[0]
