"""accelerate hooks, with real accelerate: a base model hooked before ``apply()`` (``dispatch_model``
with a device map that names it, ``cpu_offload``, ``from_pretrained(device_map=...)`` with offload)
gives the unpadded reference's logits after ``apply()`` and stock logits after ``revert()``; models
hooked after ``apply()`` work; hooks removed afterwards leave the model following hfpatch's state."""

from __future__ import annotations

import pytest
import torch

import hfpatch
from hfpatch.verification.scenarios import SCENARIOS, scenario_rows
from hfpatch.verification.tiny import tiny_model

from conftest import arch_skip_reason
from expectations import ABSOLUTE
from harness import TOLERANCE, WRONG, max_diff, run_padded

accelerate = pytest.importorskip("accelerate")
from accelerate import cpu_offload, dispatch_model  # noqa: E402
from accelerate.hooks import remove_hook_from_submodules  # noqa: E402

# the most position-sensitive flagship: absolute positions (left padding is wrong on stock too)
ARCH = ABSOLUTE
SCENARIO = SCENARIOS[0]  # a right-padded cached prefix + 1 token


def _error(model) -> float:
    rows = scenario_rows(SCENARIO)
    return max_diff(model, rows, run_padded(model, rows, SCENARIO.chunks, SCENARIO.left))


@pytest.fixture
def stock_model():
    reason = arch_skip_reason(ARCH)
    if reason:
        pytest.skip(reason)
    hfpatch.revert()
    yield tiny_model(ARCH)
    hfpatch.apply()


def _hooked_base(model) -> bool:
    return hasattr(model.base_model, "_hf_hook") and "_old_forward" in vars(model.base_model)


def _every_child_on_cpu(model) -> dict:
    return {name: "cpu" for name, _ in model.named_children()}


@pytest.mark.parametrize("how", ["dispatch_model", "cpu_offload"])
def test_hooked_before_apply(stock_model, how):
    if how == "dispatch_model":
        model = dispatch_model(stock_model, device_map=_every_child_on_cpu(stock_model), force_hooks=True)
    else:  # hooks on the modules that hold weights (and the whole model), not on the base model itself
        model = cpu_offload(stock_model, execution_device=torch.device("cpu"))
    assert _hooked_base(model) == (how == "dispatch_model")
    assert _error(model) > WRONG, "stock is wrong"
    hfpatch.apply()
    assert _error(model) <= TOLERANCE, "apply() reaches a model hooked before it"
    hfpatch.revert()
    assert _error(model) > WRONG, "revert() reaches it too"
    hfpatch.apply()
    remove_hook_from_submodules(model)  # forward becomes the captured bound method: hfpatch's
    assert _error(model) <= TOLERANCE
    hfpatch.revert()
    assert _error(model) > WRONG, "after the hooks are gone, revert() still reaches the instance"


def test_hooked_after_apply(stock_model):
    hfpatch.apply()
    model = dispatch_model(stock_model, device_map=_every_child_on_cpu(stock_model), force_hooks=True)
    assert _hooked_base(model)
    assert _error(model) <= TOLERANCE
    hfpatch.revert()
    assert _error(model) > WRONG, "revert() after apply-then-dispatch restores stock"


def test_from_pretrained_with_a_device_map_that_names_the_base_model(stock_model, tmp_path):
    """transformers dispatches with hooks when the map offloads a module (here the LM head, to disk;
    untied from the embedding, so that it has weights of its own to offload)."""
    import transformers

    untied = tiny_model(ARCH, sizes={"tie_word_embeddings": False})
    untied.save_pretrained(tmp_path / "model")
    device_map = _every_child_on_cpu(stock_model)
    head = next(name for name in device_map if name != stock_model.base_model_prefix)
    device_map[head] = "disk"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert _hooked_base(model)
    assert _error(model) > WRONG
    hfpatch.apply()
    assert _error(model) <= TOLERANCE
