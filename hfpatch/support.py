"""Release policy: which transformers releases an adapter may patch, and why.

An adapter is tested from its ``since`` release through :data:`NEWEST_TESTED` (the upper end of every
range, stated here once), less the releases it declares known-bad (measured wrong there) or unverified
(no evidence either way). Newer releases are patched when the target's signature still matches, with a
warning; older ones, known-bad and unverified ones only with ``apply(..., ignore_ranges=True)``.
"""

from __future__ import annotations

import importlib.util
import operator
import sys
from collections.abc import Iterable
from functools import cache
from importlib import metadata
from typing import Any, NamedTuple, Optional

from packaging.version import InvalidVersion, Version

__all__ = [
    "CUSTOM",
    "KNOWN_BAD",
    "MAPPINGS",
    "NEWEST_TESTED",
    "NEW_TYPE",
    "OUTSIDE",
    "TESTED",
    "UNTESTED_NEWER",
    "UNVERIFIED",
    "Support",
    "in_range",
    "installed_transformers",
    "newer_types",
    "release_has",
    "support",
    "wrong_with",
]

NEWEST_TESTED = "5.25.0"  # the newest release of the compat matrix: the upper end of every range

TESTED = "tested"
UNTESTED_NEWER = "untested newer"
KNOWN_BAD = "known-bad"
UNVERIFIED = "unverified"
CUSTOM = "custom"  # a class outside transformers, recognised and checked at run time (hfpatch.custom)
OUTSIDE = "outside"


# the mappings whose model types ``status()`` lists (compat/model_types.py reads the same ones per release)
MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
)
NEW_TYPE = (
    "new in transformers {version}, after the newest tested release ({newest}): not measured, not patched"
)


def newer_types(version: Optional[Version], known: Iterable[str]) -> list[str]:
    """On a release newer than :data:`NEWEST_TESTED`, the model types of its mappings that no tested
    release has (``known``: the types hfpatch declares); none on a tested release (nothing imported)."""
    if version is None or version <= _version(NEWEST_TESTED):
        return []
    try:
        from transformers.models.auto import modeling_auto
    except Exception:  # noqa: BLE001 (a broken install: status() still answers for the rest)
        return []
    known = set(known)
    found = (arch for name in MAPPINGS for arch in getattr(modeling_auto, name, {}))
    return sorted(arch for arch in dict.fromkeys(found) if arch not in known)


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
    warning), ``known-bad`` (measured wrong there), ``unverified`` (no evidence) or ``outside`` (the
    last three patched only with ``apply(..., ignore_ranges=True)``), and why."""

    level: str
    reason: str

    @property
    def patchable(self) -> bool:
        return self.level in (TESTED, UNTESTED_NEWER, CUSTOM)


def support(adapter: Any, version: Optional[Version]) -> Support:
    """Whether ``adapter`` (an :class:`~hfpatch.declarations.Adapter`) may patch this release, and why."""
    if version is None:
        return Support(OUTSIDE, "transformers is not installed (or its version cannot be read)")
    if adapter.recognised:  # a class outside transformers: its check on a tiny copy decides
        return Support(CUSTOM, adapter.recognised)
    for spec, why in adapter.known_bad:
        if in_range(spec, version):
            return Support(
                KNOWN_BAD, f"transformers {version} is known-bad for {adapter.arch} ({spec}): {why}"
            )
    for spec, why in adapter.unverified:
        if in_range(spec, version):
            return Support(
                UNVERIFIED,
                f"transformers {version} is unverified for {adapter.arch} ({spec}): {why}; "
                "apply(..., ignore_ranges=True) patches it anyway",
            )
    notes = "".join(f"; {note}" for spec, note in adapter.family.notes if in_range(spec, version))
    if in_range(adapter.versions, version):
        return Support(TESTED, f"transformers {version} is tested ({adapter.versions}){notes}")
    if version > _version(NEWEST_TESTED):
        return Support(
            UNTESTED_NEWER,
            f"transformers {version} is newer than the newest tested release, {NEWEST_TESTED}: "
            f"patched because the signature matches{notes}",
        )
    return Support(
        OUTSIDE,
        f"transformers {version} is outside the tested range {adapter.versions}: not patched "
        "(the compat report shows what the older releases give)",
    )


def wrong_with(adapter: Any, attention: str, version: Optional[Version]) -> str:
    """The adapter's declared limit that leaves ``attention`` wrong on ``version``, even with the right
    positions (``Adapter.wrong_with``), as a sentence; '' where none does."""
    for kind, spec, why in adapter.wrong_with:
        if kind == attention and version is not None and in_range(spec, version):
            return f"{kind} attention ({spec}): {why}"
    return ""


def release_has(adapter: Any) -> bool:
    """Whether the installed transformers ships ``adapter``'s module. Imports ``transformers`` (and the
    model package's lazy ``__init__``), so verify, the tests and compat/ use it, ``apply()`` never does."""
    try:
        return importlib.util.find_spec(adapter.module) is not None
    except ImportError:  # a parent package is missing: transformers itself, or models.<arch>
        return False
