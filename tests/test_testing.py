"""hfpatch.testing, the reference for padding invariance: it raises where a forward is wrong (stock GPT-2,
a rotary kernel that reads only row 0's positions, a loop that numbers tokens by arange) and passes where
it is right (patched GPT-2 and Llama, a callable that calls them), with a table that says where; pytest
has it as a fixture once hfpatch is installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings

import hfpatch
from hfpatch.caches import past_length
from hfpatch.testing import FAMILIES, CannotCheck, assert_padding_invariant, tolerance_for
from hfpatch.testing.strategies import packed_scenarios, scenarios
from hfpatch.tolerances import NOISE_CAP
from hfpatch.verification.tiny import VOCAB, tiny_model

from conftest import TF, arch_skip_reason
from expectations import PACKED_FROM
from harness import rotary_reading_row_zero

ROTARY, ABSOLUTE = "llama", "gpt2"


@pytest.fixture(params=[ABSOLUTE, ROTARY])
def flagship(request):
    if arch_skip_reason(request.param):
        pytest.skip(arch_skip_reason(request.param))
    return tiny_model(request.param)


def families_kept(arch: str) -> list[str]:
    """Every family, less packed rows where this release cannot keep them (expectations.PACKED_FROM)."""
    from packaging.version import Version

    kept = TF >= Version(PACKED_FROM[arch])
    return [family for family in FAMILIES if kept or family != "packed"]


def test_passes_on_patched_models_and_callables_of_them(flagship):
    report = assert_padding_invariant(flagship, families=families_kept(flagship.config.model_type))
    assert report.ok and len({r.scenario for r in report.results}) >= 7
    assert max(r.max_diff for r in report.results) <= 1e-5
    through = assert_padding_invariant(lambda **kwargs: flagship(**kwargs), vocab_size=VOCAB)
    assert through.ok and "static (needs a transformers model)" in str(through)
    assert "packed (needs a callable, or a module's forward, with a position_ids parameter)" in str(through)


def test_packed_rows_each_sequence_against_itself(flagship):
    """The packed family: stock lets each packed sequence see the ones before it; hfpatch, where this
    release keeps packed rows, gives each its own logits."""
    arch = flagship.config.model_type
    with hfpatch.unpatched(), pytest.raises(AssertionError) as caught:
        assert_padding_invariant(flagship, families=["packed"])
    table = str(caught.value)
    assert "packed: three sequences in a row, no mask" in table and "packed: two right-padded rows" in table
    if "packed" in families_kept(arch):
        report = assert_padding_invariant(flagship, families=["packed"])
        assert len({r.scenario for r in report.results}) == 3 and report.ok


def test_raises_on_stock_naming_where(flagship):
    with hfpatch.unpatched(), pytest.raises(AssertionError) as caught:
        assert_padding_invariant(flagship)
    table = str(caught.value)
    assert table.startswith("padding invariance broken:"), table
    assert "right-padded prefix + 1 token" in table and "3 of 4" in table, table  # the token after the hole
    if flagship.config.model_type == ABSOLUTE:
        assert "left padding, one call" in table, table
    else:  # a uniform rotary shift cancels
        assert "left padding, one call" not in table, table


def test_raises_on_a_rotary_kernel_that_reads_row_zeros_positions():
    """A patched Llama whose rotary embedding uses the first row's positions for every row (a fused
    kernel's bug: Liger-Kernel #461): hfpatch's positions are right, the kernel throws them away."""
    if arch_skip_reason(ROTARY):
        pytest.skip(arch_skip_reason(ROTARY))
    model = tiny_model(ROTARY)
    with rotary_reading_row_zero(model), pytest.raises(AssertionError, match="padding invariance broken"):
        assert_padding_invariant(model)
    assert assert_padding_invariant(model).ok


def test_raises_on_a_loop_that_numbers_tokens_by_arange():
    """A fast path that passes ``position_ids = arange(past, past + new)``: hfpatch leaves explicit
    positions as they are, so the oracle sees the loop's own mistake."""
    if arch_skip_reason(ABSOLUTE):
        pytest.skip(arch_skip_reason(ABSOLUTE))
    model = tiny_model(ABSOLUTE)

    def arange_positions(input_ids, attention_mask=None, past_key_values=None, **kwargs):
        past = past_length(past_key_values)  # a Cache object, or a legacy tuple (4.x)
        positions = torch.arange(past, past + input_ids.shape[1]).expand(input_ids.shape[0], -1)
        return model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                     position_ids=positions, **kwargs)  # fmt: skip

    with pytest.raises(AssertionError, match="padding invariance broken"):
        assert_padding_invariant(arange_positions, vocab_size=VOCAB)


def test_half_precision_has_a_tolerance_of_its_own():
    if arch_skip_reason(ROTARY):
        pytest.skip(arch_skip_reason(ROTARY))
    model = tiny_model(ROTARY).to(torch.bfloat16)
    report = assert_padding_invariant(model, families=["padding", "cached"])
    assert report.dtype == "bfloat16" and report.tolerance > tolerance_for(torch.float32)
    with hfpatch.unpatched(), pytest.raises(AssertionError, match="right-padded prefix"):
        assert_padding_invariant(model, families=["cached"])


def test_a_plain_object_output_works(flagship):
    """A callable that returns its own object with ``.logits`` and ``.past_key_values`` (as docs/testing.md
    describes it), not a transformers output."""
    import types

    def forward(**kwargs):
        out = flagship(**kwargs)
        return types.SimpleNamespace(logits=out.logits, past_key_values=out.past_key_values)

    assert assert_padding_invariant(forward, vocab_size=VOCAB, families=["padding", "cached"]).ok


def test_could_not_check_is_not_an_assertion_error():
    """A forward that cannot run at all: CannotCheck, which pytest.raises(AssertionError) does not take
    for a failed check."""

    def broken(**kwargs):
        raise RuntimeError("no such kernel")

    with pytest.raises(CannotCheck, match="no scenario could run.*no such kernel"):
        assert_padding_invariant(broken, vocab_size=VOCAB)
    assert not issubclass(CannotCheck, AssertionError)


def test_a_scenario_that_raises_leaves_the_others_to_decide():
    """Cached calls that raise (a forward without a cache, say): reported with their error; the uncached
    scenarios still decide (stock GPT-2 is wrong with left padding)."""
    if arch_skip_reason(ABSOLUTE):
        pytest.skip(arch_skip_reason(ABSOLUTE))
    model = tiny_model(ABSOLUTE)

    def uncached(**kwargs):
        if kwargs.get("past_key_values") is not None:
            raise NotImplementedError("no cache here")
        return model(**kwargs)

    with hfpatch.unpatched(), pytest.raises(AssertionError) as caught:
        assert_padding_invariant(uncached, vocab_size=VOCAB, families=["padding", "cached"])
    table = str(caught.value)
    assert "left padding, one call" in table and "raised NotImplementedError: no cache here" in table, table
    assert assert_padding_invariant(uncached, vocab_size=VOCAB, families=["padding", "cached"]).ok


class _HandWritten(torch.nn.Module):
    """A decoder written by hand, no transformers config: learned absolute positions (the caller's, else
    the mask's), one causal attention layer under the 2-D mask. It knows nothing of packed rows."""

    def __init__(self, vocab: int = VOCAB, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.places = torch.nn.Embedding(vocab, width), torch.nn.Embedding(64, width)
        self.attention = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.head = torch.nn.Linear(width, vocab)

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None
    ):
        import types

        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if position_ids is None:
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        x = self.tokens(input_ids) + self.places(position_ids)
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        blocked = ~(causal[None] & (mask[:, None, :] != 0)) & ~torch.eye(length, dtype=torch.bool)[None]
        out, _ = self.attention(x, x, x, attn_mask=blocked.repeat_interleave(2, 0), need_weights=False)
        return types.SimpleNamespace(logits=self.head(out + x), past_key_values=None)


def test_a_plain_module_is_read_by_its_forward():
    """An ``nn.Module`` of the user's, no transformers model: its ``forward``'s parameters decide (its
    ``__call__`` takes ``*args, **kwargs``), so the packed scenarios run; this one lets packed sequences
    see each other, and the oracle says so, while left and right padding in one call hold."""
    model = _HandWritten().eval()
    assert assert_padding_invariant(model, vocab_size=VOCAB, families=["padding"]).ok
    with pytest.raises(AssertionError) as caught:
        assert_padding_invariant(model, vocab_size=VOCAB, families=["padding", "packed"])
    assert "packed: three sequences in a row, no mask" in str(caught.value), str(caught.value)


def test_a_model_whose_own_cache_fails_still_gets_its_verdict():
    """BLT on 5.x: a call with the cache the model makes itself fails upstream, so a plain call needs
    ``use_cache=False``; the uncached scenarios still judge (left padding is wrong on stock: its hash
    n-gram byte embeddings see pads), the cached ones are said not to run; verify gives its rows too."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "BltConfig"):
        pytest.skip(f"no BLT in transformers {TF}")
    small = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
             "num_hidden_layers": 1}  # fmt: skip
    local = {**small, "hidden_size_global": 64}
    config = transformers.BltConfig(
        patcher_config=small, encoder_config=local, decoder_config=local,
        global_config={**small, "hidden_size": 64}, encoder_hash_byte_group_vocab=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BltForCausalLM(config).eval()
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6]]))
        pytest.skip(f"BLT's own cache works in transformers {TF}: nothing to show")
    except Exception:  # noqa: BLE001 - what the test is about
        pass
    with pytest.raises(AssertionError) as caught:
        assert_padding_invariant(model, families=["padding", "cached"])
    table = str(caught.value)
    assert "left padding, one call" in table and "a call with the cache the model makes itself fails" in table
    result = hfpatch.verify(model)
    assert any(row.scenario == "left padding, one call" for row in result.rows), str(result)


def test_the_tolerance_follows_the_models_own_noise():
    """Large logits (an LM head scaled up) make fp32's own noise exceed 1e-5 at every length, right
    padding alone included: the tolerance follows each scenario's control (its rows right-padded in one
    call) up to NOISE_CAP, so the patched model passes and stock is still caught."""
    if arch_skip_reason(ROTARY):
        pytest.skip(arch_skip_reason(ROTARY))
    model = tiny_model(ROTARY)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    report = assert_padding_invariant(model, families=["padding", "cached"])
    assert tolerance_for(torch.float32) < report.tolerance <= NOISE_CAP, report.tolerance
    with hfpatch.unpatched(), pytest.raises(AssertionError, match="right-padded prefix"):
        assert_padding_invariant(model, families=["cached"])


def test_verify_follows_the_same_noise_control():
    """``verify`` (the release probe's check) judges by the same control: the patched column of a model
    whose fp32 noise exceeds 1e-5 everywhere is exact within four times that noise, and stock's wrong
    positions are still caught (they are 10 or more off, far past NOISE_CAP)."""
    if arch_skip_reason(ROTARY):
        pytest.skip(arch_skip_reason(ROTARY))
    model = tiny_model(ROTARY)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    result = hfpatch.verify(model)
    assert any(row.patched > tolerance_for(torch.float32) for row in result.rows), str(result)
    assert result.ok and result.stock_wrong, str(result)
    assert all(row.tolerance <= NOISE_CAP for row in result.rows)
    assert "own fp32 noise" in str(result)


def test_bad_arguments_say_which():
    with pytest.raises(TypeError, match="vocab_size: required"):
        assert_padding_invariant(lambda **kwargs: None)
    with pytest.raises(TypeError, match="model: expected"):
        assert_padding_invariant(3)
    with pytest.raises(ValueError, match="families: unknown"):
        assert_padding_invariant(lambda **kwargs: None, vocab_size=10, families=["holes"])
    with pytest.raises(ValueError, match="tolerance: expected a number >= 0"):
        assert_padding_invariant(lambda **kwargs: None, vocab_size=10, tolerance=-1)


@settings(max_examples=8, deadline=None)
@given(scenario=scenarios())
def test_drawn_scenarios_hold_on_a_patched_model(scenario):
    """Property tests with the strategies: any padding, any split into cached calls."""
    if arch_skip_reason(ABSOLUTE):
        pytest.skip(arch_skip_reason(ABSOLUTE))
    assert assert_padding_invariant(_model(ABSOLUTE), scenarios=[scenario]).ok


@settings(max_examples=8, deadline=None)
@given(scenario=packed_scenarios())
def test_drawn_packed_rows_hold_on_a_patched_model(scenario):
    if arch_skip_reason(ROTARY) or "packed" not in families_kept(ROTARY):
        pytest.skip(f"{ROTARY}'s packed rows are kept from {PACKED_FROM[ROTARY]}")
    assert assert_padding_invariant(_model(ROTARY), scenarios=[scenario]).ok


_models: dict = {}


def _model(arch):
    if arch not in _models:
        _models[arch] = tiny_model(arch)
    return _models[arch]


@pytest.mark.slow  # a pytest in a subprocess: nox -s ci runs it
def test_the_pytest_plugin_gives_every_suite_the_fixture(tmp_path):
    """Installed hfpatch registers the fixture through the ``pytest11`` entry point: a test suite that
    imports nothing of hfpatch has it."""
    (tmp_path / "test_theirs.py").write_text(
        textwrap.dedent(
            """
            import torch
            from transformers import GPT2Config, GPT2LMHeadModel

            def test_their_model(assert_padding_invariant):
                torch.manual_seed(0)
                model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
                try:
                    assert_padding_invariant(model, families=["padding"])
                except AssertionError as exc:  # stock GPT-2: left padding shifts every position
                    assert "left padding, one call" in str(exc)
                else:
                    raise AssertionError("stock GPT-2 passed")
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
