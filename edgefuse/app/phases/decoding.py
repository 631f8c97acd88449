"""The ServerApp's cloud-decoding phase: start the cloud LLM service, let a device decode
through it in every mode, score the modes side by side, stop the service.

The server only orchestrates: the device (the lowest partition-id running
``cloud.device_model``, with its federated LoRA) opens its own encrypted link to the service
(:mod:`edgefuse.cloud.link`), so the prompts' tokens and the decoding traffic never pass through
Flower. The evaluation prompts are public (GSM8K test, held-out public Dolly rows).
"""

from __future__ import annotations

import json
import time
from logging import INFO, WARNING

from flwr.app import ConfigRecord
from flwr.common.logger import log

from edgefuse.app import messages as M
from edgefuse.app.phases.base import Phase, PhaseContext
from edgefuse.app.strategy import GroupedLoRA, NodeInfo
from edgefuse.cloud.decoding import DecodeResult, check_config
from edgefuse.cloud.decoding.config import SPLIT_MODES
from edgefuse.cloud.devices import Record, summarize, table
from edgefuse.config import ConfigError
from edgefuse.eval.queries import dolly_eval_queries, load_gsm8k
from edgefuse.transport.wan import WanProfile


class DecodingError(RuntimeError):
    """The decoding phase cannot run: no connected client runs ``cloud.device_model``."""


def load_queries(cfg) -> list:
    """``cloud.eval.gsm8k_n`` GSM8K test questions and ``cloud.eval.dolly_per_category``
    rows per category of the public split's evaluation slice (:func:`edgefuse.eval.splits.public_slices`),
    the same rows the C2C phase scores."""
    ev = cfg.cloud.eval
    out = []
    if int(ev.gsm8k_n) > 0:
        out += load_gsm8k(cfg.data.mirror, int(ev.gsm8k_n), int(cfg.seed))
    if int(ev.dolly_per_category) > 0:
        out += dolly_eval_queries(cfg.data, int(cfg.seed), int(ev.dolly_per_category))
    return out


def check_pair(cfg) -> None:
    """Refuse a device/cloud pair whose tokenizers differ (before any model is loaded).

    Raises :class:`ConfigError` naming both models: fusion and verification exchange token
    ids, and a string-level vocabulary mapping is not implemented."""
    from edgefuse.cloud.target import tokenizer_fingerprint
    from edgefuse.models import load_tokenizer

    dev, tgt = str(cfg.cloud.device_model), str(cfg.cloud.model)
    root = cfg.paths.cache_dir
    if tokenizer_fingerprint(load_tokenizer(dev, root)) != tokenizer_fingerprint(load_tokenizer(tgt, root)):
        raise ConfigError(f"cloud.device_model {dev!r} and cloud.model {tgt!r} do not share a "
                          "tokenizer; speculative decoding and logit fusion need one vocabulary "
                          "(e.g. qwen2.5-coder-0.5b with qwen2.5-coder-1.5b)")


def device_node(cfg, strategy: GroupedLoRA) -> NodeInfo:
    """The lowest partition-id running ``cloud.device_model``; raises :class:`DecodingError`."""
    nodes = [n for n in strategy.nodes.values() if n.model == str(cfg.cloud.device_model)]
    if not nodes:
        raise DecodingError(f"no connected client runs cloud.device_model {cfg.cloud.device_model!r}")
    return min(nodes, key=lambda n: n.partition_id)


class Decoding(Phase):
    """The cloud-decoding phase (results sections ``decoding``, ``decoding_records`` and
    ``summary.cloud_service``)."""

    name = "decoding"

    def enabled(self, cfg) -> bool:
        return bool(cfg.get("cloud") and cfg.cloud.enabled)

    def check(self, cfg) -> None:
        """:func:`edgefuse.cloud.decoding.check_config`."""
        check_config(cfg)

    def start(self, ctx: PhaseContext) -> None:
        """:func:`check_pair`: refuse a pair without a shared tokenizer before any round."""
        check_pair(ctx.cfg)

    def run(self, ctx: PhaseContext) -> dict:
        """Start the service, have the device decode every prompt in every mode, stop it.

        Returns ``{"decoding": rows, "decoding_records": records, "summary": {"cloud_service":
        facts}}``. Raises :class:`DecodingError` (no device client) or
        :class:`~edgefuse.app.messages.NodeError` (the device failed); the service is stopped
        in all cases."""
        from edgefuse.app.device import keys_root
        from edgefuse.cloud.service import (default_service_keys, service_limits,
                                            start_service_process, stop_service_process)

        cfg, out = ctx.cfg, ctx.out
        c = cfg.cloud
        node = device_node(cfg, ctx.strategy)
        queries = load_queries(cfg)
        svc = c.service
        t0 = time.perf_counter()
        identity_path, authorized_path = default_service_keys(keys_root())  # the operator's keys
        log(INFO, "cloud: starting the service with %s (log: %s)", c.model, out / "cloud_service.log")
        proc, port = start_service_process(
            str(c.model), str(c.host), int(c.port), max_batch=int(svc.max_batch),
            max_wait_ms=float(svc.max_wait_ms), max_sessions=int(svc.max_sessions),
            threads=int(svc.threads), max_context=int(svc.max_context),
            log_path=out / "cloud_service.log", timeout_s=float(svc.start_timeout_s),
            cache_dir=cfg.paths.cache_dir, identity_path=identity_path,
            authorized_path=authorized_path, **service_limits(svc),
            split_policy=svc.get("split") if set(map(str, c.modes)) & set(SPLIT_MODES) else None)
        started = time.perf_counter() - t0
        try:
            log(INFO, "cloud: partition %d (%s) decodes %d prompts in %d modes with %d sessions over %s",
                node.partition_id, node.model, len(queries), len(c.modes), int(c.devices), c.wan)
            reply = ctx.ask(node, M.query_type(M.DECODE), {"cloud": ConfigRecord({
                "host": str(c.host), "port": int(port),
                "queries": json.dumps([q.to_dict() for q in queries])})})
            raw, wall = reply.json("decoding", "records"), reply.json("decoding", "wall")
            rec = reply["decoding"]
            protection = str(rec["protection"]) if "protection" in rec else "off"
            runtime = reply.json("decoding", "runtime") if "runtime" in rec else {}
            runtime = runtime if isinstance(runtime, dict) else {}  # what the device reports
            health = _health(str(c.host), int(port), proc.health_token)
        finally:
            code = stop_service_process(proc)
            if code not in (0, None):
                log(WARNING, "cloud: the service exited with code %s (see %s)", code, out / "cloud_service.log")
        records = [Record(r["qid"], r["kind"], r["mode"], r["device"], DecodeResult.from_dict(r), r["reference"]) for r in raw]
        from edgefuse.models import load_tokenizer

        tok = load_tokenizer(str(c.device_model), cfg.paths.cache_dir)
        rows = summarize(records, wall, tok, WanProfile.from_name(str(c.wan)).rtt_ms, int(c.devices),
                         greedy=float(c.decode.temperature) == 0)
        log(INFO, "cloud decoding (%s, %d sessions):\n%s", c.wan, int(c.devices), table(rows))
        service = {"model": str(c.model), "start_seconds": started, "port": int(port),
                   "prompt_protection": protection, "device_runtime": runtime,
                   **{k: health.get(k) for k in ("sessions_total", "batches", "jobs",
                                                 "mean_batch_size", "max_batch_size",
                                                 "frames_rejected", "bytes_in", "bytes_out")}}
        return {"decoding": rows, "decoding_records": raw, "summary": {"cloud_service": service}}


def _health(host: str, port: int, token: str | None) -> dict:
    """The service's counters (batching, sessions, bytes; ``token``: its health token),
    ``{}`` if it does not answer."""
    from edgefuse.cloud.link import CloudUnavailable, cloud_health

    try:
        return cloud_health(host, port, timeout_s=10.0, token=token)
    except (CloudUnavailable, OSError, ValueError) as e:
        log(WARNING, "cloud: no health answer before shutdown: %s", e)
        return {}
