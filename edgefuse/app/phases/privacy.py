"""The ServerApp's privacy phase, and the tally of every device's outbound-payload audit.

:class:`AuditTally` wraps the Grid: every reply a ClientApp sends carries a
``privacy_audit`` record (added by :func:`edgefuse.privacy.audit.flower_mod`, counting that
handler's outbound payloads — the reply itself, cloud frames and C2C relays — and their
canary hits); the tally sums them over the run. :func:`run` asks one device to run the
privacy probe and returns the rows of ``results.json`` ``privacy``.
"""

from __future__ import annotations

import json
import time
from logging import INFO

from flwr.app import Message
from flwr.common.logger import log

from edgefuse.privacy.audit import merge
from edgefuse.app.strategy import GroupedLoRA, NodeInfo, last_line


class PrivacyError(RuntimeError):
    """The privacy phase failed (the device's reason is in the message)."""


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
    """The device that runs the probe: the cloud's device client when the cloud phase is on,
    else the lowest partition-id. Raises :class:`PrivacyError` when no node is known."""
    nodes = list(strategy.nodes.values())
    if cfg.get("cloud") and cfg.cloud.enabled:
        nodes = [n for n in nodes if n.model == str(cfg.cloud.device_model)] or nodes
    if not nodes:
        raise PrivacyError("no connected client to run the privacy probe")
    return min(nodes, key=lambda n: n.partition_id)


def run(cfg, grid, strategy: GroupedLoRA, timeout: float, round_idx: int, audit: dict) -> dict:
    """Run the probe on one device; returns ``{"rows", "layers", "audit", "summary"}``.

    Raises :class:`PrivacyError` when the device fails or does not answer."""
    node = probe_node(cfg, strategy)
    content, _ = strategy.content(round_idx, strategy.client_state(node), node)
    log(INFO, "privacy: partition %d (%s) runs the probe (%d canary prompts, protections %s)",
        node.partition_id, node.model, int(cfg.privacy.probe.canaries), list(cfg.privacy.probe.modes))
    t0 = time.perf_counter()
    replies = list(grid.send_and_receive([Message(content, dst_node_id=node.node_id,
                                                  message_type="query.privacy")], timeout=timeout))
    if not replies:
        raise PrivacyError(f"partition {node.partition_id} did not answer query.privacy")
    if replies[0].has_error():
        raise PrivacyError(f"partition {node.partition_id} query.privacy: {last_line(replies[0].error.reason)}")
    rec = replies[0].content["privacy"]
    rows = json.loads(str(rec["rows"]))
    hits_on = sum(r["canary_hits"] for r in rows if r["protection"] in ("redact", "both"))
    summary = {"probe_partition": node.partition_id, "probe_model": node.model,
               "probe_seconds": time.perf_counter() - t0,
               "stage_seconds": json.loads(str(rec["seconds"])),
               "rephrase_fallbacks": json.loads(str(rec["fallbacks"])),
               "canary_hits_with_redaction": hits_on,
               "ner_recall": json.loads(str(rec["ner_recall"])),
               "live_canary_hits": sum(v.get("canary_hits", 0) for v in audit.values())}
    log(INFO, "privacy: %d canary hits with redaction on (probe), %d in the run's live traffic",
        hits_on, summary["live_canary_hits"])
    return {"rows": rows, "layers": json.loads(str(rec["layers"])), "audit": audit, "summary": summary}
