"""The launcher registry: ``cluster.launcher`` name -> ``module:Class`` of its `Launcher`
(`arl.control.cluster`), imported when a run starts. Kept apart from the classes so that
validation and ``--help`` read the names without importing the controller (and torch)."""

from __future__ import annotations

import importlib
from typing import Any

LAUNCHERS: dict[str, str] = {
    "local": "arl.control.cluster:_LocalLauncher",
    "slurm": "arl.control.cluster:_SlurmLauncher",
    "ray": "arl.control.cluster:_RayLauncher",
    "attach": "arl.control.cluster:_AttachLauncher",
}


def launcher_class(name: str) -> Any:
    """The launcher class registered as ``name`` (validation has checked the name)."""
    module, _, attr = LAUNCHERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
