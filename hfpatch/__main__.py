"""``python -m hfpatch``: the command line (see ``python -m hfpatch --help``). From a source checkout
that is not installed, ``python path/to/checkout/hfpatch ...`` runs it too."""

import os
import sys

if __package__:
    from .cli import console
else:  # run as a folder or a file: the package is found in the folder above, not module by module here
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from hfpatch.cli import console

console(prog="python -m hfpatch")
