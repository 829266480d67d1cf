"""Every covered architecture, through the public probe: ``hfpatch.verify`` on a tiny random model of
each model type the installed release ships (decoder-only, and encoder-decoder models whose decoder
hfpatch patches), eager and SDPA attention. On the newest tested release,
stock transformers must be wrong (the bug is real) and hfpatch exact; on every release, exact.
The compat matrix reads this module's results (compat/results/probe/)."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version
from probes import exact_where_run, judge_verification

import hfpatch
from compat.vocabulary import (
    ABSENT,
    EXACT,
    NOT_KEPT,
    OUTSIDE,
    SKIPPED,
    STOCK_FAILS,
    STOCK_RIGHT,
    WRONG_WITH_POSITIONS,
)
from hfpatch.support import NEWEST_TESTED
from hfpatch.verification.tiny import tiny_model, tiny_seq2seq

from conftest import REGISTRY, SEQ2SEQ_MODEL_TYPES, TF, arch_skip_reason, require_covered
from harness import WRONG, tolerance_of

# the model types that run a patched class: each adapter's own and its aliases (exaone runs LlamaModel),
# and the encoder-decoder models whose decoder (and encoder) a seq2seq adapter patches (verify runs their
# decoder scenarios and a left-padded encoder input; tests/test_decoders.py checks them by hand too);
# the quick suite probes a few of each kind, the nox sessions (and CI) every one; vision-language adapters:
# tests/test_wrappers.py
COVERED = [
    (name, alias)
    for name, adapter in REGISTRY.items()
    if not adapter.family.multimodal
    for alias in (name, *adapter.aliases)
]
# rotary, window, multimodal, absolute, alias; a position table, speech features
QUICK = {"qwen2", "mistral", "gemma3", "gpt_neo", "exaone", "bart", "whisper"}
PARAMS = [
    pytest.param(name, alias, id=alias, marks=() if alias in QUICK else pytest.mark.slow)
    for name, alias in COVERED
]
# the causal-LM model types of the newest release that hfpatch does not cover: encoders with an LM head
# and decoders of encoder-decoder models outside the seq2seq mappings (status() lists them as not covered)
NOT_DECODER_ONLY = {
    "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "trocr", "xlm",
    "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod",
}  # fmt: skip


def _tiny(model_type: str, attention: str):
    build = tiny_seq2seq if REGISTRY.get(model_type) and REGISTRY[model_type].family.seq2seq else tiny_model
    try:
        return build(model_type, attention=attention)
    except (ValueError, ImportError) as exc:
        if attention == "sdpa" and ("sdpa" in str(exc).lower() or "scaled_dot_product" in str(exc)):
            pytest.skip(f"{model_type} does not support SDPA in transformers {TF}: {str(exc)[:200]}")
        raise


def probed(name: str, model_type: str, attention: str, probe) -> None:
    """Skip (recording why) unless ``model_type`` runs a patched class of adapter ``name`` here."""
    probe.of(model_type, attention)
    require_covered(name, probe)
    alias_since = dict(REGISTRY[name].alias_since).get(model_type)
    if alias_since is not None and TF < Version(alias_since):
        probe.found(OUTSIDE)
        pytest.skip(
            f"{model_type} is verified from {alias_since} (its tiny model builds there); installed {TF}"
        )
    try:
        import transformers

        transformers.AutoConfig.for_model(model_type)
    except ValueError as exc:
        probe.found(ABSENT)
        pytest.skip(f"model type {model_type} is not in transformers {TF}: {exc}")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name, model_type", PARAMS)
def test_verify_covered_architecture(name, model_type, attention, probe):
    probed(name, model_type, attention, probe)
    result = hfpatch.verify(_tiny(model_type, attention))
    newest = TF >= Version(NEWEST_TESTED)
    from_mask = REGISTRY[name].family.from_mask  # its own positions are right: packed rows only (below)
    judge_verification(probe, result, stock_wrong_expected=newest and not from_mask)
    assert exact_where_run(result), str(result)
    if from_mask:
        assert not result.stock_wrong, f"stock transformers is wrong with padding here\n{result}"
    elif newest:
        assert result.stock_wrong, f"stock transformers is right: the declaration is stale\n{result}"


# decoder-only model types (no seq2seq decoder takes packed rows; BLOOM hands the mask to its ALiBi)
PACKED_PARAMS = [
    param
    for param, (name, _) in zip(PARAMS, COVERED)
    if not REGISTRY[name].family.seq2seq
    and (REGISTRY[name].family.hands_to is None or REGISTRY[name].family.from_mask)
]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name, model_type", PACKED_PARAMS)
def test_packed_rows_covered_architecture(name, model_type, attention, probe):
    """Rows packing several sequences (positions restarting: no mask, an all-ones mask, two padded rows),
    each sequence against itself alone on stock: exact where status() says hfpatch keeps them, else
    stock's results bit for bit (declared). The probe's packed cells (compat/REPORT.md)."""
    from test_packed import SEQUENCES, run_layout, worst

    probed(name, model_type, attention, probe)
    model = _tiny(model_type, attention)
    try:
        with hfpatch.unpatched(), torch.no_grad():
            run_layout(model, "no mask")
    except TypeError as exc:  # a model that takes no positions: no packed row to make
        if "position_ids" not in str(exc):  # (stock's own code raises on the row: 4.54-5.1's xLSTM kernel)
            probe.found(STOCK_FAILS)
            pytest.skip(f"{type(model).__name__} raises on a packed row on stock in transformers {TF}: {exc}")
        probe.found(SKIPPED)
        pytest.skip(f"{type(model).__name__} takes no position_ids in transformers {TF}: {exc}")
    said = hfpatch.status()[name].packed
    layouts = ("no mask", "an all-ones mask", "two right-padded rows")
    patched, on_stock = 0.0, 0.0
    for layout in layouts:
        logits, spans, _ = run_layout(model, layout)
        with hfpatch.unpatched():
            stock_logits, _, _ = run_layout(model, layout)
        if not said.startswith("yes"):
            assert torch.equal(logits, stock_logits), f"{layout}: not kept ({said}), yet not stock's"
        else:  # (not hfpatch's mask carrier: an attention may meet the mask itself)
            assert type(logits) is torch.Tensor, f"{layout}: the logits are a {type(logits).__name__}"
        patched = max(patched, worst(model, logits, spans))
        on_stock = max(on_stock, worst(model, stock_logits, spans))
    bound = tolerance_of(model, SEQUENCES)
    kind = (
        NOT_KEPT if not said.startswith("yes")
        else WRONG_WITH_POSITIONS if patched > bound
        else STOCK_RIGHT if on_stock <= WRONG
        else EXACT
    )  # fmt: skip
    probe.found(kind, on_stock, patched)
    assert kind in (EXACT, NOT_KEPT), f"packed rows of {model_type}: {kind} ({said}; stock {on_stock:.2g})"


# model types whose causal LM's prepare_inputs_for_generation drops generate()'s mask before 4.57 (their
# forward then never sees a left-padded batch's pads)
DROPS_THE_MASK = [
    pytest.param(t, marks=() if t == "ctrl" else pytest.mark.slow) for t in ("ctrl", "openai-gpt", "rwkv")
]


@pytest.mark.parametrize("model_type", DROPS_THE_MASK)
def test_generate_of_a_left_padded_batch_where_the_model_drops_the_mask(model_type):
    """Greedy ``generate()`` of a left-padded batch: each row's scores at every step against the row
    generated alone, unpadded, on stock; where the release's own method drops the mask, stock is wrong."""
    reason = arch_skip_reason(model_type)
    if reason:
        pytest.skip(reason)
    from hfpatch.forward import drops_the_mask

    model = tiny_model(model_type)
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    scored = {**greedy, "output_scores": True, "return_dict_in_generate": True}

    def errors(made):
        return [
            (made.scores[s][r] - alone[r].scores[s][0]).abs().max().item() for r in range(3) for s in range(4)
        ]

    with torch.no_grad():
        with hfpatch.unpatched():
            alone = [model.generate(input_ids=torch.tensor([row]), **scored) for row in rows]
            on_stock = model.generate(input_ids=ids, attention_mask=mask, **scored)
        made = model.generate(input_ids=ids, attention_mask=mask, **scored)
    assert max(errors(made)) <= tolerance_of(model, rows)
    for r, row in enumerate(rows):
        assert made.sequences[r, width:].tolist() == alone[r].sequences[0, len(row) :].tolist(), r
    if drops_the_mask(type(model).prepare_inputs_for_generation):
        assert max(errors(on_stock)) > WRONG  # (the test can fail: stock's rows are wrong)


def test_status_lists_every_model_type_of_every_tested_release():
    """status() answers for every model type of every tested release's causal-LM, seq2seq, speech-seq2seq
    and image-text-to-text mappings (compat/model_types.json, read from each release's wheel), and lists
    no other; on the installed release, for every one it maps."""
    import json
    from pathlib import Path

    status = hfpatch.status()
    assert all(entry.state and entry.reason for entry in status.values())
    mapped = json.loads((Path(__file__).parent.parent / "compat" / "model_types.json").read_text())
    assert not set(mapped) - set(status), f"declare them: {sorted(set(mapped) - set(status))}"
    # (classes of users', and a newer release's new types)
    declared = {entry.arch for entry in status.values() if entry.support not in ("custom", "untested newer")}
    assert not declared - set(mapped), f"status() lists unknown model types: {sorted(declared - set(mapped))}"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    here = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(SEQ2SEQ_MODEL_TYPES)
    assert here <= set(status), f"new model types: declare them ({sorted(here - set(status))})"
    if TF != Version(NEWEST_TESTED):
        pytest.skip(f"the table of model types is measured on {NEWEST_TESTED} (installed: {TF})")
    for model_type in NOT_DECODER_ONLY:  # encoders with an LM head, listed as not covered
        assert status[model_type].state == "not covered", status[model_type]


def test_status_answers_for_a_newer_releases_new_model_types(monkeypatch):
    """On a release newer than the newest tested, a model type no tested release maps gets an entry (not
    covered, untested newer; it raised KeyError): here, the installed release read as 99.0, and one of its
    types taken out of what hfpatch knows."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hfpatch import engine, states

    known = [entry.arch for entry in hfpatch.status().values()]
    assert all(arch in known for arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)  # (a tested release: none new)
    assert not states.new_types(Version(NEWEST_TESTED), [])  # (nothing listed, nothing imported)
    newest = Version("99.0")
    monkeypatch.setattr(engine, "installed_transformers", lambda: newest)
    assert len(hfpatch.status()) == len(known)
    left_out = next(iter(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    [entry] = states.new_types(newest, [arch for arch in known if arch != left_out])
    assert (entry.arch, entry.state, entry.support) == (left_out, "not covered", "untested newer"), entry
    assert "new in transformers 99.0" in entry.reason and entry.packed.startswith("no: "), entry


@pytest.mark.parametrize("model_type", ["mpt"])
def test_verify_model_types_hfpatch_does_not_patch(model_type):
    """verify() works on any causal LM, patched or not: what it finds matches the declared verdict
    (MPT: ALiBi from the distance between cache columns: not fixable by positions)."""
    import transformers

    try:
        transformers.AutoConfig.for_model(model_type)
    except ValueError:
        pytest.skip(f"{model_type} is not in transformers {TF}")
    result = hfpatch.verify(model_type)
    state = hfpatch.status()[model_type].state
    assert result.state == state != "applied" and not result.patches
    assert "hfpatch does not patch it" in result.verdict and "fixed" not in result.verdict
    if TF != Version(NEWEST_TESTED):
        return  # the verdicts were measured on the newest release; elsewhere: it runs, and says so
    # wrong on stock, and positions by hand do not fix it either
    assert not result.ok and max(row.stock for row in result.rows) > WRONG, str(result)
    assert max(row.patched for row in result.rows) > WRONG, str(result)
