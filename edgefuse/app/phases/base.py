"""The shape every server phase has (:class:`Phase`) and what it works with (:class:`PhaseContext`).

The ServerApp (:func:`edgefuse.app.server_app.main`) makes one instance of each phase of
:data:`edgefuse.app.phases.PHASES` per run and, for those ``enabled``:

1. ``start(ctx)`` before round 1 (refuse what would fail later, build long-lived state);
2. ``after_round(ctx, r)`` after every round's training and evaluation;
3. after the last round, in list order, ``run(ctx)``.

``after_round`` and ``run`` return results sections (``{section: value}``; ``summary`` is
merged into the summary), which the ServerApp hands to
:meth:`edgefuse.results.RunRecorder.update` and saves at once, so a later failure keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from omegaconf import DictConfig

from edgefuse.app.messages import NodeError, Reply, ask, ask_many
from edgefuse.app.strategy import GroupedLoRA, NodeInfo
from edgefuse.results import RunRecorder


@dataclass
class PhaseContext:
    """One run's state as the phases see it (built by the ServerApp once the config is composed).

    Attributes:
        cfg: the composed, checked config.
        grid: Flower's Grid, wrapped by :class:`edgefuse.app.phases.privacy.AuditTally` (its
            ``totals`` are the run's outbound-payload audit so far).
        strategy: the federation's state (nodes, per-group global adapters).
        out: the run's output folder.
        timeout: seconds to wait for a node's reply (``federation.round_timeout_s``).
        recorder: the run's results (read them; phases return sections rather than write).
        last_round: ``federation.num_rounds``.
        round: the round the federation is in (after the rounds: the last one).
        node_ids: the SuperNodes connected before round 1.
    """

    cfg: DictConfig
    grid: Any
    strategy: GroupedLoRA
    out: Path
    timeout: float
    recorder: RunRecorder
    last_round: int
    round: int = 0
    node_ids: list[int] = field(default_factory=list)

    @property
    def audit(self) -> dict:
        """``{payload type: {"payloads", "bytes", "canary_hits", "hit_kinds"}}`` summed over
        every reply so far (see :class:`~edgefuse.app.phases.privacy.AuditTally`)."""
        return self.grid.totals

    def ask(self, node: NodeInfo, message_type: str, records: Mapping | None = None) -> Reply:
        """:func:`edgefuse.app.messages.ask` with this run's grid, strategy, timeout and round."""
        return ask(self.grid, self.strategy, node, message_type, records,
                   timeout=self.timeout, round_idx=self.round)

    def ask_many(self, nodes, message_type: str, records: Mapping | None = None) -> list[Reply | NodeError]:
        """:func:`edgefuse.app.messages.ask_many` with this run's grid, strategy, timeout and round."""
        return ask_many(self.grid, self.strategy, nodes, message_type, records,
                        timeout=self.timeout, round_idx=self.round)


class Phase:
    """One server phase. A subclass sets ``name`` and defines ``enabled`` and ``run``;
    ``check``, ``start`` and ``after_round`` are optional (no-ops here).

    Class attributes:
        name: the results section the phase owns; its key in ``summary.phase_seconds``.
        seconds_key: the key of the last round's ``seconds`` its ``run`` time goes under
            (``None``: ``name``).
        after_round_key: the key of a round's ``seconds`` its ``after_round`` time goes under
            when that round's ``after_round`` returned sections (``None``: ``name``).
    """

    name: ClassVar[str]
    seconds_key: ClassVar[str | None] = None
    after_round_key: ClassVar[str | None] = None

    def enabled(self, cfg: DictConfig) -> bool:
        """Whether this run has the phase (its config section's ``enabled``)."""
        raise NotImplementedError

    def check(self, cfg: DictConfig) -> None:
        """Check the phase's settings at compose time (called only when ``enabled``).

        Raises:
            edgefuse.config.ConfigError: an unusable value.
        """

    def start(self, ctx: PhaseContext) -> None:
        """Before round 1 (before the nodes are awaited)."""

    def after_round(self, ctx: PhaseContext, round_idx: int) -> Mapping[str, Any]:
        """After round ``round_idx`` was aggregated, evaluated and saved; returns sections."""
        return {}

    def run(self, ctx: PhaseContext) -> Mapping[str, Any]:
        """After the last round; returns the phase's results sections."""
        raise NotImplementedError
