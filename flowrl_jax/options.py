"""Plug-in options: one sub-dict per plug-in, its defaults in the plug-in's module (`DEFAULTS`).

    opts = resolve(spatial.DEFAULTS, config.credit.spatial, owner="credit.spatial")
    opts.tau                                             # the config's value, or the module's default

An option the plug-in does not define is an error naming it (`owner.key`) and the known ones.
"""
from __future__ import annotations

from typing import Mapping

from ml_collections import ConfigDict


def resolve(defaults: Mapping, given: Mapping | None = None, owner: str = "options") -> ConfigDict:
    """`defaults` overridden by `given` (a dict, a ConfigDict or None), as an unlocked ConfigDict."""
    given = dict(given.items()) if given is not None else {}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(f'{owner}.{k}' for k in unknown)}; "
                         f"{owner} has {', '.join(sorted(defaults)) or 'no options'}")
    return ConfigDict({**dict(defaults), **given})
