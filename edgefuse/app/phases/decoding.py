"""The ServerApp's cloud-decoding phase: start the cloud LLM service, let a device decode
through it in every mode, score the modes side by side, stop the service.

The server only orchestrates: each device (per model of the federation, its lowest
partition-id, with its federated LoRA; ``cloud.device_model`` names one model instead of
``all``) opens its own encrypted link to the service
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
    """The decoding phase cannot run: no connected client runs a ``cloud.device_model``."""


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


def device_models(cfg) -> list[str]:
    """The federation models that decode with the cloud: every distinct one for
    ``cloud.device_model: all``, else the one it names (in federation order)."""
    models = list(dict.fromkeys(str(c.model) for c in cfg.federation.clients))
    want = str(cfg.cloud.device_model)
    return models if want == "all" else [m for m in models if m == want]


def check_vocabularies(cfg) -> None:
    """Refuse, before any round, a device model whose tokenizer cannot meet the cloud's on
    bytes (:class:`~edgefuse.cloud.crossvocab.CrossVocab`); the tokenizers load alone (no
    weights). A client model whose tokenizer does not load is left to fail in its own round
    (the run goes on without it). Raises :class:`ConfigError` naming the model."""
    from edgefuse.cloud.crossvocab import CrossVocab, VocabError
    from edgefuse.cloud.target import tokenizer_fingerprint
    from edgefuse.models import ModelFetchError, ModelSpecError, load_tokenizer

    root = cfg.paths.cache_dir
    cloud_tok = load_tokenizer(str(cfg.cloud.model), root)
    for name in device_models(cfg):
        try:
            tok = load_tokenizer(name, root)
        except (ModelSpecError, ModelFetchError, OSError) as exc:
            log(WARNING, "cloud: %s has no tokenizer to check (%s); it will not decode", name, exc)
            continue
        if tokenizer_fingerprint(tok) == tokenizer_fingerprint(cloud_tok):
            continue
        try:
            CrossVocab(tok, cloud_tok)
        except VocabError as exc:
            raise ConfigError(f"cloud.device_model: {name!r} cannot decode with {cfg.cloud.model!r} "
                              f"across tokenizers: {exc}") from None


def device_nodes(cfg, strategy: GroupedLoRA) -> list[NodeInfo]:
    """Per model of :func:`device_models`, its lowest partition-id client (connected ones
    only); raises :class:`DecodingError` when none is connected."""
    out = []
    for model in device_models(cfg):
        nodes = [n for n in strategy.nodes.values() if n.model == model]
        if nodes:
            out.append(min(nodes, key=lambda n: n.partition_id))
    if not out:
        raise DecodingError(f"no connected client runs cloud.device_model {cfg.cloud.device_model!r}")
    return out


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
        """:func:`check_vocabularies`: refuse a device the cloud cannot decode with, before any round."""
        check_vocabularies(ctx.cfg)

    def run(self, ctx: PhaseContext) -> dict:
        """Start the service, have one client of each device model decode every prompt in
        every mode (all of them at once, so their sessions share the service's batches),
        stop it.

        Returns ``{"decoding": rows, "decoding_records": records, "summary": {"cloud_service":
        facts}}``; a device that fails is logged and named in ``cloud_service.failed``, the
        others' rows kept. Raises :class:`DecodingError` (no device client) or
        :class:`~edgefuse.app.messages.NodeError` (every device failed); the service is
        stopped in all cases."""
        from edgefuse.app.device import keys_root
        from edgefuse.cloud.service import (default_service_keys, service_limits,
                                            start_service_process, stop_service_process)

        cfg, out = ctx.cfg, ctx.out
        c = cfg.cloud
        nodes = device_nodes(cfg, ctx.strategy)
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
            split_policy=svc.get("split") if set(map(str, c.modes)) & set(SPLIT_MODES) else None,
            backend=str(c.get("backend", "embedded")),
            vllm_python=c.vllm.python if c.get("vllm") else None, vllm_url=c.vllm.url if c.get("vllm") else None,
            vllm_args=[str(a) for a in c.vllm.args] if c.get("vllm") else None)
        started = time.perf_counter() - t0
        try:
            for node in nodes:
                log(INFO, "cloud: partition %d (%s) decodes %d prompts in %d modes with %d sessions over %s",
                    node.partition_id, node.model, len(queries), len(c.modes), int(c.devices), c.wan)
            replies = ctx.ask_many(nodes, M.query_type(M.DECODE), {"cloud": ConfigRecord({
                "host": str(c.host), "port": int(port),
                "queries": json.dumps([q.to_dict() for q in queries])})})
            health = _health(str(c.host), int(port), proc.health_token)
        finally:
            code = stop_service_process(proc)
            if code not in (0, None):
                log(WARNING, "cloud: the service exited with code %s (see %s)", code, out / "cloud_service.log")
        from edgefuse.models import load_tokenizer

        cloud_tok = load_tokenizer(str(c.model), cfg.paths.cache_dir)
        rows, raw_all, failed, devices = [], [], {}, {}
        for node, reply in zip(nodes, replies):
            if isinstance(reply, M.NodeError):
                log(WARNING, "cloud: %s", reply)
                failed[node.model] = str(reply)
                continue
            raw, wall = reply.json("decoding", "records"), reply.json("decoding", "wall")
            rec = reply["decoding"]
            runtime = reply.json("decoding", "runtime") if "runtime" in rec else {}
            devices[node.model] = {
                "partition_id": node.partition_id,
                "prompt_protection": str(rec["protection"]) if "protection" in rec else "off",
                "tokenizer": str(rec["tokenizer"]) if "tokenizer" in rec else "same",
                "device_runtime": runtime if isinstance(runtime, dict) else {}}  # what the device reports
            for r in raw:
                r["device_model"] = node.model
            records = [Record(r["qid"], r["kind"], r["mode"], r["device"], DecodeResult.from_dict(r),
                              r["reference"]) for r in raw]
            tok = load_tokenizer(node.model, cfg.paths.cache_dir)
            mine = summarize(records, wall, tok, WanProfile.from_name(str(c.wan)).rtt_ms, int(c.devices),
                             greedy=float(c.decode.temperature) == 0, device_model=node.model,
                             cloud_tok=cloud_tok)
            log(INFO, "cloud decoding, %s (%s, %d sessions):\n%s", node.model, c.wan, int(c.devices), table(mine))
            rows += mine
            raw_all += raw
        if not devices:
            raise next(r for r in replies if isinstance(r, M.NodeError))
        first = next(iter(devices.values()))
        service = {"model": str(c.model), "start_seconds": started, "port": int(port),
                   "prompt_protection": first["prompt_protection"], "device_runtime": first["device_runtime"],
                   "devices": devices, "failed": failed,
                   **{k: health.get(k) for k in ("sessions_total", "batches", "jobs",
                                                 "mean_batch_size", "max_batch_size",
                                                 "frames_rejected", "bytes_in", "bytes_out")}}
        return {"decoding": rows, "decoding_records": raw_all, "summary": {"cloud_service": service}}


def _health(host: str, port: int, token: str | None) -> dict:
    """The service's counters (batching, sessions, bytes; ``token``: its health token),
    ``{}`` if it does not answer."""
    from edgefuse.cloud.link import CloudUnavailable, cloud_health

    try:
        return cloud_health(host, port, timeout_s=10.0, token=token)
    except (CloudUnavailable, OSError, ValueError) as e:
        log(WARNING, "cloud: no health answer before shutdown: %s", e)
        return {}
