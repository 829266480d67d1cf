"""What ``verify`` is given, made a model: a model instance, a checkpoint directory (loaded with
``from_pretrained``) or a model type (built tiny); and the checks that it is a model ``verify`` runs."""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

from .. import engine
from .._compat import dtype_keyword
from ..support import installed_transformers, wrong_with
from .result import TOLERANCE, CannotVerify
from .scenarios import Inputs, outputs
from .tiny import seq2seq_auto_class, tiny_model, tiny_multimodal, tiny_seq2seq

__all__ = [
    "check_causal",
    "check_runs",
    "first_line",
    "is_multimodal",
    "load",
    "plain_call",
    "tiny_attention",
    "under_autocast",
]


HALF = ("float16", "bfloat16")


def under_autocast(model: Any, autocast: Any) -> Callable[[], Any]:
    """What a check enters around each call for ``autocast=`` (``torch.float16`` or ``torch.bfloat16``:
    ``torch.autocast`` on the device of the model's first parameter; None: nothing). ``ValueError`` naming
    the argument for anything else."""
    if autocast is None:
        return contextlib.nullcontext
    if not isinstance(autocast, torch.dtype) or str(autocast).rpartition(".")[2] not in HALF:
        raise ValueError(f"autocast: expected torch.float16 or torch.bfloat16 (or None), got {autocast!r}")
    parameters = getattr(model, "parameters", None)
    first = next(parameters(), None) if callable(parameters) else None
    device = first.device.type if first is not None else "cpu"
    return lambda: torch.autocast(device, dtype=autocast)


def tiny_attention(model_type: str) -> Optional[str]:
    """The attention a tiny model of ``model_type`` is built with for ``verify TYPE``: eager where its
    adapter declares SDPA wrong on this release (``Adapter.wrong_with``; the limit stays in the notes),
    else None (the release's default)."""
    adapter = engine.adapter_for(model_type)
    wrong = adapter is not None and wrong_with(adapter, "sdpa", installed_transformers())
    return "eager" if wrong else None


def load(model: Any) -> Any:
    """A model in eval mode, from what ``verify`` was given (see :func:`hfpatch.verify`)."""
    if not isinstance(model, (str, os.PathLike)):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model: expected a transformers model, a checkpoint directory or a model type, "
                            f"got {type(model).__name__}")  # fmt: skip
        return model.eval()
    text = os.fspath(model)
    import transformers

    if os.path.isdir(text):
        try:
            config = transformers.AutoConfig.from_pretrained(text)
            if getattr(config, "is_encoder_decoder", False):
                auto = seq2seq_auto_class(config.model_type)
            elif _image_text_to_text(config.model_type) and config.model_type not in _causal_lm_types():
                auto = transformers.AutoModelForImageTextToText
            else:
                auto = transformers.AutoModelForCausalLM
            return auto.from_pretrained(text, **{dtype_keyword(): torch.float32}).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise CannotVerify(
                f"{text}: cannot load a causal LM, an image-text-to-text or an encoder-decoder model from "
                f"this directory: {first_line(exc)}"
            ) from exc
    if os.sep in text or text.startswith(".") or (os.altsep and os.altsep in text):
        raise CannotVerify(f"{text}: no such checkpoint directory")
    known = list(getattr(transformers, "CONFIG_MAPPING", {}).keys())
    if text not in known:
        types = {name.lower(): name for name in known if name == name.lower()}  # model types, not class names
        close = [types[c] for c in difflib.get_close_matches(text.lower(), list(types), n=3)]
        hint = f"; did you mean {' or '.join(close)}?" if close else " (hfpatch architectures lists them)"
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
                f"{first_line(exc)}"
            ) from exc
    if _image_text_to_text(text) and text not in _causal_lm_types():
        try:
            return tiny_multimodal(text, attention=tiny_attention(text))
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises building it, in one line
            raise CannotVerify(
                f"{text}: cannot build a tiny image-text-to-text model on transformers {release}: "
                f"{first_line(exc)}"
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


def is_multimodal(model: Any) -> bool:
    """An image-text-to-text model, whose text path runs the decoder-only scenarios."""
    return _image_text_to_text(getattr(model.config, "model_type", ""))


def first_line(exc: BaseException, limit: int = 120) -> str:
    """What an exception says, in one line of at most ``limit`` characters."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def plain_call(model: Any, model_type: str) -> dict[str, Any]:
    """What a plain call ``model(input_ids=...)`` needs passed: nothing, or ``use_cache=False`` where the
    model runs only without the cache it makes itself (BLT on 5.24: its uncached scenarios still run).
    ``CannotVerify`` where it runs neither way, in one line."""
    ids = torch.tensor([[5, 6]])
    with torch.no_grad(), engine.unpatched():
        try:
            model(input_ids=ids)
            return {}
        except Exception as exc:  # noqa: BLE001 - reported in one line, unless the uncached call runs
            failed = exc
        try:
            model(input_ids=ids, use_cache=False)
            return {"use_cache": False}
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            pass
    raise CannotVerify(
        f"{model_type}: a plain call model(input_ids=...) fails: {first_line(failed)}"
    ) from failed


def check_causal(model: Any, model_type: str, prefix_lm: bool = False, plain: Optional[dict] = None) -> bool:
    """A causal LM's output at a token does not depend on later tokens: change the last token of a
    sequence and compare the outputs before it. A masked LM or an encoder fails this: raises, unless
    ``prefix_lm`` (an image-text-to-text model: a prefix LM, whose call attends both ways), False.
    ``plain``: what a plain call needs (:func:`plain_call`)."""
    ids = torch.tensor([[5, 6, 7, 8]])
    other = ids.clone()
    other[0, -1] = 9
    try:
        with torch.no_grad(), engine.unpatched():
            first, second = (outputs(model(input_ids=x, **(plain or {})))[0, :-1] for x in (ids, other))
    except Exception as exc:  # noqa: BLE001 - the model cannot run a plain call: report it in one line
        raise CannotVerify(
            f"{model_type}: a plain call model(input_ids=...) fails: {first_line(exc)}"
        ) from exc
    if (first - second).abs().max().item() <= TOLERANCE:
        return True
    if not prefix_lm:
        raise CannotVerify(
            f"{model_type}: not a causal LM (a token's output depends on later tokens): hfpatch covers "
            "decoder-only models"
        )
    return False


def check_runs(model: Any, model_type: str, inputs: Inputs) -> None:
    """An encoder-decoder model runs a plain call: two decoder tokens after one row's encoder input."""
    try:
        with torch.no_grad(), engine.unpatched():
            model(**{inputs.ids: inputs.tokens(torch.tensor([[5, 6]]))}, **inputs.row(0, 1))
    except Exception as exc:  # noqa: BLE001 - the model cannot run a plain call: report it in one line
        names = ", ".join(name for name, _ in inputs.fixed)
        raise CannotVerify(
            f"{model_type}: a plain call model({names}=..., {inputs.ids}=...) fails: {first_line(exc)}"
        ) from exc
