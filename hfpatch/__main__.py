"""``python -m hfpatch``: the doctor (see :mod:`hfpatch.doctor`)."""

import sys

from .doctor import main

sys.exit(main())
