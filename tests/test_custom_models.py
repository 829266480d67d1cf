"""Models that follow transformers' conventions without being its classes (hfpatch/custom.py): renamed
copies of the installed GPT-2, Llama and Qwen2 files, registered through the Auto classes or loaded
from a checkpoint directory with ``trust_remote_code=True``, and a causal LM written from scratch. Each
is exact with hfpatch for left padding, a right-padded cached prefix + 1 token and holes, against each
row run alone on stock transformers (the tests' own harness, not ``verify``), with ``apply()`` called
before the classes exist (they are patched when defined) or after the model is built; ``status()``
lists them and ``verify(model).ok``. A model whose positions mean something else is left alone.

The release probe runs this file (compat/probe_matrix.sh): its probe tests record the custom kind
(``custom-llama``, ``custom-from-scratch``, ...), how the model was made, and what they found
(tests/probes.py), skips included (the release has no such model to copy, no DynamicCache, or
transformers refuses the copy as remote code)."""

from __future__ import annotations

import json
import threading

import custom_models
import pytest
import torch
from probes import both_sides, custom_type, exact_where_run, judge_custom, skip

import hfpatch
from compat.vocabulary import (
    ABSENT,
    CLASS_DIFFERS,
    CUSTOM_NOT_PATCHED,
    LEFT_ALONE,
    NO_CACHE_CLASS,
    NOT_REMOTE_CODE,
    WRONG_WITH_POSITIONS,
)
from hfpatch.engine import custom_adapter

from conftest import TF, stock
from harness import TOLERANCE, WRONG, max_diff, random_rows, run_padded

CASES = {  # chunks, left: rows of 5 and 3 tokens
    "left padding, one call": (((5, 3),), ((True, True),)),
    "right-padded prefix + 1 token": (((4, 2), (1, 1)), ((False, False), (False, False))),
    "holes: right-padded prefix + 2 tokens, left-padded": (((3, 1), (2, 2)), ((False, False), (True, True))),
}
ROWS = random_rows([5, 3], seed=31)
KINDS = ["gpt2", "llama", "qwen2", "from scratch"]
QUICK = {"llama", "from scratch"}
PARAMS = [pytest.param(kind, marks=() if kind in QUICK else pytest.mark.slow) for kind in KINDS]


def _classes(kind: str, root, probe=None) -> tuple[type, type, str]:
    """(the config class, the causal-LM class, the model type) of a copy imported from ``root``;
    ``probe``: the test's record, where it probes (why it skips)."""
    import importlib.util

    if kind == "from scratch":
        _needs_the_cache_api(probe)
    if kind != "from scratch" and importlib.util.find_spec(f"transformers.models.{kind}") is None:
        skip(probe, ABSENT, f"transformers {TF} has no {kind} to copy")
    if kind == "from scratch":
        module, model_type = custom_models.import_scratch(root)
        return module.ScratchConfig, module.ScratchLM, model_type
    configuration, modeling, model_type = custom_models.import_copy(kind, root)
    head = "LMHeadModel" if kind == "gpt2" else "ForCausalLM"
    return custom_models.classes(configuration, "Config"), custom_models.classes(modeling, head), model_type


def _config(config_class: type, kind: str):
    if kind == "from scratch":
        return config_class(initializer_range=0.1)
    return custom_models.tiny(config_class)


def _registered(kind: str, root, apply_first: bool, probe=None):
    """A model of a renamed copy registered through the Auto classes, built with from_config."""
    import transformers

    if not apply_first:
        hfpatch.revert()
    config_class, causal, model_type = _classes(kind, root, probe)
    transformers.AutoConfig.register(model_type, config_class)
    transformers.AutoModelForCausalLM.register(config_class, causal)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(config_class, kind)).float().eval()
    if not apply_first:
        hfpatch.apply()
    return model, model_type


def _remote_code(kind: str, root, apply_first: bool, probe=None):
    """A model loaded from a checkpoint directory that carries its own code (``auto_map``), with
    ``trust_remote_code=True``: transformers imports that code as a module of its own."""
    import transformers

    if not apply_first:
        hfpatch.revert()
    config_class, causal, model_type = _classes(kind, root / "source", probe)
    checkpoint = root / "checkpoint"
    model = custom_models.built(causal, _config(config_class, kind))
    module = causal.__module__.rsplit(".", 1)[-1]
    config_module = config_class.__module__.rsplit(".", 1)[-1]
    model.config.auto_map = {
        "AutoConfig": f"{config_module}.{config_class.__name__}",
        "AutoModelForCausalLM": f"{module}.{causal.__name__}",
    }
    model.save_pretrained(checkpoint)
    for source in {causal.__module__, config_class.__module__}:
        path = __import__(source, fromlist=["_"]).__file__
        (checkpoint / path.rsplit("/", 1)[-1]).write_text(open(path).read())
    json.loads((checkpoint / "config.json").read_text())  # written, with the auto_map
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    except ImportError as exc:  # its check of the file's imports (flash_attn in a try block, 4.40)
        skip(
            probe,
            NOT_REMOTE_CODE,
            f"transformers {TF} cannot load this copy as remote code, hfpatch or not: {exc}",
        )
    unloaded = [name for name, parameter in loaded.named_parameters() if parameter.is_meta]
    if unloaded:  # 5.3.0: the tied GPT-2 head of a remote-code copy (stock transformers alone, no hfpatch)
        skip(probe, NOT_REMOTE_CODE, f"transformers {TF} loads this copy as remote code without {unloaded} "
             "(left on the meta device), hfpatch or not")  # fmt: skip
    loaded = loaded.float().eval()
    assert (
        type(loaded) is not causal and type(loaded).__name__ == causal.__name__
    )  # the checkpoint's own code
    if not apply_first:
        hfpatch.apply()
    return loaded, model_type


@pytest.mark.parametrize("apply_first", [True, False], ids=["apply before", "apply after"])
@pytest.mark.parametrize("how", ["registered", "remote code"])
@pytest.mark.parametrize("kind", PARAMS)
def test_custom_model_rows_equal_themselves_alone(kind, how, apply_first, tmp_path, probe):
    probe.of_custom(kind, how)
    make = _registered if how == "registered" else _remote_code
    model, _ = make(kind, tmp_path, apply_first, probe)
    sides = {}  # scenario: (hfpatch, stock), each against the rows run alone
    for name, (chunks, left) in CASES.items():
        sides[name] = both_sides(probe, lambda: max_diff(model, ROWS, run_padded(model, ROWS, chunks, left)))  # noqa: B023
    adapters = {custom_adapter(type(module)) for module in model.modules()} - {None}
    states = {adapter.arch: hfpatch.status()[adapter.arch] for adapter in adapters}
    applied = bool(adapters) and all(entry.state == "applied" for entry in states.values())
    judge_custom(probe, list(sides.values()), applied)  # not patched, or wrong: recorded before asserting
    refused = CUSTOM_NOT_PATCHED.get((custom_type(kind), str(TF)))
    if refused is not None:  # its check refuses it here (measured): not patched, stock's results exactly
        assert adapters and not applied, f"expected refused on {TF} ({refused}); {states}"
        assert all("hfpatch" in entry.reason for entry in states.values()), states  # the check's numbers
        assert all(patched == on_stock for patched, on_stock in sides.values()), sides
        return
    for name, (patched, on_stock) in sides.items():
        assert patched <= TOLERANCE, f"{name}: hfpatch {patched:.2g}, stock {on_stock:.2g}; {states}"
    assert max(on_stock for _, on_stock in sides.values()) > WRONG, (
        "stock transformers is right: nothing was checked"
    )
    assert adapters, "no class of the model was recognised"
    assert all(entry.state == "applied" for entry in states.values()), states
    result = hfpatch.verify(model)
    judge_custom(probe, list(sides.values()), applied, result)
    assert exact_where_run(result), str(result)


def _patched_here() -> str:
    """The copy the mechanism tests use: Llama's, or GPT-2's where the check refuses Llama's."""
    return "gpt2" if ("custom-llama", str(TF)) in CUSTOM_NOT_PATCHED else "llama"


def test_revert_restores_a_custom_class(tmp_path):
    kind = _patched_here()
    config_class, causal, model_type = _classes(kind, tmp_path)
    model = custom_models.built(causal, _config(config_class, kind))
    base = type(model.base_model)  # its Model class (model.model, model.transformer)
    patched = base.__dict__["forward"]
    assert getattr(patched, "__hfpatch_adapter__", None) == model_type, "not patched when defined"
    hfpatch.revert()
    original = base.__dict__["forward"]
    assert getattr(original, "__hfpatch_adapter__", None) is None
    hfpatch.apply()
    assert base.__dict__["forward"] is patched  # the same function again: checked once


# Positions from the mask with an offset, the way RoBERTa and XGLM count them (padding_idx + 1 first):
# right on stock for left padding; positions from 0 would be wrong, so the check must refuse it
OFFSET_POSITIONS = """
        if position_ids is None:
            position_ids = torch.arange(past, past + x.shape[1], device=x.device)[None]
"""
OFFSET_FROM_MASK = """
        if position_ids is None:
            real = attention_mask if attention_mask is not None else torch.ones(x.shape[0], past + x.shape[1])
            position_ids = (real.long().cumsum(-1) * real.long())[:, past:] + 1
"""


def _needs_the_cache_api(probe=None) -> None:
    import transformers

    if not hasattr(transformers, "DynamicCache"):
        skip(probe, NO_CACHE_CLASS, f"the from-scratch model uses transformers' DynamicCache (not in {TF})")


def test_a_model_whose_positions_mean_something_else_is_left_alone(tmp_path, probe):
    """A from-scratch model that counts its positions from the mask from 1 (an offset table): stock is
    right; hfpatch's check on a tiny copy finds positions from 0 wrong, so it is not patched, status()
    says why, and its results are stock's bit for bit. (The probe records, besides, the scenarios'
    max|diff| against each row alone, stock and with hfpatch: right on both.)"""
    probe.of_custom("offset positions", "defined in the program")
    _needs_the_cache_api(probe)
    source = custom_models.FROM_SCRATCH.replace(OFFSET_POSITIONS, OFFSET_FROM_MASK)
    assert source != custom_models.FROM_SCRATCH
    module, model_type = custom_models.import_scratch(tmp_path, source)
    model = custom_models.built(module.ScratchLM, module.ScratchConfig(initializer_range=0.1))
    ids, mask = torch.tensor([[0, 0, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1]])
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits  # its first call: checked first
        with stock():
            expected = model(input_ids=ids, attention_mask=mask).logits
    entry = hfpatch.status()[model_type]
    sides = [
        both_sides(probe, lambda: max_diff(model, ROWS, run_padded(model, ROWS, chunks, left)))  # noqa: B023
        for chunks, left in CASES.values()
    ]
    patches = hfpatch.verify(model).patches
    refused = entry.state == "skipped" and "not exact with hfpatch" in entry.reason
    same = torch.equal(got, expected)
    kind = LEFT_ALONE if refused and same and not patches else CLASS_DIFFERS if same else WRONG_WITH_POSITIONS
    probe.found(kind, max(s for _, s in sides), max(p for p, _ in sides))
    assert entry.state == "skipped" and "not exact with hfpatch" in entry.reason, entry
    assert torch.equal(got, expected)
    assert not patches


def test_a_decoder_without_position_ids_is_listed_and_left_alone(tmp_path, probe):
    probe.of_custom("no position_ids", "defined in the program")
    _needs_the_cache_api(probe)
    positions = "position_ids = torch.arange(past, past + x.shape[1], device=x.device)[None]"
    source = custom_models.FROM_SCRATCH.replace("position_ids=None, ", "").replace(
        OFFSET_POSITIONS, f"\n        {positions}\n"
    )
    assert "position_ids=None" not in source and "position_ids is None" not in source
    _, model_type = custom_models.import_scratch(tmp_path, source)
    entry = hfpatch.status()[model_type]
    listed = entry.state == "not covered" and "takes no position_ids" in entry.reason
    probe.found(LEFT_ALONE if listed else CLASS_DIFFERS)
    assert entry.state == "not covered" and "takes no position_ids" in entry.reason, entry


def test_patched_block_reaches_a_class_defined_without_apply(tmp_path):
    """With hfpatch reverted, a class defined and built is stock; a patched() block looks at it, checks it
    and patches it for the block only."""
    hfpatch.revert()
    kind = _patched_here()
    config_class, causal, _ = _classes(kind, tmp_path)
    model = custom_models.built(causal, _config(config_class, kind))
    chunks, left = CASES["right-padded prefix + 1 token"]
    assert max_diff(model, ROWS, run_padded(model, ROWS, chunks, left)) > WRONG  # stock
    with hfpatch.patched():
        assert max_diff(model, ROWS, run_padded(model, ROWS, chunks, left)) <= TOLERANCE
    assert max_diff(model, ROWS, run_padded(model, ROWS, chunks, left)) > WRONG


def test_the_check_runs_outside_the_engines_lock(tmp_path):
    """A class's check on a tiny copy holds no lock that other threads need: while it runs in one thread
    (held here until released), status() in another finishes; the check's verdict then patches it."""
    from hfpatch import custom
    from hfpatch.verification import classes

    hfpatch.revert()
    started, go = threading.Event(), threading.Event()

    def held_check(cls):
        started.set()
        assert go.wait(120)
        return classes.check(cls)

    custom.check_classes_with(held_check)
    try:
        _, _, model_type = _classes(_patched_here(), tmp_path)  # defined without apply(): not checked yet
        checking = threading.Thread(target=hfpatch.apply)
        checking.start()
        assert started.wait(120)
        seen = {}
        other = threading.Thread(target=lambda: seen.update(state=hfpatch.status()[model_type].state))
        other.start()
        other.join(60)
        assert not other.is_alive() and seen["state"] != "applied", seen  # answered during the check
        go.set()
        checking.join(120)
        assert hfpatch.status()[model_type].state == "applied"
    finally:
        go.set()
        custom.check_classes_with(classes.check)


def test_a_class_defined_after_apply_is_checked_at_its_first_call(tmp_path):
    """Defining a recognised class while apply() holds runs nothing (no check inside its definition, its
    module may still be importing); its first call runs the check on a tiny copy (random weights), after
    which the program's random numbers are the ones it would have drawn, and that call is exact."""
    kind = _patched_here()
    config_class, causal, model_type = _classes(kind, tmp_path)  # defined with apply() holding
    assert hfpatch.status()[model_type].state == "waiting for its check"
    model = custom_models.built(causal, _config(config_class, kind))
    chunks, left = CASES["right-padded prefix + 1 token"]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with torch.inference_mode():  # the caller's context is not the check's
        got = run_padded(model, ROWS, chunks, left)  # the first call: checked, then patched
    assert torch.equal(torch.rand(3), expected)
    assert hfpatch.status()[model_type].state == "applied"
    assert max_diff(model, ROWS, got) <= TOLERANCE


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_audit_judges_a_custom_model_by_its_kind_of_positions(kind, tmp_path):
    """hfpatch audit on copies: a left-padded batch in one call is wrong on stock for the GPT-2 copy
    (absolute positions) and right for the Llama copy (rotary), and the audit counts it so."""
    config_class, causal, _ = _classes(kind, tmp_path)
    model = custom_models.built(causal, _config(config_class, kind))
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad(), hfpatch.audit() as report, stock():
        batch = model(input_ids=ids, attention_mask=mask).logits[0, 1:]
    with torch.no_grad():
        alone = model(input_ids=ids[:1, 1:]).logits[0]
    wrong = (batch - alone).abs().max().item() > WRONG
    if (custom_type(kind), str(TF)) in CUSTOM_NOT_PATCHED:  # refused by its check: not watched, listed
        assert all(entry["calls"] is None for entry in report.as_dict().values()), report.as_dict()
        return
    counted = next(entry for entry in report.as_dict().values() if entry.get("calls"))
    assert wrong == (kind == "gpt2"), (batch - alone).abs().max().item()
    assert counted["calls"] == 1 and counted["affected"] == int(wrong) and counted["tokens"] == 3 * wrong
