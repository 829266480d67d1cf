"""``generate()`` on sliding-window models, whose calls carry positions of their own: transformers' prompt
reuse recipe (a padded batch of system prompts run into a cache, a copy of it handed to ``generate()``
with the system + user ids) leaves holes in every later call's mask, and the window must be decided by
position there too, while ``generate()``'s positions stay as they are. Each row's tokens (and greedy
scores) against the same row generated alone, unpadded, on stock transformers; a batch without holes
stays bit-identical to stock."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hfpatch.verification.tiny import tiny_config

from conftest import TF, arch_skip_reason, stock
from harness import TOLERANCE, WRONG, cache_kwarg, random_rows, windowed_model

WINDOW = 4
# model type: the config fields that give its layers (some or all) a window of WINDOW tokens
WINDOWED = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 0},
    "gemma2": {"sliding_window": WINDOW},
    "gemma3_text": {"sliding_window": WINDOW},
}
QUICK = ("mistral",)
PARAMS = [pytest.param(t, marks=() if t in QUICK else pytest.mark.slow) for t in WINDOWED]
SYSTEMS, USERS = random_rows([7, 4], seed=21), random_rows([3, 5], seed=22)
NEW_TOKENS = 6


def _model(model_type: str, attention: str, window: int = WINDOW) -> Any:
    reason = arch_skip_reason(model_type)
    if reason:
        pytest.skip(reason)
    config = tiny_config(model_type, WINDOWED[model_type])  # (Qwen2's layer types come from these)
    config.sliding_window = window
    return windowed_model(model_type, config, attention)


def _generate(model: Any, ids: list, mask: list, cache: Any = None, **options: Any) -> Any:
    extra = {cache_kwarg(model): cache} if cache is not None else {}
    with torch.no_grad():
        return model.generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=NEW_TOKENS,
            do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            **extra, **options,
        )  # fmt: skip


def _prefix_cache(model: Any, ids: list, mask: list, beams: int = 1) -> Any:
    """The cache of a plain forward call on the system prompts (the recipe's first step), copied."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), use_cache=True)
    cache = copy.deepcopy(out.past_key_values)
    if isinstance(cache, tuple):  # (4.42-4.47 return the legacy form to a call that passed no cache)
        from transformers import DynamicCache

        cache = DynamicCache.from_legacy_cache(cache)
    if beams > 1:
        cache.batch_repeat_interleave(beams)  # generate() expands the inputs, not a cache it is given
    return cache


def _reuse(model: Any, systems: list, users: list, side: str, **options: Any) -> Any:
    """The recipe on a batch: system prompts padded on ``side`` into a cache, then the system + user ids
    (each user part left-padded to the longest) generated from a copy of it."""
    width, user_width = max(map(len, systems)), max(map(len, users))
    ids, mask, full, full_mask = [], [], [], []
    for system, user in zip(systems, users):
        pads, user_pads = width - len(system), user_width - len(user)
        row = system + [0] * pads if side == "right" else [0] * pads + system
        row_mask = [1] * len(system) + [0] * pads if side == "right" else [0] * pads + [1] * len(system)
        ids.append(row)
        mask.append(row_mask)
        full.append(row + [0] * user_pads + user)
        full_mask.append(row_mask + [0] * user_pads + [1] * len(user))
    beams = options.get("num_beams", 1)
    return _generate(model, full, full_mask, _prefix_cache(model, ids, mask, beams), **options), len(full[0])


def _alone(model: Any, system: list, user: list, **options: Any) -> Any:
    """The recipe on one row, unpadded, on stock transformers: the reference."""
    with stock():
        cache = _prefix_cache(model, [system], [[1] * len(system)], options.get("num_beams", 1))
        return _generate(model, [system + user], [[1] * len(system + user)], cache, **options)


def _compare(model: Any, side: str, **options: Any) -> tuple[int, float]:
    """(rows whose tokens differ from the row alone, the largest greedy score difference)."""
    out, width = _reuse(model, SYSTEMS, USERS, side, **options)
    differing, worst = 0, 0.0
    beams = options.get("num_beams", 1)
    for r, (system, user) in enumerate(zip(SYSTEMS, USERS)):
        one = _alone(model, system, user, **options)
        differing += out.sequences[r, width:].tolist() != one.sequences[0, len(system + user) :].tolist()
        if beams == 1:
            worst = max(worst, max((a[r] - b[0]).abs().max().item() for a, b in zip(out.scores, one.scores)))
    return differing, worst


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", PARAMS)
def test_prompt_reuse_generates_each_row_as_alone(model_type, attention, side):
    model = _model(model_type, attention)
    differing, worst = _compare(model, side)
    assert differing == 0 and worst <= TOLERANCE, (differing, worst)
    with stock():
        stock_differing, stock_worst = _compare(model, side)
    assert stock_worst > WRONG, "stock transformers is right: the window does not act here"


@pytest.mark.slow
def test_prompt_reuse_with_beam_search():
    import transformers

    model = _model("mistral", "sdpa")
    if not hasattr(transformers.DynamicCache, "batch_repeat_interleave"):
        pytest.skip(f"transformers {TF}'s cache cannot be expanded for beams")
    differing, _ = _compare(model, "right", num_beams=2)
    assert differing == 0
    with stock():
        assert _compare(model, "right", num_beams=2)[0] > 0, "stock transformers is right here"


def test_prompt_lookup_on_a_prompt_with_a_hole():
    """Assisted decoding by prompt lookup (one row): a prompt whose mask has a hole (a pad between the
    system and user parts) generates the tokens of the row alone, through the candidates' checks."""
    model = _model("mistral", "sdpa")
    system, user = SYSTEMS[1], USERS[1]
    ids, mask = [system + [0] * 3 + user], [[1] * len(system) + [0] * 3 + [1] * len(user)]
    with stock():
        try:
            one = _generate(model, [system + user], [[1] * len(system + user)], prompt_lookup_num_tokens=2)
        except ValueError as exc:  # (5.0.0 gives prompt lookup a sliding-window cache, then crops it)
            if "Cannot `crop`" not in str(exc):
                raise
            pytest.skip(f"stock's own prompt lookup fails on the row alone here ({TF}): {exc}")
        wrong = _generate(model, ids, mask, prompt_lookup_num_tokens=2)
    out = _generate(model, ids, mask, prompt_lookup_num_tokens=2)
    assert out.sequences[0, len(ids[0]) :].tolist() == one.sequences[0, len(system + user) :].tolist()
    assert (wrong.scores[0] - one.scores[0]).abs().max().item() > WRONG, "stock is right with this hole"


@pytest.mark.parametrize("window", [WINDOW, 64])
def test_a_batch_without_holes_is_bit_identical_to_stock(window):
    """A left-padded batch (no holes: generate()'s positions and the windows by column are right) gives
    stock's very tokens and scores, with a window the prompts pass and one they do not."""
    model = _model("mistral", "sdpa", window)
    rows = [system + user for system, user in zip(SYSTEMS, USERS)]
    width = max(map(len, rows))
    ids = [[0] * (width - len(row)) + row for row in rows]
    mask = [[0] * (width - len(row)) + [1] * len(row) for row in rows]
    out = _generate(model, ids, mask)
    with stock():
        reference = _generate(model, ids, mask)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, reference.scores))
