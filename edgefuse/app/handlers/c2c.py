"""The ClientApp's Cache-to-Cache handlers: Flower records in and out, the work in edgefuse.c2c.peer.

Message types (the config and this client's adapter travel as in ``evaluate``):

- ``query.fusers``: install the fusers of this receiver's pairs (and its several-sharers
  gate) after checking them against this client's model version; refused otherwise.
- ``query.share``: prefill (``kind="kv"``) or answer (``kind="text"``, T2T) the queries and
  seal the results for one peer; ``query.refine`` is the Co-C2C variant that first fuses the
  peer's relayed cache.
- ``query.answer``: open the relayed payloads, fuse, score / decode, reply per query.

Device secrets: the X25519 private key lives in ``context.state`` (Flower's per-node state)
and never leaves; peers get its public key through the server (``query.info``). Installed
fusers live in ``context.state`` too, so they survive between messages.
"""

from __future__ import annotations

import json

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from edgefuse.lora import get_adapter_state
from edgefuse.models import load_tokenizer
from edgefuse.transport.crypto import KeyPair, derive_session
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, KVSpec, kv_spec_from_config
from edgefuse.c2c.peer import (open_payloads, pack_frames, refine_prefill, share_answers, share_prefill,
                         unpack_frames, answer_queries)
from edgefuse.eval.queries import Query
from edgefuse.c2c.registry import (FuserCard, FuserRegistry, FuserVersionError, ModelVersion,
                             adapter_hash, check_received, unpack_state)

KEY_RECORD = "c2c_key"
_TOKENIZERS: dict = {}
_T2T: dict = {}  # (model, adapter hash, qid, max_new_tokens) -> (text frame plaintext pieces)


def keypair(context: Context) -> KeyPair:
    """This node's X25519 key pair, created on first use and kept in ``context.state``."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives import serialization

    if KEY_RECORD in context.state.config_records:
        return KeyPair(X25519PrivateKey.from_private_bytes(bytes(context.state[KEY_RECORD]["private"])))
    private = X25519PrivateKey.generate()
    raw = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    context.state[KEY_RECORD] = ConfigRecord({"private": raw})
    return KeyPair(private)


def tokenizer(cfg, name: str):
    """A peer model's tokenizer (for aligning its tokens), cached per process."""
    key = (name, str(cfg.paths.cache_dir))
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(name, root=cfg.paths.cache_dir)
    return _TOKENIZERS[key]


def my_version(client) -> ModelVersion:
    """This client's model version: spec name + hash of the adapter now applied."""
    return ModelVersion(str(client.entry.model), adapter_hash(get_adapter_state(client.slot["peft"])))


def _queries(conf) -> list[Query]:
    return [Query.from_dict(d) for d in json.loads(str(conf["queries"]))]


SEALED_RECORD = "c2c_sealed_sessions"


class SessionReuseError(ValueError):
    """The server asked this node to seal again under a session it already sealed under:
    the AES-GCM nonces (per-direction counters from 0) would repeat under the same key."""


def _session(context: Context, conf, initiator: bool):
    """The session this node seals under for ``conf``'s peer and session id. Each (peer key,
    session id, direction) seals once per node: a repeat is refused (:class:`SessionReuseError`)
    rather than reusing nonces, whatever the server asks."""
    peer, sid = bytes(conf["peer_public_key"]), str(conf["session_id"])
    tag = f"{peer.hex()}:{sid}:{int(initiator)}"
    used = list(context.state[SEALED_RECORD]["tags"]) if SEALED_RECORD in context.state.config_records else []
    if tag in used:
        raise SessionReuseError(f"session {sid[:8]}… was already used to seal payloads for this peer; "
                                "refusing to reuse its nonces")
    context.state[SEALED_RECORD] = ConfigRecord({"tags": used + [tag]})
    return derive_session(keypair(context), peer, bytes.fromhex(sid), initiator=initiator)


def _frames_record(frames: list[bytes]) -> tuple[ArrayRecord, list[int]]:
    flat, lengths = pack_frames(frames)
    return ArrayRecord({"frames": Array(flat)}), lengths


def _frames_in(msg: Message, name: str = "frames") -> list[bytes]:
    conf = msg.content["c2c"]
    return unpack_frames(msg.content[name]["frames"].numpy(), list(conf[f"{name}_lengths"]))


# ----------------------------------------------------------------------------- fusers
def install_fusers(msg: Message, context: Context, client) -> dict:
    """Check every fuser in ``msg`` (records ``fuser.<sharer>``), then store them all and the
    gate; one refusal stores nothing.

    Per fuser: its card parses and is self-consistent, it was trained for this receiver's
    spec and adapter, the KV shapes are this model's, and (:func:`edgefuse.c2c.registry.check_received`)
    it carries a registry save record, is for the sharer the message names, its config
    hashes and its weights digest to what the card says.

    Raises:
        FuserVersionError: a fuser trained for another receiver spec or adapter, or KV shapes
            that are not this model's; as :class:`~edgefuse.c2c.registry.FuserIntegrityError`, a
            card without a registry save record (unknown source), a card for another sharer,
            or a config / state that does not match its card (tampered).
    """
    me = my_version(client)
    conf = msg.content["c2c"]
    mine = kv_spec_from_config(client.slot["peft"].config)
    checked = []
    for sharer in list(conf["sharers"]):
        meta = json.loads(str(conf[f"meta.{sharer}"]))
        card = FuserCard.from_json(meta["card"])
        FuserRegistry.check_compatible(card.version, card.version.sharer, me)
        if KVSpec.from_dict(meta["receiver_kv"]) != mine:
            raise FuserVersionError(f"fuser {card.version_id} was built for KV shapes "
                                    f"{meta['receiver_kv']}, this model has {mine.to_dict()}")
        arrays = {k: v.numpy() for k, v in msg.content[f"fuser.{sharer}"].items()}
        check_received(card, unpack_state(arrays, meta["index"]), meta["config"], str(sharer))
        checked.append((sharer, meta))
    for sharer, meta in checked:  # all or nothing: store only once every fuser passed
        context.state[f"fuser.{sharer}"] = msg.content[f"fuser.{sharer}"]
        context.state[f"fusermeta.{sharer}"] = ConfigRecord({"meta": json.dumps(meta)})
    installed = [s for s, _ in checked]
    if "gate" in msg.content.array_records:
        context.state["gate"] = msg.content["gate"]
        context.state["gatemeta"] = ConfigRecord({"meta": str(conf["gate_meta"])})
    return {"installed": installed, "version": me}


def load_fuser(context: Context, client, sharer: str) -> tuple[C2CFuser, FuserCard]:
    """Rebuild an installed fuser; refused if this client's adapter changed since, or if the
    stored fuser no longer matches its card (checked again, as at install).

    Raises:
        FuserVersionError: no fuser installed for ``sharer``, or a version mismatch;
            :class:`~edgefuse.c2c.registry.FuserIntegrityError` for a stored fuser that fails
            :func:`edgefuse.c2c.registry.check_received`.
    """
    if f"fuser.{sharer}" not in context.state.array_records:
        raise FuserVersionError(f"no fuser installed for sharer {sharer!r}: the server must send "
                                "query.fusers first")
    meta = json.loads(str(context.state[f"fusermeta.{sharer}"]["meta"]))
    card = FuserCard.from_json(meta["card"])
    FuserRegistry.check_compatible(card.version, card.version.sharer, my_version(client))
    arrays = {k: v.numpy() for k, v in context.state[f"fuser.{sharer}"].items()}
    state = unpack_state(arrays, meta["index"])
    check_received(card, state, meta["config"], sharer)
    fuser = C2CFuser(kv_spec_from_config(client.slot["peft"].config),
                     KVSpec.from_dict(meta["sharer_kv"]), FuserConfig.from_dict(meta["config"]))
    fuser.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    fuser.eval()
    return fuser, card


def load_gate(context: Context, client, sharers: list[str]):
    """The installed several-sharers gate for exactly ``sharers`` (in order), else ``None``."""
    from edgefuse.c2c.multi import MultiSharerGate

    if "gate" not in context.state.array_records:
        return None
    meta = json.loads(str(context.state["gatemeta"]["meta"]))
    if list(meta["sharers"]) != list(sharers):
        return None
    gate = MultiSharerGate(kv_spec_from_config(client.slot["peft"].config), len(sharers),
                           **meta.get("kwargs", {}))
    arrays = {k: v.numpy() for k, v in context.state["gate"].items()}
    gate.load_state_dict({k: torch.from_numpy(v) for k, v in unpack_state(arrays, meta["index"]).items()})
    gate.eval()
    return gate


# ----------------------------------------------------------------------------- roles
def share(msg: Message, context: Context, client) -> RecordDict:
    """Sharer (kv) or T2T sharer (text): seal one payload per query for the peer."""
    conf = msg.content["c2c"]
    cfg, ev = client.cfg, client.cfg.c2c.eval
    queries = _queries(conf)
    session = _session(context, conf, initiator=True)
    me = my_version(client)
    model, tok = client.slot["peft"], client.slot["tok"]
    if str(conf["kind"]) == "kv":
        frames, ms = share_prefill(session, model, tok, me, queries,
                                   tokenizer(cfg, str(conf["peer_model"])), int(ev.max_prompt_tokens))
    else:
        frames, ms = _t2t_cached(session, model, tok, me, queries, int(ev.max_prompt_tokens),
                                 int(ev.max_new_tokens))
    record, lengths = _frames_record(frames)
    return RecordDict({"frames": record,
                       "c2c": ConfigRecord({"frames_lengths": lengths, "ms": [float(x) for x in ms]})})


def _t2t_cached(session, model, tok, me, queries, max_prompt, max_new):
    """T2T answers are the same for every receiver: generate each once per process, seal
    per receiver (the generation time is reported each time)."""

    todo = [q for q in queries if (me, q.qid, max_new) not in _T2T]
    if todo:
        plain = _PlainSession()
        frames, ms = share_answers(plain, model, tok, me, todo, max_prompt, max_new)
        for q, f, t in zip(todo, frames, ms):
            _T2T[(me, q.qid, max_new)] = (f, t)
    out, times = [], []
    for q in queries:
        plaintext, t = _T2T[(me, q.qid, max_new)]
        out.append(session.seal(plaintext))
        times.append(t)
    return out, times


class _PlainSession:
    """Stands in for a session to capture plaintexts (sealed later per receiver)."""

    @staticmethod
    def seal(plaintext: bytes) -> bytes:
        return plaintext


def refine(msg: Message, context: Context, client) -> RecordDict:
    """Co-C2C refiner: fuse the partner's cache into ours, seal the refined cache back."""
    conf = msg.content["c2c"]
    ev = client.cfg.c2c.eval
    partner = str(conf["peer_model"])
    fuser, card = load_fuser(context, client, partner)
    session = _session(context, conf, initiator=False)  # the partner initiated
    frames, ms = refine_prefill(session, session, client.slot["peft"], client.slot["tok"],
                                my_version(client), _queries(conf), _frames_in(msg), fuser,
                                tokenizer(client.cfg, partner), card.version.sharer,
                                int(ev.max_prompt_tokens))
    record, lengths = _frames_record(frames)
    return RecordDict({"frames": record,
                       "c2c": ConfigRecord({"frames_lengths": lengths, "ms": [float(x) for x in ms]})})


def answer(msg: Message, context: Context, client) -> RecordDict:
    """Receiver: answer the queries in ``mode`` (alone, t2t, c2c, co_c2c, multi)."""
    conf = msg.content["c2c"]
    ev = client.cfg.c2c.eval
    queries = _queries(conf)
    mode = str(conf["mode"])
    sharers, hints, gate = [], None, None
    names = list(conf["sharers"]) if "sharers" in conf else []
    for i, name in enumerate(names):
        session = derive_session(keypair(context), bytes(conf[f"peer_public_key.{i}"]),
                                 bytes.fromhex(str(conf[f"session_id.{i}"])),
                                 initiator=f"initiator.{i}" in conf)  # co_c2c: we started it
        frames = unpack_frames(msg.content[f"frames.{i}"]["frames"].numpy(),
                               list(conf[f"frames.{i}_lengths"]))
        if mode == "t2t":
            payloads = open_payloads(session, frames, queries, "text")
            hints = {p.qid: p.body.decode("utf-8", errors="replace") for p in payloads}
            continue
        fuser, card = load_fuser(context, client, name)
        payloads = open_payloads(session, frames, queries, "kv", card.version.sharer)
        sharers.append({"fuser": fuser, "tok": tokenizer(client.cfg, name), "payloads": payloads})
    if mode == "multi":
        gate = load_gate(context, client, names)
    rows = answer_queries(client.slot["peft"], client.slot["tok"], queries, sharers=sharers,
                          gate=gate, hints=hints, max_prompt_tokens=int(ev.max_prompt_tokens),
                          max_new_tokens=int(ev.max_new_tokens))
    return RecordDict({"c2c": ConfigRecord({"results": json.dumps(rows),
                                            "gate": "trained" if gate is not None else "none"})})


def reply(msg: Message, content: RecordDict, seconds: float) -> Message:
    content["metrics"] = MetricRecord({"seconds": seconds})
    return Message(content, reply_to=msg)


__all__ = ["keypair", "install_fusers", "load_fuser", "load_gate", "share", "refine", "answer",
           "reply", "my_version", "tokenizer"]
