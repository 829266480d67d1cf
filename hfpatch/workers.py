"""hfpatch in Ray workers, whatever started the cluster.

The launcher's ``sitecustomize`` reaches the workers of a cluster that ``ray.init()`` starts inside a
launched driver, as long as their ``PYTHONPATH`` is the launcher's. The workers of a cluster started
elsewhere (``ray start --head``), and workers given a ``PYTHONPATH`` of their own in a runtime_env,
start without it: a Ray ``worker_process_setup_hook`` reaches them all.

    ray.init(runtime_env={"worker_process_setup_hook": "hfpatch.workers.setup"})  # by hand
    ray.init(runtime_env=hfpatch.workers.ray_runtime_env({"env_vars": {...}}))    # merged into yours
    hfpatch run -- python driver.py   # every ray.init() of the driver merges it (RAY_RUNTIME_ENV_HOOK)
    hfpatch.workers.ray_applied_by()  # {node id: how a worker of this job there was patched}

Ray Client (``ray://``) runs no setup hook for its jobs: ``import hfpatch.auto`` in the tasks' code there.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

from . import engine
from .launcher import (
    ARCHS_VARIABLE,
    AUDIT_VARIABLE,
    DISABLED_VARIABLE,
    RAY_RUNTIME_ENV_HOOK,
    SHADOW_VARIABLE,
    apply_from_environment,
    read_environment,
)

__all__ = ["RAY_RUNTIME_ENV_HOOK", "SETUP_HOOK", "ray_applied_by", "ray_runtime_env", "setup"]

SETUP_HOOK = "hfpatch.workers.setup"
_RAY_RESERVED = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # a hook Ray has already settled (a job's own)


def setup() -> None:
    """A Ray ``worker_process_setup_hook``: apply hfpatch in this worker as its ``HFPATCH_*``
    variables say, recorded in ``status().applied_by``."""
    apply_from_environment(f"the Ray worker setup hook (process {os.getpid()})")


class _ThenTheirs:
    """hfpatch's setup hook, then the user's own (a callable or ``"module.function"``): Ray takes one."""

    def __init__(self, theirs: Union[str, Callable[[], Any]]) -> None:
        self.theirs = theirs
        self.__name__ = f"{SETUP_HOOK} then {getattr(theirs, '__name__', theirs)}"  # Ray names it so

    def __call__(self) -> None:
        setup()
        hook = self.theirs
        if isinstance(hook, str):
            module, _, name = hook.rpartition(".")
            hook = getattr(importlib.import_module(module), name)
        hook()


def ray_runtime_env(runtime_env: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """A copy of ``runtime_env`` (a dict, a ``ray.runtime_env.RuntimeEnv`` or ``None``) whose workers
    apply hfpatch: hfpatch's ``worker_process_setup_hook`` (run before a hook of yours), and this
    process's ``HFPATCH_ARCHS`` / ``HFPATCH_DISABLED`` where your ``env_vars`` do not set them. Every
    other setting of yours is kept. Also the function ``hfpatch run`` names in ``RAY_RUNTIME_ENV_HOOK``,
    which Ray calls on every ``ray.init()``'s runtime_env."""
    if runtime_env is not None and not isinstance(runtime_env, Mapping):
        raise TypeError(f"runtime_env: expected a dict or None, got {type(runtime_env).__name__}")
    merged = dict(runtime_env or {})
    env_vars = dict(merged.get("env_vars") or {})
    for name in (ARCHS_VARIABLE, DISABLED_VARIABLE, SHADOW_VARIABLE, AUDIT_VARIABLE):
        if name in os.environ and name not in env_vars:
            env_vars[name] = os.environ[name]
    if env_vars:
        read_environment(env_vars)  # a model type hfpatch does not know: one line here, not in each worker
        merged["env_vars"] = env_vars
    theirs = merged.get("worker_process_setup_hook")
    if _RAY_RESERVED in env_vars:  # a runtime_env Ray has processed already (a submitted job's): as it is
        return merged
    if theirs is None:
        merged["worker_process_setup_hook"] = SETUP_HOOK
    elif theirs != SETUP_HOOK and not isinstance(theirs, _ThenTheirs):
        merged["worker_process_setup_hook"] = _ThenTheirs(theirs)
    return merged


def _applied_by() -> str:
    return engine.status().applied_by


def ray_applied_by() -> dict[str, str]:
    """From a connected Ray driver: ``{node id: status().applied_by}`` of a worker of this job on every
    alive node (``""`` where hfpatch is not applied there)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("ray_applied_by(): not connected to a Ray cluster (call ray.init() first)")
    probe = ray.remote(num_cpus=0)(_applied_by)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        for n in nodes
    ]
    return dict(zip(nodes, ray.get(refs)))
