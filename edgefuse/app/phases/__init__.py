"""Server phases: what the ServerApp runs around and after the federated rounds, in order.

Each phase is one module with one :class:`~edgefuse.app.phases.base.Phase` subclass (its
``name`` is the results section it owns; ``enabled``, ``check``, ``start``, ``after_round``,
``run``: see :mod:`edgefuse.app.phases.base`). :data:`PHASES` lists them in run order.
**Adding a phase is one new module and one line in** :data:`PHASES`; nothing else changes
(the ServerApp, the compose-time checks and the results recorder take it from there).

Each phase's settings are checked by the layer that uses them (``check_config`` in
:mod:`edgefuse.c2c.hub`, :mod:`edgefuse.cloud.decoding`, :mod:`edgefuse.attacks.probe`,
called by each phase's ``check``); :func:`compose` is :func:`edgefuse.config.compose` plus
those checks, so a bad value fails before any round.
"""

from __future__ import annotations

from omegaconf import DictConfig

from edgefuse.app.phases.base import Phase, PhaseContext
from edgefuse.app.phases.c2c import C2C
from edgefuse.app.phases.decoding import Decoding
from edgefuse.app.phases.privacy import Privacy
from edgefuse.config import compose as compose_core
from edgefuse.models import get_spec

PHASES: list[type[Phase]] = [
    C2C,       # fusers after the rounds (or every round), then every receiver in every mode
    Decoding,  # the cloud service: edge, cloud, speculative and fused decoding
    Privacy,   # the privacy probe next to the run's live outbound audit
]


def active(cfg: DictConfig) -> list[Phase]:
    """A fresh instance of every phase of :data:`PHASES` that ``cfg`` enables, in order."""
    return [phase for phase in (cls() for cls in PHASES) if phase.enabled(cfg)]


def check(cfg: DictConfig) -> None:
    """Run the config check of every enabled phase.

    Every client's model name is resolved first, so an unknown name is reported as such
    rather than as a phase setting that names a model the federation lacks.

    Raises:
        edgefuse.models.ModelSpecError: a client's model name is unknown.
        edgefuse.config.ConfigError: the first bad value found.
    """
    for c in cfg.federation.clients:
        get_spec(str(c.model))
    for phase in active(cfg):
        phase.check(cfg)


def compose(experiment: str = "default", overrides: str | list[str] = "") -> DictConfig:
    """:func:`edgefuse.config.compose`, then :func:`check`.

    Raises:
        edgefuse.config.ConfigError: the config cannot be composed or a value is unusable.
    """
    cfg = compose_core(experiment, overrides)
    check(cfg)
    return cfg


__all__ = ["PHASES", "Phase", "PhaseContext", "active", "check", "compose"]
