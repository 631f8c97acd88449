"""Server-side phases that run after the federated rounds, and the config checks they own.

Each phase's settings are checked by the layer that uses them (``check_config`` in
:mod:`edgefuse.c2c.hub`, :mod:`edgefuse.cloud.decoding.decoder`, :mod:`edgefuse.attacks.probe`);
:func:`compose` is :func:`edgefuse.config.compose` plus those checks, so a bad value fails
before any round.
"""

from __future__ import annotations

from omegaconf import DictConfig

from edgefuse.attacks.probe import check_config as check_privacy_probe
from edgefuse.c2c.hub import check_config as check_c2c
from edgefuse.cloud.decoding.decoder import check_config as check_cloud
from edgefuse.config import compose as compose_core

CHECKS = (check_c2c, check_cloud, check_privacy_probe)


def check(cfg: DictConfig) -> None:
    """Run every phase's config check.

    Raises:
        edgefuse.config.ConfigError: the first bad value found.
    """
    for fn in CHECKS:
        fn(cfg)


def compose(experiment: str = "default", overrides: str | list[str] = "") -> DictConfig:
    """:func:`edgefuse.config.compose`, then :func:`check`.

    Raises:
        edgefuse.config.ConfigError: the config cannot be composed or a value is unusable.
    """
    cfg = compose_core(experiment, overrides)
    check(cfg)
    return cfg
