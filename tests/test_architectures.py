"""Every covered architecture, through the public probe: ``hfpatch.verify`` on a tiny random model of
each model type the installed release ships, eager and SDPA attention. On the newest tested release,
stock transformers must be wrong (the bug is real) and hfpatch exact; on every release, exact."""

from __future__ import annotations

import pytest
from conftest import REGISTRY, TF, arch_skip_reason
from packaging.version import Version

import hfpatch
from hfpatch import probe
from hfpatch.gates import NEWEST_TESTED, upstream_bugs_on

# the model types that run a patched class: each adapter's own and its aliases (exaone runs LlamaModel)
COVERED = [(name, alias) for name, adapter in REGISTRY.items() for alias in (name, *adapter.aliases)]
# the 30 causal-LM model types of 5.24.0 that are not decoder-only (encoder LM heads, enc-dec decoders)
NOT_DECODER_ONLY = 30


def _tiny(model_type: str, attention: str):
    try:
        return probe.tiny_model(model_type, attention=attention)
    except (ValueError, ImportError) as exc:
        if attention == "sdpa" and ("sdpa" in str(exc).lower() or "scaled_dot_product" in str(exc)):
            pytest.skip(f"{model_type} does not support SDPA in transformers {TF}: {str(exc)[:200]}")
        raise


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name, model_type", COVERED, ids=[alias for _, alias in COVERED])
def test_verify_covered_architecture(name, model_type, attention, record_property):
    reason = arch_skip_reason(name)
    if reason:
        pytest.skip(reason)
    try:
        import transformers

        transformers.AutoConfig.for_model(model_type)
    except ValueError as exc:
        pytest.skip(f"model type {model_type} is not in transformers {TF}: {exc}")
    bugs = upstream_bugs_on(REGISTRY[name], TF)
    if bugs and attention == "sdpa":
        pytest.skip(f"declared upstream bug on {TF}: {bugs[0]}")
    result = hfpatch.verify(_tiny(model_type, attention))
    record_property("stock", max(row.stock for row in result.rows))  # for compat/REPORT.md
    record_property("hfpatch", max(row.patched for row in result.rows))
    assert result.ok, str(result)
    if TF >= Version(NEWEST_TESTED):
        assert result.stock_wrong, f"stock transformers is right: the declaration is stale\n{result}"


def test_status_lists_every_decoder_only_model_type():
    status = hfpatch.status()
    assert all(entry.state and entry.reason for entry in status.values())
    if TF != Version(NEWEST_TESTED):
        pytest.skip(f"the table of model types is measured on {NEWEST_TESTED} (installed: {TF})")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(status) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - len(status) == NOT_DECODER_ONLY


@pytest.mark.parametrize("model_type", ["mamba", "opt"])
def test_verify_model_types_hfpatch_does_not_patch(model_type):
    """verify() works on any causal LM, patched or not: what it finds matches the declared verdict
    (mamba: not fixable by positions, a recurrent state; OPT: right on stock)."""
    import transformers

    try:
        transformers.AutoConfig.for_model(model_type)
    except ValueError:
        pytest.skip(f"{model_type} is not in transformers {TF}")
    result = hfpatch.verify(model_type)
    state = hfpatch.status()[model_type].state
    assert result.state == state != "applied"
    if TF != Version(NEWEST_TESTED):
        return  # the verdicts were measured on the newest release; elsewhere: it runs, and says so
    if state == "right on stock":
        assert result.ok and not result.stock_wrong, str(result)
    else:
        assert not result.ok, str(result)
