"""What hfpatch costs a call that does not grow with the model's depth: the host reads of a packed or
an unpadded call and the Python frames of a decode step (tests/costs.py counts them), each at two depths,
against stock at the same depths."""

from __future__ import annotations

import pytest
from packaging.version import Version

import hfpatch

from conftest import TF, reverted
from costs import frames, gpt2, llama, packed_call, padded_call, reads
from expectations import PACKED_FROM


def stock_reads(model, kwargs: dict):
    with reverted():
        return reads(model, kwargs)


@pytest.mark.parametrize("layout", ["packed", "unpadded"])
@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_host_reads_do_not_grow_with_the_layers(make, layout):
    since = PACKED_FROM[make.__name__]
    if TF < Version(since):
        pytest.skip(f"{make.__name__}'s packed rows are kept from {since} (installed {TF})")
    kwargs = packed_call() if layout == "packed" else padded_call()
    hfpatch.apply(unpad=layout == "unpadded")
    try:
        shallow, deep = (reads(make(layers), kwargs) for layers in (2, 8))
    finally:
        hfpatch.apply(unpad=False)
    stock_shallow, stock_deep = (stock_reads(make(layers), kwargs) for layers in (2, 8))
    assert sum(deep.every.values()) == sum(shallow.every.values()), (shallow.every, deep.every)
    assert sum(deep.device.values()) == sum(shallow.device.values()), (shallow.device, deep.device)
    # the call's own: one copy to the host (positions and mask at once), besides what stock reads
    extra = sum(deep.device.values()) - sum(stock_deep.device.values())
    assert extra <= 1, (deep.device, stock_deep.device)
    assert sum(stock_deep.device.values()) == sum(stock_shallow.device.values())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (5.x: past_key_values, the cache's old name)
@pytest.mark.parametrize("passed", [True, False], ids=["positions passed", "positions derived"])
@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_a_decode_step_pays_nothing_per_layer(make, passed):
    """A process that has made no packed call: hfpatch's frames on a decode step are the same at 16
    layers as at 2 (the by-sequence attention rows are installed at a module's first packed call). After
    one, at most one more a layer (the by-layout function's own frame, where transformers looks the
    attention up by subscript; from get_interface on, the module's own lookup saves more than that)."""
    if TF < Version("4.53"):
        pytest.skip(f"rotary embeddings by layer before 4.45, attention functions by module from 4.48 ({TF})")
    with reverted():
        stock = {layers: frames(make(layers), passed) for layers in (2, 16)}
    hfpatch.revert()  # (a packed call of an earlier test installed the rows it needs: a fresh apply())
    hfpatch.apply()
    patched = {layers: frames(make(layers), passed) for layers in (2, 16)}
    extra = {layers: patched[layers] - stock[layers] for layers in (2, 16)}
    assert extra[16] == extra[2], (stock, patched)
    assert stock[16] > stock[2]  # (the count sees the layers)
    after = {}
    for layers in (2, 16):
        model = make(layers)
        model(**packed_call(), use_cache=False)  # (its module's attention rows go in)
        after[layers] = frames(model, passed) - stock[layers]
    assert after[16] - after[2] <= 16 - 2, (stock, after)
