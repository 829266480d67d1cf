"""The model types of every tested release's mappings that ``hfpatch.status()`` must answer for (the causal
LM, seq2seq, speech-seq2seq and image-text-to-text mappings), each with the first and last release that maps
it: read from each release's wheel (``pip download --no-deps transformers==RELEASE``), written to
compat/model_types.json. tests/test_api.py checks that status() has an entry for each.

    python compat/model_types.py WHEELS_FOLDER     # downloads what the folder lacks, then writes the file
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from matrix import RELEASES

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hfpatch.support import MAPPINGS  # noqa: E402 (the mappings status() answers for: one list)


def mapped(wheel: Path) -> set[str]:
    """The model types of :data:`MAPPINGS` in one release's ``modeling_auto.py``."""
    source = zipfile.ZipFile(wheel).read("transformers/models/auto/modeling_auto.py").decode()
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in MAPPINGS:
            pairs = node.value.args[0].elts if isinstance(node.value, ast.Call) and node.value.args else []
            found |= {pair.elts[0].value for pair in pairs if isinstance(pair, ast.Tuple)}
    return found


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    spans: dict[str, list[str]] = {}
    for release in RELEASES:
        wheel = next(folder.glob(f"transformers-{release}-*.whl"), None)
        if wheel is None:
            pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"transformers=={release}"]
            subprocess.run([*pip, "-d", str(folder)], check=True)
            wheel = next(folder.glob(f"transformers-{release}-*.whl"))
        for model_type in mapped(wheel):
            spans.setdefault(model_type, [release, release])[1] = release
    lines = [f"{json.dumps(model_type)}: {json.dumps(spans[model_type])}" for model_type in sorted(spans)]
    (HERE / "model_types.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")  # a type a line


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} WHEELS_FOLDER")
    main(Path(sys.argv[1]))
