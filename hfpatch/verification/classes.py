"""The check a class outside transformers passes before hfpatch patches it (:mod:`hfpatch.custom`):
``verify``'s scenarios on a tiny copy built from its config class's defaults, stock against hfpatch.
Wired into the engine by the package (``hfpatch/__init__.py``), so the engine imports no verification."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..windows import configured_window, positional
from .load import first_line
from .result import WRONG
from .run import verify
from .tiny import INIT, SIZES, WIDE, shrunk_config

__all__ = ["MAX_PARAMETERS", "check", "tiny_copy", "verdict"]

MAX_PARAMETERS = (
    5_000_000  # a tiny copy larger than this (sizes under names hfpatch does not know): not built
)


def check(cls: type) -> tuple[bool, str]:
    """(patch ``cls``?, why). ``NameError`` passes through: the class's module is still being imported.
    Run apart from the caller's context (it may be a model's first call): on the CPU by default, without
    autocast, outside inference mode."""
    try:
        with torch.device("cpu"), torch.autocast("cpu", enabled=False), torch.inference_mode(False):
            return verdict(verify(tiny_copy(cls), static=False))
    except NameError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the class raises: not patched, and why
        return False, f"could not be checked on a tiny copy: {first_line(exc)}"


def tiny_copy(cls: type) -> Any:
    """A tiny random-weight instance of ``cls`` from its config class's defaults (fp32, eval mode), built
    under a random state of its own; windows its mask code applies by cache column (which hfpatch leaves
    to it: ``verify`` notes them) wider than the scenarios, as for transformers' own tiny models.
    ``ValueError`` saying why where it cannot be built."""
    from transformers import PretrainedConfig

    config_class = getattr(cls, "config_class", None)
    if not (isinstance(config_class, type) and issubclass(config_class, PretrainedConfig)):
        raise ValueError("no config_class to build a tiny copy from")

    def build(sizes: dict) -> Any:
        config = shrunk_config(config_class, config_class(), {}, sizes)
        if getattr(config, "initializer_range", None) is not None:
            config.initializer_range = INIT
        with torch.device("meta"):
            count = sum(p.numel() for p in cls(config).parameters())
        if count > MAX_PARAMETERS:
            raise ValueError(
                f"its tiny copy would have {count:,} parameters (sizes under names hfpatch does not know)"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            make = getattr(cls, "_from_config", None)
            return (make(config) if make is not None else cls(config)).float().eval()

    model = build(SIZES)
    if configured_window(model) and not positional(model, cls.__name__):
        model = build({**SIZES, **WIDE})
    return model


def verdict(result: Any) -> tuple[bool, str]:
    """(patch it?, why) from ``verify``'s result on the tiny copy: patched where hfpatch is exact in every
    scenario that runs and stock is wrong in one (a scenario that fails on both sides tells nothing)."""

    rows = [row for row in result.rows if not (math.isnan(row.stock) and math.isnan(row.patched))]
    if not rows:
        return False, "checked on a tiny copy: no scenario could run: not patched"
    failed = next((row for row in rows if math.isnan(row.patched)), None)
    if failed is not None:
        return (
            False,
            f"checked on a tiny copy: {failed.scenario} raised with hfpatch ({failed.error}): not patched",
        )
    worst_stock = max(row.stock for row in rows)  # nan (stock raised) counts as wrong
    worst = max(row.patched for row in rows)
    numbers = f"stock {worst_stock:.1e}, hfpatch {worst:.1e}"
    if not all(row.patched <= row.tolerance for row in rows):  # (fp32 noise: verify's own control)
        return False, f"checked on a tiny copy: not exact with hfpatch ({numbers}): not patched"
    if all(row.stock <= WRONG for row in rows):
        return False, f"checked on a tiny copy: right on stock ({numbers}): nothing to patch"
    return True, f"checked on a tiny copy: exact ({numbers})"
