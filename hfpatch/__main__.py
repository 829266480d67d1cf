"""``python -m hfpatch``: the command line (see ``python -m hfpatch --help``)."""

import sys

from .cli import main

sys.exit(main(prog="python -m hfpatch"))
