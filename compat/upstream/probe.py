"""Diagnose a test that differs under unpad=True: run a call of the family's test inputs both ways in one
process (hfpatch.apply(unpad=False), then apply(unpad=True)) and say, per output, where they differ:
at real tokens, at pads only, in shape, or a raise.

    cd $WORK/tree && HF_HUB_OFFLINE=1 PYTHONPATH=<shims> \
        python <repo>/compat/upstream/probe.py FAMILY [CLASS ...]

FAMILY: a test module's family (llama, gpt2, ...); CLASS: model class names (default: every class in the
test's all_model_classes). Calls: each class's forward with the tester's common inputs (eval, no grad),
with output_hidden_states=True, and with labels where the class takes them (training mode off).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import unittest

import hfpatch

hfpatch.apply()

import torch  # noqa: E402
import upstream_shims  # noqa: E402,F401  (the tester default 5.24.0 lacks)


def tester_for(family: str, wanted: str = ""):
    mod = importlib.import_module(f"tests.models.{family}.test_modeling_{family}")
    for name, obj in vars(mod).items():
        if (
            isinstance(obj, type)
            and issubclass(obj, unittest.TestCase)
            and obj.__module__ == mod.__name__
            and (name == wanted or (not wanted and name.endswith("ModelTest")))
        ):
            case = obj("setUp")
            case.setUp()
            return case
    raise SystemExit(f"no model test class in {mod.__name__}")


def flat(value, prefix="out"):
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif hasattr(value, "to_tuple") and not hasattr(value, "get_seq_length"):
        for k, v in value.items():
            yield from flat(v, f"{prefix}.{k}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from flat(v, f"{prefix}[{i}]")
    elif hasattr(value, "layers"):  # a Cache
        for i, layer in enumerate(value.layers):
            for attr in ("keys", "values"):
                t = getattr(layer, attr, None)
                if isinstance(t, torch.Tensor):
                    yield f"{prefix}.layers[{i}].{attr}", t


def compare(ref, got, mask):
    rows = []
    r, g = dict(flat(ref)), dict(flat(got))
    for key in sorted(set(r) | set(g)):
        a, b = r.get(key), g.get(key)
        if a is None or b is None:
            rows.append((key, "only in " + ("unpad=False" if b is None else "unpad=True")))
            continue
        if a.shape != b.shape:
            rows.append((key, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"))
            continue
        if not a.is_floating_point():
            if not torch.equal(a, b):
                rows.append((key, "differs (integer)"))
            continue
        d = (a - b).abs()
        if d.numel() == 0 or float(d.max()) <= 1e-5:
            continue
        where = "?"
        if d.dim() >= 2 and tuple(d.shape[:2]) == tuple(mask.shape):
            real = mask.bool()
            at_real = float(d[real].max()) if real.any() else 0
            where = f"real max {at_real:.3g}, pads max {float(d[~real].max()):.3g}"
        elif (
            d.dim() >= 3 and d.shape[0] == mask.shape[0] and d.shape[-2] == mask.shape[1]
        ):  # cache [b, h, t, d]
            real = mask.bool()[:, None, :, None].expand_as(d)
            where = f"(cache) real max {float(d[real].max()):.3g}, pads max {float(d[~real].max()):.3g}"
        else:
            where = f"max {float(d.max()):.3g}"
        rows.append((key, where))
    return rows


def run(model, kwargs, mask):
    out = {}
    for unpad in (False, True):
        hfpatch.apply(unpad=unpad)
        before = hfpatch.status().unpadded
        try:
            with torch.no_grad():
                out[unpad] = model(**kwargs)
        except Exception as exc:  # noqa: BLE001
            out[unpad] = exc
        after = hfpatch.status().unpadded
        if unpad:
            calls = after["calls"] - before["calls"]
            why = {
                k: v - before["padded"].get(k, 0)
                for k, v in after["padded"].items()
                if v - before["padded"].get(k, 0)
            }
    hfpatch.apply(unpad=False)
    if isinstance(out[False], Exception) or isinstance(out[True], Exception):
        return [("raise", f"unpad=False: {out[False]!r:.200} | unpad=True: {out[True]!r:.200}")], calls, why
    return compare(out[False], out[True], mask), calls, why


def main():
    family, names = sys.argv[1], set(sys.argv[2:])
    wanted = next((n for n in names if n.endswith("Test")), "")
    names.discard(wanted)
    case = tester_for(family, wanted)
    config, inputs = case.model_tester.prepare_config_and_inputs_for_common()
    mask = inputs["attention_mask"]
    print(f"{family}: mask {tuple(mask.shape)}, {int(mask.sum())} real of {mask.numel()}")
    for cls in case.all_model_classes:
        if names and cls.__name__ not in names:
            continue
        torch.manual_seed(0)
        model = cls(config).eval()
        params = inspect.signature(cls.forward).parameters
        calls = [("plain", {})]
        calls.append(("output_hidden_states", {"output_hidden_states": True}))
        if "labels" in params:
            prepared = case._prepare_for_class(inputs, cls, return_labels=True)
            if "labels" in prepared:
                calls.append(("labels", {"labels": prepared["labels"]}))
        for what, extra in calls:
            kw = {k: v for k, v in case._prepare_for_class(inputs, cls).items()}
            kw.update(extra)
            rows, n, why = run(model, kw, mask)
            status = "same" if not rows else "DIFF"
            print(f"  {cls.__name__} [{what}] unpadded calls {n} padded {why}: {status}")
            for key, where in rows:
                print(f"      {key}: {where}")


if __name__ == "__main__":
    main()
