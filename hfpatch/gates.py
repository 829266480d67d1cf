"""Declarations and the checks that decide whether an adapter may patch: release range, signature.

An :class:`Adapter` is data: the model type, the class whose ``forward`` is patched, its
:class:`Family` (what really differs between architectures), since which release it is tested, and
what hfpatch knows it cannot fix. The upper end of every range is :data:`NEWEST_TESTED`, stated here
once. :func:`read_plan` turns a target's signature into a :class:`Plan`, decided once per class at
install time. :class:`Undeclared` records the model types that hfpatch knows of and does not patch.
"""

import importlib.util
import inspect
import operator
import sys
from functools import cache
from importlib import metadata
from typing import Any, Callable, NamedTuple, Optional

from packaging.version import InvalidVersion, Version

__all__ = [
    "NEWEST_TESTED",
    "Adapter",
    "Family",
    "Plan",
    "Support",
    "Undeclared",
    "installed_transformers",
    "read_plan",
    "release_has",
    "support",
]

CACHE_NAMES = ("cache", "past_key_values")  # 5.24 renamed past_key_values -> cache
NEWEST_TESTED = "5.24.0"  # the newest release in compat/releases.txt: the upper end of every range

TESTED = "tested"
UNTESTED_NEWER = "untested newer"
KNOWN_BAD = "known-bad"
OUTSIDE = "outside"


class Family(NamedTuple):
    """What architectures of one kind share: how positions enter the model, and the facts that follow.

    Attributes:
        name: ``"absolute"`` (a learned or fixed table indexed by position: left padding shifts every
            real token on stock) or ``"rotary"`` (RoPE and relatives: a uniform left shift cancels,
            the holes of a padded cached prefix do not).
        left_padding_wrong_on_stock: what follows for one call with left padding.
        attached_cache: attribute path from the base model to a static cache kept outside the
            forward's arguments (4.38-4.40 ``model._setup_cache``), read only to find cache slots.
    """

    name: str
    left_padding_wrong_on_stock: bool
    attached_cache: Optional[str] = None


class Adapter(NamedTuple):
    """One patched class, declared as data (the engine does every check, install and revert).

    Attributes:
        arch: the model type (``config.model_type``), used by ``apply(archs=[...])`` and ``status()``.
        cls: the base-model class whose own ``forward`` is replaced.
        family: see :class:`Family`.
        since: the first release the compat matrix tests it on; the range is ``since`` to
            :data:`NEWEST_TESTED`. Newer releases are patched too when the signature still matches,
            with a warning (see :func:`support`); older ones never.
        package: the ``transformers.models`` package, when it is not ``arch`` with ``_`` for ``-``.
        aliases: other model types whose models run this very class (``exaone`` runs ``LlamaModel``).
        tiny: config overrides for a tiny random model (:func:`hfpatch.probe.tiny_model`).
        flagship: the full property suite runs on it (the others get the :func:`hfpatch.verify` probe).
        multiple_choice: a model class that feeds ``[batch, choices, tokens]`` inputs (left to stock).
        limits: what positions cannot fix inside "fixed" (sliding windows ...), shown by ``verify``.
        eager_mask: (specifier, attribute): on these releases the model's SDPA mask code mishandles a
            padded cached prefix continued by several tokens (4.36-4.37 ``_unmask_unattended``); for
            such calls, when hfpatch derives the positions, it sets this boolean attribute of the
            base model (``_use_sdpa``) False for the call, so that transformers builds its eager 4-D
            mask (right for any padding; attention still runs in SDPA).
        known_bad: (specifier, why and the workaround): never patched there.
        upstream_bugs: (specifier, the upstream bug and its workaround): still patched, since positions
            are still fixed.
    """

    arch: str
    cls: str
    family: Family
    since: str
    package: Optional[str] = None
    aliases: tuple[str, ...] = ()
    tiny: tuple[tuple[str, object], ...] = ()
    flagship: bool = False
    multiple_choice: Optional[str] = None
    limits: tuple[str, ...] = ()
    eager_mask: Optional[tuple[str, str]] = None
    known_bad: tuple[tuple[str, str], ...] = ()
    upstream_bugs: tuple[tuple[str, str], ...] = ()

    @property
    def module(self) -> str:
        package = self.package or self.arch.replace("-", "_")
        return f"transformers.models.{package}.modeling_{package}"

    @property
    def target(self) -> str:
        return f"{self.module}:{self.cls}.forward"

    @property
    def versions(self) -> str:
        return f">={self.since},<={NEWEST_TESTED}"

    @property
    def exceptions(self) -> str:
        """The known-bad releases, for tables: ``", not 5.4.0"`` (empty where there are none)."""
        return "".join(f", not {spec.removeprefix('==')}" for spec, _ in self.known_bad)

    @property
    def why(self) -> str:
        return f"tested from {self.since} (the first matrix release that ships it) through {NEWEST_TESTED}"


RIGHT_ON_STOCK = "right on stock"
NOT_FIXABLE = "not fixable by positions"
NOT_COVERED = "not covered"


class Undeclared(NamedTuple):
    """A decoder-only model type hfpatch knows and does not patch: ``right on stock``, ``not fixable
    by positions`` or ``not covered``, and why (measured on 5.24.0)."""

    arch: str
    verdict: str
    reason: str


class Plan(NamedTuple):
    """What a target's signature says, read once when its class is patched."""

    positional: tuple[str, ...]  # parameters after ``self`` that may be passed by position, in order
    cache_kw: Optional[str]  # "cache" (5.24+), "past_key_values", or None (no KV cache: OpenAI GPT)
    has_cache_position: bool  # 4.38-5.3 for Llama/Gemma, 4.52-5.3 for GPT-2
    swallows_cache_position: bool  # no such parameter but **kwargs (5.4+): a passed one would be ignored
    eager_mask_attr: Optional[str] = None  # the adapter's eager_mask attribute, where its release is in range
    old_cache_kw: Optional[str] = None  # an old name the release still takes, with its own warning (5.24+)


@cache
def installed_transformers() -> Optional[Version]:
    """The installed transformers release (imports nothing: package metadata, unless already imported)."""
    try:
        module = sys.modules.get("transformers")
        return Version(module.__version__ if module is not None else metadata.version("transformers"))
    except (metadata.PackageNotFoundError, InvalidVersion, AttributeError):
        return None


_OPERATORS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}


def in_range(spec: str, version: Version) -> bool:
    """``version`` satisfies every clause of ``spec`` (``">=4.28,<=5.24.0"``: >=, <=, ==, >, <).

    A small subset of PEP 440 specifiers, compared as plain versions (pre-releases included), so
    that ``import hfpatch`` needs no ``packaging.specifiers`` (about 9 ms)."""
    for clause in spec.split(","):
        clause = clause.strip()
        op = next((op for op in _OPERATORS if clause.startswith(op)), None)
        if op is None:
            raise ValueError(f"versions: cannot read {clause!r} in {spec!r} (expected >=, <=, ==, > or <)")
        if not _OPERATORS[op](version, _version(clause[len(op) :])):
            return False
    return True


@cache
def _version(text: str) -> Version:
    """``Version(text)``, parsed once: ``status()`` compares the ranges of every adapter."""
    return Version(text)


class Support(NamedTuple):
    """What hfpatch knows of an adapter on a release: ``tested``, ``untested newer`` (patched, with a
    warning), ``known-bad`` or ``outside`` (both never patched), and why."""

    level: str
    reason: str

    @property
    def patchable(self) -> bool:
        return self.level in (TESTED, UNTESTED_NEWER)


def support(adapter: Adapter, version: Optional[Version]) -> Support:
    """Whether ``adapter`` may patch this transformers release, and why."""
    if version is None:
        return Support(OUTSIDE, "transformers is not installed (or its version cannot be read)")
    for spec, why in adapter.known_bad:
        if in_range(spec, version):
            return Support(
                KNOWN_BAD, f"transformers {version} is known-bad for {adapter.arch} ({spec}): {why}"
            )
    if in_range(adapter.versions, version):
        upstream = "".join(
            f"; upstream bug, not fixed by hfpatch: {why}" for why in upstream_bugs_on(adapter, version)
        )
        return Support(TESTED, f"transformers {version} is tested ({adapter.versions}){upstream}")
    if version > _version(NEWEST_TESTED):
        return Support(
            UNTESTED_NEWER,
            f"transformers {version} is newer than the newest tested release, {NEWEST_TESTED}: "
            "patched because the signature matches",
        )
    return Support(OUTSIDE, f"transformers {version} is outside {adapter.versions} ({adapter.why})")


def upstream_bugs_on(adapter: Adapter, version: Version) -> list[str]:
    """The upstream bugs (with their workarounds) that ``adapter`` declares for this release."""
    return [why for spec, why in adapter.upstream_bugs if in_range(spec, version)]


def release_has(adapter: Adapter) -> bool:
    """Whether the installed transformers ships ``adapter``'s module. Imports ``transformers`` (and the
    model package's lazy ``__init__``), so verify, the tests and compat/ use it, ``apply()`` never does."""
    try:
        return importlib.util.find_spec(adapter.module) is not None
    except ImportError:  # a parent package is missing: transformers itself, or models.<arch>
        return False


REQUIRED = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


def read_plan(adapter: Adapter, forward: Callable) -> Plan:
    """Read ``forward``'s signature; ``TypeError`` saying what is missing if it is not the expected one."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot read the signature of {adapter.target}: {exc}") from exc
    names = [p.name for p in params]
    missing = [name for name in REQUIRED if name not in names]
    if not names or names[0] != "self":
        missing.insert(0, "self")
    if missing:
        found = ", ".join(names)
        raise TypeError(f"signature mismatch: {adapter.target}({found}) lacks {', '.join(missing)}")
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    has_cache_position = "cache_position" in names
    version, eager_mask = installed_transformers(), adapter.eager_mask
    in_era = eager_mask is not None and version is not None and in_range(eager_mask[0], version)
    cache_kw = next((name for name in CACHE_NAMES if name in names), None)
    return Plan(
        positional=tuple(p.name for p in params[1:] if p.kind in positional_kinds),
        cache_kw=cache_kw,
        has_cache_position=has_cache_position,
        swallows_cache_position=has_var_kw and not has_cache_position,
        eager_mask_attr=eager_mask[1] if in_era else None,
        old_cache_kw=_renamed_from(forward, cache_kw),
    )


def _renamed_from(forward: Callable, new_name: Optional[str]) -> Optional[str]:
    """The old name of the cache argument that the release still takes, through transformers'
    ``deprecate_kwarg`` decorator (5.24: ``past_key_values`` -> ``cache``), which warns the caller.
    Read from the decorator's closure, anywhere on the ``__wrapped__`` chain."""
    function: Any = forward
    while function is not None and new_name is not None:
        code = getattr(function, "__code__", None)
        if code is not None and {"old_name", "new_name"} <= set(code.co_freevars):
            cells = dict(zip(code.co_freevars, function.__closure__ or ()))
            try:
                old, new = (cells[name].cell_contents for name in ("old_name", "new_name"))
            except (KeyError, ValueError):  # an empty cell: not the decorator we know
                old = new = None
            if new == new_name and old in CACHE_NAMES:
                return old
        function = getattr(function, "__wrapped__", None)
    return None
