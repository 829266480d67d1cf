"""Model instances that captured a class's original ``forward`` before hfpatch replaced it: accelerate's
hooks, rebound to hfpatch's forward when a forward is installed."""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["HOOK_ATTRIBUTES", "rebind_hooked"]

HOOK_ATTRIBUTES = ("_old_forward", "forward")  # accelerate's add_hook_to_module / remove_hook_from_module


def rebind_hooked(installed: list[Any]) -> None:
    """Model instances that captured a class's original ``forward`` before hfpatch replaced it follow
    the class.

    accelerate's ``add_hook_to_module`` keeps ``module._old_forward``, a method bound to the class's
    function of that moment, and ``remove_hook_from_module`` puts it back as the instance's own
    ``forward``: a class patch alone would not reach those instances. They are rebound to hfpatch's
    forward, which runs the original itself wherever hfpatch is not applied (so nothing rebinds them
    back at ``revert()``, and the same function is installed again later). Found with one pass over the
    garbage collector's objects (about 50 ms for a process with a few million objects), made when
    ``apply()`` (or a module's import) installs a forward, or the first ``patched()`` block of an adapter
    does, and only once ``accelerate.hooks`` has been imported: without it, nothing captures ``forward``
    this way."""
    swapped = {row.original: row.replacement for row in installed if row.attribute == "forward"}
    if not swapped or "accelerate.hooks" not in sys.modules:
        return
    import gc

    for obj in gc.get_objects():
        if type(obj) is types.MethodType and obj.__func__ in swapped:
            instance = obj.__self__
            attributes = getattr(instance, "__dict__", None) or {}
            for name in HOOK_ATTRIBUTES:
                if attributes.get(name) is obj:
                    attributes[name] = types.MethodType(swapped[obj.__func__], instance)
