"""The ServerApp's privacy phase, and the tally of every device's outbound-payload audit.

:class:`AuditTally` wraps the Grid: every reply a ClientApp sends carries a
``privacy_audit`` record (added by :func:`edgefuse.privacy.audit.flower_mod`, counting that
handler's outbound payloads — the reply itself, cloud frames and C2C relays — and their
canary hits); the tally sums them over the run. :class:`Privacy` asks one device to run the
privacy probe and returns the sections ``privacy``, ``privacy_layers``, ``privacy_audit`` and
``summary.privacy`` of ``results.json``.
"""

from __future__ import annotations

import json
import time
from logging import INFO

from flwr.common.logger import log

from edgefuse.app import messages as M
from edgefuse.app.phases.base import Phase, PhaseContext
from edgefuse.app.strategy import GroupedLoRA, NodeInfo
from edgefuse.attacks.probe import check_config
from edgefuse.privacy.audit import merge


class PrivacyError(RuntimeError):
    """The privacy phase cannot run: no connected client to run the probe."""


class AuditTally:
    """A Grid proxy that sums the ``privacy_audit`` records of all replies.

    ``totals``: ``{payload type: {"payloads", "bytes", "canary_hits", "hit_kinds"}}``."""

    def __init__(self, grid):
        self._grid = grid
        self.totals: dict[str, dict] = {}

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *args, **kwargs):
        replies = list(self._grid.send_and_receive(messages, *args, **kwargs))
        snaps = []
        for r in replies:
            if r.has_content() and "privacy_audit" in r.content.config_records:
                snaps.append(json.loads(str(r.content["privacy_audit"]["stats"])))
        if snaps:
            self.totals = merge([self.totals, *snaps])
        return replies


def probe_node(cfg, strategy: GroupedLoRA) -> NodeInfo:
    """The device that runs the probe: the lowest partition-id among the cloud's device
    clients (``cloud.device_model``; ``all``: every client) when the cloud phase is on, else
    among all. Raises :class:`PrivacyError` when no node is known."""
    nodes = list(strategy.nodes.values())
    if cfg.get("cloud") and cfg.cloud.enabled:
        nodes = [n for n in nodes if n.model == str(cfg.cloud.device_model)] or nodes
    if not nodes:
        raise PrivacyError("no connected client to run the privacy probe")
    return min(nodes, key=lambda n: n.partition_id)


class Privacy(Phase):
    """The privacy phase: the probe on one device, next to the run's live outbound audit."""

    name = "privacy"

    def enabled(self, cfg) -> bool:
        return bool(cfg.get("privacy") and cfg.privacy.enabled)

    def check(self, cfg) -> None:
        """:func:`edgefuse.attacks.probe.check_config`."""
        check_config(cfg)

    def run(self, ctx: PhaseContext) -> dict:
        """Run the probe on :func:`probe_node`; returns ``{"privacy": rows, "privacy_layers":
        per-layer attack figures, "privacy_audit": the run's audit totals, "summary":
        {"privacy": facts}}``.

        Raises :class:`PrivacyError` (no node) or :class:`~edgefuse.app.messages.NodeError`
        (the device failed or did not answer)."""
        cfg = ctx.cfg
        node = probe_node(cfg, ctx.strategy)
        log(INFO, "privacy: partition %d (%s) runs the probe (%d canary prompts, protections %s)",
            node.partition_id, node.model, int(cfg.privacy.probe.canaries), list(cfg.privacy.probe.modes))
        audit = ctx.audit  # the live traffic's, before the probe's own reply
        t0 = time.perf_counter()
        reply = ctx.ask(node, M.query_type(M.PRIVACY))
        rows = reply.json("privacy", "rows")
        hits_on = sum(r["canary_hits"] for r in rows if r["protection"] in ("redact", "both"))
        summary = {"probe_partition": node.partition_id, "probe_model": node.model,
                   "probe_seconds": time.perf_counter() - t0,
                   "stage_seconds": reply.json("privacy", "seconds"),
                   "rephrase_fallbacks": reply.json("privacy", "fallbacks"),
                   "canary_hits_with_redaction": hits_on,
                   "ner_recall": reply.json("privacy", "ner_recall"),
                   **{k: reply.json("privacy", k) if k in reply["privacy"] else None
                      for k in ("ner_recall_by_kind", "hits_by_kind")},  # absent from older clients
                   "live_canary_hits": sum(v.get("canary_hits", 0) for v in audit.values())}
        log(INFO, "privacy: %d canary hits with redaction on (probe), %d in the run's live traffic",
            hits_on, summary["live_canary_hits"])
        return {"privacy": rows, "privacy_layers": reply.json("privacy", "layers"),
                "privacy_audit": audit, "summary": {"privacy": summary}}
