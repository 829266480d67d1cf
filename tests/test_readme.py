"""The README's architecture table is generated from the declarations, never typed by hand."""

from __future__ import annotations

import re
from pathlib import Path

from hfpatch.doctor import architectures

README = Path(__file__).resolve().parent.parent / "README.md"


def test_architecture_table_is_current():
    text = README.read_text()
    pattern = r"<!-- architectures: generated .*? -->\n(.*?)\n<!-- architectures: end -->"
    block = re.search(pattern, text, re.S)
    assert block, "the README lost its generated architecture table"
    assert block.group(1).strip() == architectures().strip(), (
        "the README's table is stale: paste the output of python -m hfpatch architectures"
    )
