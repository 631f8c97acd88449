"""Per-base-model LoRA federation: build round messages, check replies, aggregate.

Shaped like a Flower strategy (configure/aggregate for train and evaluate), but
clients of different base models never mix: each model is its own group with its own
global adapter. The math lives in :mod:`edgefuse.aggregation`; this class only routes
arrays between Flower messages and those functions, and records what happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import WARNING

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from omegaconf import DictConfig, OmegaConf

from edgefuse.aggregation import (ClientUpdate, GroupResult, MalformedUpdateError,
                                  aggregate_group, flexlora, module_shapes, validate_update)
from edgefuse.app import messages as M
from edgefuse.transport.crypto import PUBLIC_KEY_BYTES
from edgefuse.app.messages import group_fields, last_line
from edgefuse.config import to_json
from edgefuse.lora import adapter_nbytes, pack_adapter, unpack_adapter


class NoClientSucceeded(RuntimeError):
    """A round in which no client returned a usable update: the run cannot go on."""


class TokenizerMismatchError(RuntimeError):
    """Two clients of one base model report different tokenizers: the run cannot go on
    (C2C aligns a peer's tokens with that model's tokenizer, and the server trains fusers on
    its own copy of the model, so token ids must mean the same strings on every client)."""


@dataclass
class NodeInfo:
    node_id: int
    partition_id: int
    model: str
    lora_rank: int
    public_key: bytes = b""  # the node's X25519 C2C prekey for this run (edgefuse.c2c.handshake)
    tokenizer: str = ""  # fingerprint of the vocabulary (edgefuse.cloud.target.tokenizer_fingerprint)
    identity_key: bytes = b""  # its Ed25519 identity, as it says: devices check it against their pins
    prekey_signature: bytes = b""  # the identity's signature of the prekey (devices check it)


@dataclass
class GroupedLoRA:
    """Server state of a federated LoRA run: one global adapter per base-model group."""

    cfg: DictConfig
    nodes: dict[int, NodeInfo] = field(default_factory=dict)
    groups: dict[str, GroupResult] = field(default_factory=dict)
    shapes: dict[str, dict] = field(default_factory=dict)  # model -> module (out, in) shapes

    def __post_init__(self):
        self.cfg_json = to_json(self.cfg)
        bound = OmegaConf.select(self.cfg, "privacy.max_update_norm", default=None)
        self.max_update_norm = None if bound is None else float(bound)

    # -- messages -----------------------------------------------------------------
    def content(self, round_idx: int, state: dict | None,
                node: NodeInfo | None = None) -> tuple[RecordDict, int]:
        """Message content: the config, and the packed adapter when ``state`` is given;
        plus the adapter's payload bytes (arrays + index).

        With ``node``, the message's group (``adapter_model``, ``adapter_rank``: the node's
        model and rank, :func:`edgefuse.app.messages.group_fields`) travels too, adapter or
        not: the client refuses a message, and an adapter, of another group."""
        config = {"cfg": self.cfg_json, "round": round_idx}
        if node is not None:
            config.update(group_fields(node))
        content = RecordDict()
        nbytes = 0
        if state is not None:
            arrays, index = pack_adapter(state)
            content["adapter"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
            config["adapter_index"] = index
            nbytes = adapter_nbytes(arrays) + len(index.encode())
        content["config"] = ConfigRecord(config)
        return content, nbytes

    def info_messages(self, node_ids) -> list[Message]:
        """``query.info`` to nodes not yet identified."""
        content, _ = self.content(0, None)
        return [Message(content, dst_node_id=n, message_type=M.query_type(M.INFO))
                for n in node_ids if n not in self.nodes]

    def add_info(self, replies) -> list[str]:
        """Record node identities from ``query.info`` replies; return the reasons of the
        replies refused. The server knows what each partition runs (``federation.clients``),
        so a node is recorded only when its partition id is in range and not claimed by
        another node, its model and LoRA rank are that entry's, and its public key (C2C
        prekey), identity key and prekey signature have X25519 / Ed25519 sizes (devices, not
        the server, decide whether to trust them); anything else (a malformed reply included) is refused, and the node is
        asked again next round.

        Raises:
            TokenizerMismatchError: a node reports a tokenizer fingerprint (``tokenizer``)
                other than the one an already recorded node of the same model reported; in
                round 1 this stops the run before any training.
        """
        errors = []
        clients = self.cfg.federation.clients
        for msg in replies:
            node_id = msg.metadata.src_node_id
            if msg.has_error():
                errors.append(f"node {node_id}: {msg.error.reason}")
                continue
            try:
                rec = msg.content["info"]
                pid, model, rank = int(rec["partition_id"]), str(rec["model"]), int(rec["lora_rank"])
                key = bytes(rec["public_key"]) if "public_key" in rec else b""
                tok = str(rec["tokenizer"]) if "tokenizer" in rec else ""
                ident = bytes(rec["identity_key"]) if "identity_key" in rec else b""
                sig = bytes(rec["prekey_signature"]) if "prekey_signature" in rec else b""
            except (KeyError, TypeError, ValueError) as e:
                errors.append(f"node {node_id}: malformed query.info reply ({type(e).__name__}: {e})")
                continue
            taken = {n.partition_id: nid for nid, n in self.nodes.items()}
            if not 0 <= pid < len(clients):
                reason = f"partition id {pid} is not in federation.clients (0..{len(clients) - 1})"
            elif taken.get(pid, node_id) != node_id:
                reason = f"partition id {pid} is already node {taken[pid]}'s"
            elif (model, rank) != (str(clients[pid].model), int(clients[pid].lora_rank)):
                reason = (f"claims {model} rank {rank}, but partition {pid} runs "
                          f"{clients[pid].model} rank {clients[pid].lora_rank}")
            elif key and len(key) != PUBLIC_KEY_BYTES:
                reason = f"public key of {len(key)} bytes (X25519 keys are {PUBLIC_KEY_BYTES})"
            elif ident and len(ident) != PUBLIC_KEY_BYTES or sig and len(sig) != 64:
                reason = (f"identity key of {len(ident)} bytes or prekey signature of {len(sig)} "
                          f"bytes (Ed25519: {PUBLIC_KEY_BYTES} and 64)")
            else:
                self._check_tokenizer(node_id, pid, model, tok)
                self.nodes[node_id] = NodeInfo(node_id, pid, model, rank, key, tok, ident, sig)
                continue
            errors.append(f"node {node_id}: query.info refused: {reason}")
        return errors

    def _check_tokenizer(self, node_id: int, pid: int, model: str, tok: str) -> None:
        """Raise :class:`TokenizerMismatchError` if a recorded node of ``model`` reported
        another tokenizer fingerprint than ``tok`` (nodes that report none are not compared)."""
        for other in self.nodes.values():
            if other.model == model and tok and other.tokenizer and other.tokenizer != tok:
                raise TokenizerMismatchError(
                    f"partition {pid} (node {node_id}) runs {model} with tokenizer {tok}, "
                    f"partition {other.partition_id} (node {other.node_id}) with tokenizer "
                    f"{other.tokenizer}: clients of one base model must have identical "
                    "tokenizers (check each device's model files); the run stops here")

    def client_state(self, node: NodeInfo) -> dict | None:
        """The adapter this client starts the round from (None before the group's first
        aggregation: the client uses its seeded initial adapter)."""
        group = self.groups.get(node.model)
        if group is None:
            return None
        if node.partition_id in group.per_client:
            return group.per_client[node.partition_id]
        if node.lora_rank == group.global_rank:
            return group.global_state
        if node.lora_rank > group.global_rank:
            log(WARNING, "partition %d (rank %d) missed the aggregation and exceeds the "
                        "global rank %d: it restarts from its initial adapter",
                        node.partition_id, node.lora_rank, group.global_rank)
            return None
        # A client that missed the last aggregation: re-factor the global to its rank.
        upd = ClientUpdate(-1, node.model, group.global_rank, group.global_alpha, 1,
                           group.global_state)
        states, _ = flexlora([upd], [node.lora_rank], [float(self.cfg.training.lora_alpha)])
        return states[0]

    def configure(self, round_idx: int, message_type: str) -> tuple[list[Message], dict[int, int]]:
        """One message per identified node, each with its own adapter; and bytes per node."""
        msgs, nbytes = [], {}
        for node in self.nodes.values():
            content, nbytes[node.node_id] = self.content(round_idx, self.client_state(node), node)
            msgs.append(Message(content, dst_node_id=node.node_id, message_type=message_type))
        return msgs, nbytes

    # -- replies ------------------------------------------------------------------
    def _row(self, node: NodeInfo) -> dict:
        return {"partition_id": node.partition_id, "model": node.model,
                "lora_rank": node.lora_rank, "train_loss": None, "eval_loss": None,
                "eval_ppl": None, "base_eval_loss": None, "base_eval_ppl": None,
                "bytes_up": 0, "bytes_down": 0, "seconds": 0.0, "num_examples": 0, "weight_examples": 0,
                "status": "failed", "reason": "no reply"}

    def aggregate_train(self, round_idx: int, replies, sent_bytes: dict[int, int]) -> tuple[list[dict], list[dict]]:
        """Check every train reply, aggregate each model group, update the globals.

        Returns:
            ``(client rows, group rows)`` for results.json.

        Raises:
            NoClientSucceeded: not one reply in the round was usable.
        """
        rows = {n.node_id: self._row(n) for n in self.nodes.values()}
        for nid, b in sent_bytes.items():
            rows[nid]["bytes_down"] = b
        updates: dict[str, list[ClientUpdate]] = {}
        for msg in replies:
            nid = msg.metadata.src_node_id
            if nid not in rows:
                continue
            row, node = rows[nid], self.nodes[nid]
            if msg.has_error():
                row["reason"] = f"client error: {last_line(msg.error.reason)}"
                log(WARNING, "round %d: partition %d failed: %s", round_idx, node.partition_id,
                            msg.error.reason)
                continue
            try:
                upd, metrics, nbytes = self._parse_update(msg, node)
                row.update(bytes_up=nbytes, train_loss=float(metrics["train_loss"]),
                           seconds=float(metrics["seconds"]),
                           num_examples=int(metrics["num_examples"]), weight_examples=upd.num_examples,
                           train_seconds=float(metrics.get("train_seconds", 0.0)),
                           load_seconds=float(metrics.get("load_seconds", 0.0)))
                validate_update(upd, node.model, self.shapes.get(node.model),
                                max_norm=self.max_update_norm,
                                reference=self.client_state(node))  # what it was sent this round
            except (MalformedUpdateError, KeyError, TypeError, ValueError) as e:
                row.update(status="rejected", reason=str(e))
                log(WARNING, "round %d: rejected the update of partition %d: %s", round_idx,
                            node.partition_id, e)
                continue
            row.update(status="ok", reason=None)
            updates.setdefault(node.model, []).append(upd)
        if not updates:
            reasons = "; ".join(f"p{r['partition_id']}: {r['reason']}" for r in rows.values())
            raise NoClientSucceeded(f"round {round_idx}: no client returned a usable update ({reasons})")
        group_rows = []
        rows_by_pid = {r["partition_id"]: r for r in rows.values()}
        for model, ups in updates.items():
            ups.sort(key=lambda u: u.partition_id)  # reply order must not change the float sums
            if model not in self.shapes:
                ups = self._first_shapes(model, ups, rows_by_pid)
                if not ups:
                    continue
            t0 = time.perf_counter()
            self.shapes.setdefault(model, module_shapes(ups[0].state))
            t = self.cfg.training
            robust = str(t.get("robust", "none"))
            result = aggregate_group(ups, method=str(t.hetero_rank),
                                     max_norm=self.max_update_norm,
                                     equal_rank=str(t.get("equal_rank", "fedavg")),
                                     robust=robust, trim_fraction=float(t.get("trim_fraction", 0.25)))
            if robust == "trimmed_mean" and result.info["trimmed_per_end"] == 0:
                log(WARNING, "round %d: %s: the trimmed mean of %d update(s) at trim_fraction %g "
                            "cuts nothing (the plain unweighted mean)", round_idx, model, len(ups),
                    float(t.get("trim_fraction", 0.25)))
            self.groups[model] = result
            group_rows.append({"model": model, "clients": sorted(u.partition_id for u in ups),
                               "method": result.info.get("method"),
                               "robust": result.info.get("robust"),
                               "trimmed_per_end": result.info.get("trimmed_per_end"),
                               "truncation_error": result.info.get("truncation_error"),
                               "clipped": result.info.get("clipped"),
                               "aggregate_seconds": time.perf_counter() - t0,
                               "global_rank": result.global_rank, "adapter_dir": None})
        if not group_rows:
            raise NoClientSucceeded(f"round {round_idx}: no update had its model's module shapes")
        return sorted(rows.values(), key=lambda r: r["partition_id"]), group_rows

    def config_shapes(self, model: str) -> dict[str, tuple[int, int]] | None:
        """``(out, in)`` per LoRA module of ``model`` from its config alone
        (:func:`edgefuse.lora.expected_shapes`), or ``None`` when the config cannot be read here."""
        import torch

        from edgefuse.config import lora_targets
        from edgefuse.lora import expected_shapes
        from edgefuse.models import ModelFetchError, ModelSpecError, model_config

        try:
            with torch.random.fork_rng(devices=[]):  # a tiny spec's config seeds torch
                return expected_shapes(model_config(model, self.cfg.paths.cache_dir),
                                       lora_targets(self.cfg, model))
        except (ModelSpecError, ModelFetchError, OSError, ValueError) as e:
            log(WARNING, "no reference LoRA shapes for %s from its config: %s", model, e)
            return None

    def _first_shapes(self, model: str, ups: list[ClientUpdate], rows_by_pid: dict[int, dict]) -> list[ClientUpdate]:
        """A group's first aggregation: its updates must agree on the module shapes (they set
        the reference for every later round). When they do not, the shapes the model's config
        gives decide (without a readable config: the lowest partition-id's); the others are
        rejected, and the round goes on."""
        shapes = [module_shapes(u.state) for u in ups]
        if all(sh == shapes[0] for sh in shapes):
            return ups
        ref = self.config_shapes(model) or shapes[0]
        keep = []
        for u, sh in zip(ups, shapes):
            if sh == ref:
                keep.append(u)
                continue
            rows_by_pid[u.partition_id].update(
                status="rejected", reason=f"client {u.partition_id}: module shapes differ from {model}'s "
                                          "(its config, or the group's first client)")
            log(WARNING, "rejected the update of partition %d: its module shapes are not %s's",
                u.partition_id, model)
        return keep

    def _parse_update(self, msg: Message, node: NodeInfo):
        meta, metrics = msg.content["meta"], msg.content["metrics"]
        if int(meta["partition_id"]) != node.partition_id:
            raise MalformedUpdateError(
                f"reply claims partition {meta['partition_id']}, node is partition {node.partition_id}")
        arrays = {k: v.numpy() for k, v in msg.content["adapter"].items()}
        index = str(meta["adapter_index"])
        state = unpack_adapter(arrays, index)
        alpha = float(self.cfg.training.lora_alpha)
        if float(meta["lora_alpha"]) != alpha:
            raise MalformedUpdateError(f"lora_alpha {meta['lora_alpha']} differs from the configured {alpha:g}")
        # The FedAvg weight: what the client says, at most what a round can train on (a client
        # claiming 1e9 examples must not own the average).
        seen = int(self.cfg.training.steps_per_round) * int(self.cfg.training.batch_size)
        upd = ClientUpdate(node.partition_id, str(meta["model"]), int(meta["lora_rank"]), alpha,
                           min(int(metrics["num_examples"]), seen), state)
        if upd.rank != node.lora_rank:
            raise MalformedUpdateError(f"rank {upd.rank} differs from the configured {node.lora_rank}")
        return upd, metrics, adapter_nbytes(arrays) + len(index.encode())

    def aggregate_evaluate(self, rows: list[dict], replies, sent_bytes: dict[int, int]) -> None:
        """Fill eval metrics into the round's client rows (in place)."""
        by_pid = {r["partition_id"]: r for r in rows}
        for nid, b in sent_bytes.items():
            by_pid[self.nodes[nid].partition_id]["bytes_down"] += b
        for msg in replies:
            node = self.nodes.get(msg.metadata.src_node_id)
            if node is None:
                continue
            row = by_pid[node.partition_id]
            if msg.has_error():
                log(WARNING, "evaluate: partition %d failed: %s", node.partition_id, msg.error.reason)
                row["eval_error"] = last_line(msg.error.reason)
                continue
            m = msg.content["metrics"]
            row.update(eval_loss=float(m["eval_loss"]), eval_ppl=float(m["eval_ppl"]),
                       base_eval_loss=float(m["base_eval_loss"]),
                       base_eval_ppl=float(m["base_eval_ppl"]),
                       eval_seconds=float(m["seconds"]))
