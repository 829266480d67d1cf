"""``import hfpatch.auto``: apply hfpatch now, configured by the environment (like ``ddtrace.auto``).

    HFPATCH_ARCHS=qwen2,llama   # only these model types (default: every adapter)
    HFPATCH_DISABLED=1          # do nothing (also: true, yes, on)

``hfpatch run -- CMD`` imports this module at the start of every Python process it starts (through a
``sitecustomize`` on ``PYTHONPATH``), so spawned workers, DataLoader workers and torchrun ranks are
patched too. ``hfpatch.status().applied_by`` says how a process was patched.
"""

from .launcher import apply_from_environment

apply_from_environment()
