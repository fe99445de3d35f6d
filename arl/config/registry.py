"""Plug-in registries read by name: the rules (`arl.config.rules.OneOf`) and the backend strings
(`arl.config.backend.engine_names`) check a name against the registry it must be a key of, read
when asked, so that `arl.config` imports no plug-in. A leaf of `arl.config`."""

import importlib


def registry_names(target: str) -> list[str]:
    """The names of the registry at ``module:attribute`` (a dict of name -> implementation)."""
    module, _, name = target.partition(":")
    return list(getattr(importlib.import_module(module), name))
