"""edgefuse ClientApp: one edge SLM with its LoRA adapter and private data partition.

Message types (the ServerApp sends the resolved config in every message, and in every one
but ``query.info`` the adapter group it is addressed to: ``adapter_model`` /
``adapter_rank``, checked against this node's federation entry before anything is loaded or
applied, :func:`edgefuse.app.messages.check_group`; a mismatch is an error reply; then
against this device's privacy floor, :func:`edgefuse.app.device.check_floor`: the server
may tighten, never loosen, and a violation is an error reply before anything runs):
- ``query.info``: reply with this node's partition-id, model, LoRA rank and tokenizer
  fingerprint (the tokenizer is loaded, not the model).
- ``train``: load the round's adapter for this client (none in round 1: a seeded init),
  train ``training.steps_per_round`` steps, reply with the packed adapter + metrics.
- ``evaluate``: load the group's global adapter, reply with held-out loss/perplexity next
  to the base model's.
- ``query.fusers`` / ``query.share`` / ``query.refine`` / ``query.answer`` /
  ``query.forget``: Cache-to-Cache (see :mod:`edgefuse.app.handlers.c2c`).
- ``query.decode``: decode prompts with the cloud LLM service in every mode
  (see :mod:`edgefuse.app.handlers.decoding`).
- ``query.privacy``: run the privacy probe (see :mod:`edgefuse.app.handlers.privacy`).

Every reply passes the outbound audit (:func:`edgefuse.privacy.audit.flower_mod`) before
Flower sends it; the cloud link and C2C relays report to the same audit.
"""

from __future__ import annotations

import time
import warnings

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edgefuse.app.handlers import c2c, decoding as cloud_decode, privacy
from edgefuse.app.handlers.local import LocalClient
from edgefuse.app import messages as M
from edgefuse.app.messages import check_group
from edgefuse.app.device import check_floor
from edgefuse.cloud.target import tokenizer_fingerprint
from edgefuse.config import client_entry, from_json
from edgefuse.privacy.audit import flower_mod, watch_canaries
from edgefuse.runtime import DeviceProfile
from edgefuse.lora import (MalformedUpdateError, adapter_nbytes, check_received_adapter,
                           set_adapter_state, unpack_adapter)

# peft calls a transformers property that transformers 5 deprecated; nothing to act on.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

app = ClientApp(mods=[flower_mod])


def _client(msg: Message, context: Context) -> LocalClient:
    """This node's client for ``msg``, once the message's group is this node's.

    Raises:
        GroupMismatchError: the message names another adapter group (model, rank) than this
            node's federation entry, or none; nothing is loaded or applied.
        FloorViolation: the message's config is looser than this device's privacy floor
            (:func:`edgefuse.app.device.check_floor`); nothing is loaded, run or sent.
        edgefuse.runtime.ProfileError: a device profile this node cannot run or a misspelt
            ``device-*`` node config key (:meth:`edgefuse.runtime.DeviceProfile.check`).
    """
    conf = msg.content["config"]
    cfg, partition_id = from_json(str(conf["cfg"])), int(context.node_config["partition-id"])
    entry = client_entry(cfg, partition_id)
    check_group(conf, str(entry.model), int(entry.lora_rank), msg.metadata.message_type)
    check_floor(cfg, entry, context.node_config, msg.metadata.message_type)  # before anything runs
    DeviceProfile.of(entry, context.node_config).check()  # a runtime this device cannot run: refused now
    client = LocalClient.load(cfg, partition_id, int(context.node_config["num-partitions"]))
    watch_canaries(client.cfg, client.slot["tok"])
    return client


def _load_adapter(client: LocalClient, msg: Message) -> int:
    """Apply the adapter carried by ``msg`` (if any); return its payload bytes.

    The adapter is checked before use (:func:`edgefuse.lora.check_received_adapter`): its
    group (``adapter_model`` / ``adapter_rank`` in the config, when the server sends them) is
    this client's, the wire index is well formed, values are finite, and module set, shapes
    and rank match this client's LoRA modules. On any failure nothing is applied (the model
    keeps its previous adapter) and ``MalformedUpdateError`` ("adapter from the server
    refused: ...") propagates, so Flower replies with an error whose reason says why.
    """
    if "adapter" not in msg.content.array_records:
        client.reset_adapter()
        return 0
    conf = msg.content["config"]
    arrays = {k: v.numpy() for k, v in msg.content["adapter"].items()}
    index = str(conf["adapter_index"])
    try:
        state = unpack_adapter(arrays, index)
    except MalformedUpdateError as e:
        raise MalformedUpdateError(f"adapter from the server refused: {e}") from None
    me = client.identity()
    check_received_adapter(
        state, client.slot["init"], model=me["model"], rank=me["lora_rank"],
        alpha=me["lora_alpha"],
        claimed_model=str(conf["adapter_model"]) if "adapter_model" in conf else None,
        claimed_rank=int(conf["adapter_rank"]) if "adapter_rank" in conf else None)
    set_adapter_state(client.slot["peft"], state)
    return adapter_nbytes(arrays) + len(index.encode())


@app.query(M.INFO)
def info(msg: Message, context: Context) -> Message:
    """Tell the server who this node is: partition-id, model, LoRA rank, its tokenizer's
    fingerprint (clients of one model must agree; empty when the tokenizer cannot be loaded,
    whose error the train reply then reports) and, with C2C enabled, its signed prekey for
    the run (``public_key``, ``identity_key``, ``prekey_signature``:
    :func:`edgefuse.app.handlers.c2c.signed_prekey`; the private part stays in
    ``context.state``)."""
    cfg = from_json(str(msg.content["config"]["cfg"]))
    entry = client_entry(cfg, int(context.node_config["partition-id"]))
    try:
        fingerprint = tokenizer_fingerprint(c2c.tokenizer(cfg, str(entry.model)))
    except Exception:  # noqa: BLE001 - an unloadable model fails (and is reported) in train
        fingerprint = ""
    reply = ConfigRecord({"partition_id": int(context.node_config["partition-id"]),
                          "model": str(entry.model), "lora_rank": int(entry.lora_rank),
                          "tokenizer": fingerprint,
                          **(c2c.signed_prekey(context) if cfg.get("c2c") and cfg.c2c.enabled else {})})
    return Message(RecordDict({"info": reply}), reply_to=msg)


@app.query(M.FORGET)
def forget(msg: Message, context: Context) -> Message:
    """Drop this run's C2C prekey (the server sends this when its C2C phase ends)."""
    return Message(RecordDict({"c2c": ConfigRecord({"forgot": c2c.forget_prekey(context)})}),
                   reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the local LoRA adapter for one round and send it back packed."""
    t0 = time.perf_counter()
    client = _client(msg, context)
    bytes_down = _load_adapter(client, msg)
    stats = client.train(round_idx=int(msg.content["config"]["round"]))
    arrays, index = client.packed_adapter()
    meta = ConfigRecord({**client.identity(), "adapter_index": index})
    metrics = MetricRecord({
        "train_loss": stats["train_loss"], "first_loss": stats["first_loss"],
        "last_loss": stats["last_loss"], "num_examples": client.num_train_examples,
        "train_seconds": stats["seconds"], "load_seconds": client.load_seconds,
        "seconds": time.perf_counter() - t0, "bytes_down": bytes_down,
    })
    content = RecordDict({"adapter": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "meta": meta, "metrics": metrics})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Held-out loss with this client's global adapter and with the base model."""
    t0 = time.perf_counter()
    client = _client(msg, context)
    bytes_down = _load_adapter(client, msg)
    base = client.base_eval(context)
    ev = client.evaluate()
    metrics = MetricRecord({
        "eval_loss": ev["loss"], "eval_ppl": ev["ppl"], "base_eval_loss": base["loss"],
        "base_eval_ppl": base["ppl"], "eval_tokens": ev["tokens"],
        "num_eval_examples": ev["examples"], "bytes_down": bytes_down,
        "seconds": time.perf_counter() - t0,
    })
    return Message(RecordDict({"meta": ConfigRecord(client.identity()), "metrics": metrics}),
                   reply_to=msg)


def _c2c(msg: Message, context: Context, handler) -> Message:
    t0 = time.perf_counter()
    client = _client(msg, context)
    _load_adapter(client, msg)
    return c2c.reply(msg, handler(msg, context, client), time.perf_counter() - t0)


@app.query(M.FUSERS)
def fusers(msg: Message, context: Context) -> Message:
    """Install this receiver's fusers after checking their versions (refused on mismatch)."""
    def install(msg, context, client):
        done = c2c.install_fusers(msg, context, client)
        return RecordDict({"c2c": ConfigRecord({"installed": done["installed"],
                                                "adapter_hash": done["version"].adapter_hash})})
    return _c2c(msg, context, install)


@app.query(M.SHARE)
def share(msg: Message, context: Context) -> Message:
    """Prefill (KV) or answer (T2T text) the queries, sealed for one peer."""
    return _c2c(msg, context, c2c.share)


@app.query(M.REFINE)
def refine(msg: Message, context: Context) -> Message:
    """Co-C2C: fuse the peer's relayed cache into ours and seal the refined cache back."""
    return _c2c(msg, context, c2c.refine)


@app.query(M.ANSWER)
def answer(msg: Message, context: Context) -> Message:
    """Answer the queries alone, with T2T hints, or from fused caches."""
    return _c2c(msg, context, c2c.answer)


@app.query(M.DECODE)
def decode(msg: Message, context: Context) -> Message:
    """Decode the prompts through the cloud service (edge, cloud, speculative, fusion)."""
    return _c2c(msg, context, cloud_decode.decode)


@app.query(M.PRIVACY)
def privacy_probe(msg: Message, context: Context) -> Message:
    """Run the privacy probe on this device's model and reply with its figures."""
    return _c2c(msg, context, privacy.probe)
