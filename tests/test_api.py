"""The public API's contracts: Status is a read-only Mapping, revert(archs) mirrors apply(archs),
patched() undoes only what it applied (nested, and with other threads applying or reverting), and
unpatched() restores exactly the state it found."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping

import pytest
from conftest import REGISTRY, TF, arch_skip_reason

import hfpatch
from hfpatch import engine


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
    assert _patched(arch), "the other thread's block still holds it"
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
    with hfpatch.patched(arch):
        before = hfpatch.status()
        with hfpatch.unpatched():
            assert not _patched(arch) and not _patched(other)
            assert engine.adapter_for(arch).cls  # nothing re-patches inside the block
        assert hfpatch.status() == before
    assert not _patched(arch) and _patched(other), "the block's hold and the pin came back, each its own"
