"""``python -m hfpatch``: the doctor, and ``python -m hfpatch verify PATH_OR_TYPE`` (see doctor.py)."""

import sys

from .doctor import main

sys.exit(main())
