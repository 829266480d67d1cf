"""Put on ``PYTHONPATH`` by ``hfpatch run``: apply hfpatch at interpreter start, then run the
``sitecustomize`` this one shadows, if there is one (as ``ddtrace-run`` does)."""

import importlib.util
import os
import sys
import warnings

try:
    import hfpatch.auto  # noqa: F401
except Exception as exc:  # noqa: BLE001 - never stop the interpreter from starting
    warnings.warn(f"hfpatch run: not applied in this process: {exc}", RuntimeWarning, stacklevel=1)
    if os.environ.get("RAY_RUNTIME_ENV_HOOK") == "hfpatch.workers.ray_runtime_env":
        del os.environ["RAY_RUNTIME_ENV_HOOK"]  # a Python without hfpatch: ray.init() could not load it


def _chain() -> None:
    """Import the next ``sitecustomize`` on the path (this folder left out), then restore both."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved_path, ours = list(sys.path), sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            import sitecustomize  # noqa: F401  (its own errors surface as Python reports them)
    finally:
        sys.path[:] = saved_path
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_chain()
