"""What hfpatch adds to a call against the model's depth, counted (no clock): the host reads of a packed
and an unpadded call, and the Python frames of a decode step, at 2 to 32 layers, beside stock at the same
depth. The counters are tests/costs.py's (tests/test_per_call_cost.py asserts with them at two depths)."""

from __future__ import annotations

import importlib.util

from harness import ROOT, Sections

_spec = importlib.util.spec_from_file_location("costs", ROOT.parent / "tests" / "costs.py")
costs = importlib.util.module_from_spec(_spec)  # (the counters the tests use; tests/ is no package)
_spec.loader.exec_module(costs)

DEPTHS = (2, 8, 16, 32)


def counted() -> list[str]:
    import hfpatch

    frames, reads, packed_call, padded_call = costs.frames, costs.reads, costs.packed_call, costs.padded_call

    rows = []
    for name, make in (("llama", costs.llama), ("gpt2", costs.gpt2)):
        for layers in DEPTHS:
            model = make(layers)
            cells = []
            for layout, call in (("packed", packed_call()), ("unpadded", padded_call())):
                hfpatch.revert()
                stock = reads(model, call)
                hfpatch.apply(unpad=layout == "unpadded")
                ours = reads(model, call)
                hfpatch.apply(unpad=False)
                cells.append(f"{_total(ours.device)} / {_total(ours.every)} ({_total(stock.device)})")
            hfpatch.revert()
            stock = [frames(model, passed) for passed in (True, False)]
            hfpatch.apply()  # (a fresh apply: no module has packed a row yet)
            ours = [frames(model, passed) for passed in (True, False)]
            model(**packed_call())  # the module's first packed call puts its attention rows in
            after = [frames(model, passed) for passed in (True, False)]
            steps = [f"{o - s:+d}" for o, s in zip(ours, stock)] + [
                f"{a - s:+d}" for a, s in zip(after, stock)
            ]
            rows.append(f"| {name} | {layers} | {' | '.join(cells)} | {stock[0]} | {' | '.join(steps)} |")
    return rows


def _total(counts) -> int:
    return sum(counts.values())


SECTIONS: Sections = {
    "## What a call costs against the model's depth: host reads and a decode step's Python frames": (
        [
            "Counted, not timed (the same on any machine). Host reads: ops that need a tensor's values on",
            "the host (`item`, `tolist`, `nonzero`, `bool()`, boolean indexing, `.cpu()` ...), counted at",
            "torch's Python API in one call: those of tensors that would be on a device (a sync each on a",
            "GPU; the `.cpu()` copy and what is made from it are the host's) / every read, hfpatch's work on",
            "its host copy included (stock's device reads in brackets). A packed row of three sequences in",
            "two rows; an unpadded call of three right-padded rows. Decode step: one token after 8, a",
            "left-padded batch of two, DynamicCache; stock's Python frames (positions passed), then",
            "hfpatch's extra frames with positions passed / derived, in a process that has packed no row,",
            "and after the module's first packed call (its by-sequence attention rows then in).",
            "",
            "| model | layers | packed call: reads | unpadded call: reads | decode step: stock's frames | "
            "extra, passed | extra, derived | extra after a packed call, passed | derived |",
            "|---|---|---|---|---|---|---|---|---|",
        ],
        counted,
    ),
}
