"""Adapter declarations and the checks that decide whether one may patch: release range, signature."""

import importlib.util
import inspect
import operator
import sys
from functools import cache
from importlib import metadata
from typing import Callable, NamedTuple, Optional

from packaging.version import InvalidVersion, Version

__all__ = [
    "NEWEST_TESTED",
    "Adapter",
    "Signature",
    "Support",
    "installed_transformers",
    "read_signature",
    "release_has",
    "support",
]

CACHE_NAMES = ("cache", "past_key_values")  # 5.24 renamed past_key_values -> cache
NEWEST_TESTED = "5.24.0"  # the newest release in compat/REPORT.md

TESTED = "tested"
UNTESTED_NEWER = "untested newer"
KNOWN_BAD = "known-bad"
OUTSIDE = "outside"


class Adapter(NamedTuple):
    """What one architecture needs: the class whose ``forward`` is patched, and where that is safe.

    Attributes:
        arch: short name used by ``apply(archs=[...])``.
        module: the modeling module, imported by the user (never by hfpatch).
        cls: class in ``module`` whose own ``forward`` is replaced.
        versions: the transformers releases this adapter is tested on (PEP 440 specifier), as in
            compat/REPORT.md. Newer releases are patched too when the signature still matches,
            with a warning (see :func:`support`); older ones never.
        why: one line: what the range rests on.
        required: parameters the target's signature must have (besides the cache argument).
        attached_cache: attribute path from the model to a static cache that lives outside the
            forward's arguments (4.38-4.40 ``model._setup_cache``), read only to find cache slots.
    """

    arch: str
    module: str
    cls: str
    versions: str
    why: str
    required: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
    attached_cache: Optional[str] = None
    known_bad: tuple[tuple[str, str], ...] = ()  # (specifier, why and the workaround): never patched
    # (specifier, the upstream bug and its workaround): still patched, since positions are still fixed
    upstream_bugs: tuple[tuple[str, str], ...] = ()

    @property
    def target(self) -> str:
        return f"{self.module}:{self.cls}.forward"


class Signature(NamedTuple):
    """Facts about a target's signature, read once at install time."""

    positional: tuple[str, ...]  # parameters after ``self`` that may be passed by position, in order
    cache_kw: str  # "cache" (5.24+) or "past_key_values"
    has_cache_position: bool  # 4.38-5.3 for Llama/Gemma, 4.52-5.3 for GPT-2
    has_var_kw: bool  # **kwargs: an unknown keyword is swallowed instead of raising TypeError


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
        if not _OPERATORS[op](version, Version(clause[len(op) :])):
            return False
    return True


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
    if version > Version(NEWEST_TESTED):
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
    model package's lazy ``__init__``), so the tests and compat/ use it, ``apply()`` never does."""
    try:
        return importlib.util.find_spec(adapter.module) is not None
    except ImportError:  # a parent package is missing: transformers itself, or models.<arch>
        return False


def read_signature(adapter: Adapter, forward: Callable) -> Signature:
    """Read ``forward``'s signature; ``TypeError`` saying what is missing if it is not the expected one."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot read the signature of {adapter.target}: {exc}") from exc
    names = [p.name for p in params]
    missing = [name for name in adapter.required if name not in names]
    cache_names = [name for name in CACHE_NAMES if name in names]
    if not names or names[0] != "self":
        missing.insert(0, "self")
    if not cache_names:
        missing.append(" or ".join(CACHE_NAMES))
    if missing:
        found = ", ".join(names)
        raise TypeError(f"signature mismatch: {adapter.target}({found}) lacks {', '.join(missing)}")
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return Signature(
        positional=tuple(p.name for p in params[1:] if p.kind in positional_kinds),
        cache_kw=cache_names[0],
        has_cache_position="cache_position" in names,
        has_var_kw=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params),
    )
