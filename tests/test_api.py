"""The public API's contracts: Status is a read-only Mapping, revert(archs) mirrors apply(archs),
patched() and unpatched() decide for their own thread only (nested, and with other threads applying
or reverting), and nothing verify(), the doctor or unpatched() do changes what another thread
computes."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping

import pytest
import torch

import hfpatch
from hfpatch import cli
from hfpatch.verification.tiny import tiny_model

from conftest import REGISTRY, TF, arch_skip_reason
from expectations import ABSOLUTE
from harness import PAD, TOLERANCE, WRONG, random_rows, run_alone


def _patched(arch):
    return hfpatch.status()[arch].state == "applied"


@pytest.fixture
def two(model, arch):
    """Two imported adapters: the flagship under test and another one this release has (imported)."""
    other = next((a for a in REGISTRY if a != arch and not arch_skip_reason(a)), None)
    if other is None:
        pytest.skip(f"transformers {TF} has no second architecture hfpatch patches")
    importlib.import_module(REGISTRY[other].module)
    hfpatch.revert()
    yield arch, other
    hfpatch.revert()


def test_status_is_a_read_only_mapping(model, arch):
    status = hfpatch.status()
    assert isinstance(status, Mapping)
    assert arch in status and "no-such-type" not in status
    assert list(status) == [entry.arch for entry in status.values()] == list(status.keys())
    assert len(status) == len(list(status)) >= len(REGISTRY)
    assert status.get("no-such-type") is None and status.get(arch).state == "applied"
    assert dict(status.items())[arch] == status[arch]
    with pytest.raises(TypeError):
        status[arch] = None  # type: ignore[index]
    for alias in REGISTRY[arch].aliases:
        assert status[alias].state == status[arch].state and REGISTRY[arch].cls in status[alias].reason


def test_registry_is_a_read_only_view():
    view = hfpatch.registry()
    assert isinstance(view, Mapping) and "llama" in view and view["llama"].cls == "LlamaModel"
    with pytest.raises(TypeError):
        view["x"] = view["llama"]  # type: ignore[index]


def test_revert_takes_archs_like_apply(two):
    arch, other = two
    hfpatch.apply([arch, other])
    status = hfpatch.revert(arch)
    assert status[arch].state == "not applied" and status[other].state == "applied"
    with pytest.raises(ValueError, match="unknown model type"):
        hfpatch.revert(["no-such-type"])


def test_patched_undoes_only_its_own(two):
    arch, other = two
    hfpatch.apply(other)
    with hfpatch.patched([arch, other]):
        assert _patched(arch) and _patched(other)
    assert not _patched(arch), "applied by the block: undone"
    assert _patched(other), "applied before the block: stays"


def test_apply_inside_patched_stays(two):
    arch, _ = two
    with hfpatch.patched(arch):
        hfpatch.apply(arch)
    assert _patched(arch)


def test_nested_patched_blocks(two):
    arch, _ = two
    with hfpatch.patched(arch):
        with hfpatch.patched(arch):
            assert _patched(arch)
        assert _patched(arch), "the outer block still holds it"
    assert not _patched(arch)


def test_revert_inside_patched_wins(two):
    arch, _ = two
    with hfpatch.patched(arch):
        hfpatch.revert(arch)
        assert not _patched(arch)
    assert not _patched(arch)


def test_patched_with_other_threads_applying_and_reverting(two):
    """Blocks in other threads: each undoes only its own; a thread's apply() during a block stays."""
    arch, _ = two
    inside, release = threading.Event(), threading.Event()
    errors = []

    def block():
        try:
            with hfpatch.patched(arch):
                inside.set()
                release.wait(10)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    worker = threading.Thread(target=block)
    worker.start()
    inside.wait(10)
    with hfpatch.patched(arch):
        pass
    assert not _patched(arch), "the other thread's block does not patch this thread"
    assert "other threads" in hfpatch.status()[arch].reason, "but its patch stays installed for it"
    hfpatch.apply(arch)  # pinned meanwhile, by this thread
    release.set()
    worker.join(10)
    assert not errors and _patched(arch), "apply() during the block outlives it"

    hfpatch.revert(arch)
    inside.clear()
    release.clear()
    worker = threading.Thread(target=block)
    worker.start()
    inside.wait(10)
    hfpatch.revert(arch)  # another thread reverts while the block is open
    release.set()
    worker.join(10)
    assert not errors and not _patched(arch)


def test_many_threads_with_patched_blocks(two):
    arch, _ = two
    barrier, errors = threading.Barrier(8), []

    def worker(i):
        try:
            barrier.wait()
            for _ in range(30):
                with hfpatch.patched(arch):
                    assert _patched(arch)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not _patched(arch)


def test_unpatched_restores_exactly_the_state_found(two):
    arch, other = two
    hfpatch.apply(other)
    owner = type(next(m for m in [tiny_model(arch)]).base_model)
    with hfpatch.patched(arch):
        before, patch = hfpatch.status(), owner.__dict__["forward"]
        with hfpatch.unpatched():
            assert not _patched(arch) and not _patched(other)
            assert "unpatched()" in hfpatch.status()[arch].reason
            assert owner.__dict__["forward"] is patch, "nothing global changes: the class keeps the patch"
        assert hfpatch.status() == before
    assert not _patched(arch) and _patched(other), "the block's hold and the pin came back, each its own"


ARCH = ABSOLUTE  # gpt2: absolute


@pytest.mark.slow  # the doctor and verify() in a thread beside a serving one: nox -s ci runs it
def test_a_serving_thread_stays_exact_while_others_compare_with_stock(capsys):
    """A thread serves a patched GPT-2 (a left-padded batch, which stock gets wrong) while another
    thread runs verify() on the same model and on a model type, the doctor, and unpatched() blocks:
    every one of the serving thread's results stays exact, and the stock comparisons stay stock."""
    if arch_skip_reason(ARCH):
        pytest.skip(arch_skip_reason(ARCH))
    model = tiny_model(ARCH)
    a, b = random_rows([3, 6], seed=17)
    ids = torch.tensor([[PAD] * 3 + a, b])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    expected = [run_alone(model, a), run_alone(model, b)]
    stop, errors, served = threading.Event(), [], []

    def serve():
        while not stop.is_set():
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
            error = max(
                (logits[0, 3:] - expected[0]).abs().max().item(), (logits[1] - expected[1]).abs().max().item()
            )
            served.append(error)
            if error > TOLERANCE:
                errors.append(error)

    server = threading.Thread(target=serve)
    server.start()
    try:
        for _ in range(2):
            result = hfpatch.verify(model)
            assert result.ok and result.stock_wrong, str(result)
        assert hfpatch.verify(ARCH).ok
        assert cli.doctor() == 0
        for _ in range(20):
            with hfpatch.unpatched(), torch.no_grad():
                stock = model(input_ids=ids, attention_mask=mask).logits
            assert (stock[0, 3:] - expected[0]).abs().max().item() > WRONG, "unpatched() is stock here"
    finally:
        stop.set()
        server.join(60)
    capsys.readouterr()
    assert len(served) > 20 and not errors, f"{len(errors)} of {len(served)} served results were wrong"


def test_blocks_make_no_garbage_collector_pass(two, monkeypatch):
    """With accelerate imported, the forward functions hfpatch installs are rebound on models
    accelerate hooked, with one pass over the garbage collector's objects: when apply() installs them,
    or the first block of a model type does; later patched() and unpatched() blocks make none (the same
    functions go back on the class, and they run stock wherever hfpatch is not applied)."""
    import gc
    import sys
    import types

    arch, _ = two
    monkeypatch.setitem(sys.modules, "accelerate.hooks", types.ModuleType("accelerate.hooks"))
    passes = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a, **k: passes.append(1) or real(*a, **k))
    with hfpatch.patched(arch):  # installed before (by the fixture's apply()): built already
        pass
    for _ in range(5):
        with hfpatch.patched(arch), hfpatch.unpatched(arch):
            pass
    assert passes == [], "patched()/unpatched() blocks made a pass over the garbage collector"
    hfpatch.apply(arch)
    assert passes == [1], "apply() installing the forward rebinds hooked models, with one pass"
