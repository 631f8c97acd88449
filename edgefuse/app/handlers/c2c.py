"""The ClientApp's Cache-to-Cache handlers: Flower records in and out, the work in edgefuse.c2c.peer.

Message types (the config and this client's adapter travel as in ``evaluate``):

- ``query.fusers``: install the fusers of this receiver's pairs (and its several-sharers
  gate) after checking them against this client's model version; refused otherwise.
- ``query.share``: prefill (``kind="kv"``) or answer (``kind="text"``, T2T) the queries and
  seal the results for one peer; ``query.refine`` is the Co-C2C variant that first fuses the
  peer's relayed cache.
- ``query.answer``: open the relayed payloads, fuse, score / decode, reply per query.

Keys (:mod:`edgefuse.c2c.handshake`, the signed-prekey idea of Signal's X3DH simplified to
one signed ephemeral per side): the device's Ed25519 identity and its trust store come from
its own folder (:class:`edgefuse.app.device.DeviceHome`), never from the server. Its X25519
*prekey* for the run lives in ``context.state`` only (Flower's per-node state, in the
SuperNode's memory; never written to disk), signed by the identity for this run id and sent
to the server in ``query.info``. It is rotated per run (a run id other than the one it was
made for makes a new one) and its private part dropped by ``query.forget``, which the server
sends when its C2C phase ends (at the latest it goes with the process). A sharer seals each
exchange under a fresh ephemeral key whose private part it drops at once; a receiver opens
each exchange once (:class:`ReplayedExchangeError`). A key that is not the pinned one, or a
signature that does not verify, is refused with
:class:`~edgefuse.transport.identity.UntrustedPeerError` before anything is opened or sealed.
Installed fusers live in ``context.state`` too, so they survive between messages.
"""

from __future__ import annotations

import json

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from edgefuse.app.device import DeviceHome
from edgefuse.app.messages import FUSER_CONTROLS, fuser_key, fuser_meta_key
from edgefuse.lora import get_adapter_state
from edgefuse.models import load_tokenizer
from edgefuse.transport.crypto import HandshakeError, KeyPair
from edgefuse.transport.identity import UntrustedPeerError, device_name, fingerprint
from edgefuse.c2c.handshake import Handshake, PeerPrekey, open_from, seal_for, sign_prekey
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, KVSpec, kv_spec_from_config
from edgefuse.c2c.peer import (CONTROL_OF_MODE, open_payloads, pack_frames, refine_prefill, share_answers, share_prefill,
                         unpack_frames, answer_queries)
from edgefuse.eval.queries import Query
from edgefuse.c2c.registry import (FuserCard, FuserRegistry, FuserVersionError, ModelVersion,
                             adapter_hash, check_received, unpack_state)

PREKEY_RECORD = "c2c_prekey"
_TOKENIZERS: dict = {}
_T2T: dict = {}  # (model, adapter hash, qid, max_new_tokens) -> (text frame plaintext pieces)
MAX_SESSION_ID_HEX = 510  # 255 bytes


def own_name(context: Context) -> str:
    """This node's trust-store name, ``device-<partition-id>`` (from its own node config)."""
    return device_name(int(context.node_config["partition-id"]))


def prekey(context: Context) -> KeyPair:
    """This node's X25519 prekey for the run, kept in ``context.state`` only (never on disk).

    Made on first use in a run and again whenever ``context.run_id`` is not the run it was
    made for (Flower carries a node's state over to the next run of a series): one prekey
    per run (a new one also clears the last run's sealed and opened exchange tags, which
    name old keys). :func:`forget_prekey` drops it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    rec = context.state.config_records.get(PREKEY_RECORD)
    if rec is not None and int(rec["run_id"]) == int(context.run_id):
        return KeyPair(X25519PrivateKey.from_private_bytes(bytes(rec["private"])))
    private = X25519PrivateKey.generate()
    raw = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    context.state[PREKEY_RECORD] = ConfigRecord({"private": raw, "run_id": int(context.run_id)})
    for record in (SEALED_RECORD, OPENED_RECORD):  # they name the last run's keys
        if record in context.state.config_records:
            del context.state[record]
    return KeyPair(private)


def signed_prekey(context: Context) -> dict:
    """What ``query.info`` adds for C2C: ``public_key`` (this run's prekey, 32 bytes),
    ``identity_key`` (this device's Ed25519 identity, 32 bytes) and ``prekey_signature`` (64
    bytes, :func:`edgefuse.c2c.handshake.sign_prekey` for this node's name and run id)."""
    identity = DeviceHome.of(context.node_config).identity()
    public = prekey(context).public_bytes()
    return {"public_key": public, "identity_key": identity.public_bytes(),
            "prekey_signature": sign_prekey(identity, own_name(context), public, context.run_id)}


def forget_prekey(context: Context) -> bool:
    """Drop this run's prekey from ``context.state`` (``query.forget``, at the end of the C2C
    phase): payloads sealed for it can no longer be opened by anyone. Returns whether one
    was held."""
    if PREKEY_RECORD not in context.state.config_records:
        return False
    del context.state[PREKEY_RECORD]
    return True


def _run_prekey(context: Context) -> KeyPair:
    """The prekey payloads for this node were sealed to; refuses to make a new one."""
    rec = context.state.config_records.get(PREKEY_RECORD)
    if rec is None or int(rec["run_id"]) != int(context.run_id):
        raise HandshakeError(f"{own_name(context)} holds no prekey for run {context.run_id} (the C2C "
                             "phase ended, or query.info was not asked this run): cannot open")
    return prekey(context)


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
    """The server asked this node to seal again for a peer under a session id it already
    sealed under for that peer's prekey: refused (one exchange per session id)."""


OPENED_RECORD = "c2c_opened_exchanges"


class ReplayedExchangeError(UntrustedPeerError):
    """The relay handed this node an exchange (a sharer's signed ephemeral key) it already
    opened: a replay of recorded payloads, refused."""


def _bytes(conf, key: str) -> bytes:
    if key not in conf or not isinstance(conf[key], bytes):
        raise UntrustedPeerError(f"the relay sent no {key} (bytes): refusing the exchange")
    return bytes(conf[key])


def _str(conf, key: str, limit: int = 64) -> str:
    if key not in conf or not isinstance(conf[key], str) or not 0 < len(conf[key]) <= limit:
        raise UntrustedPeerError(f"the relay sent no valid {key} (1..{limit} characters)")
    return str(conf[key])


def _session_id(conf, key: str = "session_id") -> bytes:
    sid = _str(conf, key, MAX_SESSION_ID_HEX)
    try:
        return bytes.fromhex(sid)
    except ValueError:
        raise HandshakeError(f"{key} {sid[:16]!r}… is not hex") from None


def _tags(context: Context, record: str) -> list[str]:
    """The exchange tags ``record`` (:data:`SEALED_RECORD` / :data:`OPENED_RECORD`) holds."""
    return list(context.state[record]["tags"]) if record in context.state.config_records else []


def _remember(context: Context, record: str, tag: str) -> None:
    context.state[record] = ConfigRecord({"tags": _tags(context, record) + [tag]})


def _session(context: Context, conf):
    """Sharer: the session this node seals under for ``conf``'s peer (``peer_name``,
    ``peer_identity_key``, ``peer_public_key`` = its prekey, ``peer_prekey_signature``) and
    ``session_id``, checked and made by :func:`edgefuse.c2c.handshake.seal_for`; returns
    ``(session, handshake)``.

    Each (peer, prekey, session id) seals once per node: a repeat is refused
    (:class:`SessionReuseError`), whatever the server asks (the fresh ephemeral key already
    keeps nonces apart; this keeps one exchange per session id).

    Raises:
        UntrustedPeerError: the forwarded identity is not the one pinned for ``peer_name``
            in this device's trust store, or the prekey is not signed by it for this run.
        SessionReuseError: see above.
    """
    home = DeviceHome.of(context.node_config)
    peer = PeerPrekey(_str(conf, "peer_name"), _bytes(conf, "peer_identity_key"),
                      _bytes(conf, "peer_public_key"), _bytes(conf, "peer_prekey_signature"))
    sid = _session_id(conf)
    tag = f"{peer.name}:{peer.prekey.hex()}:{sid.hex()}"
    if tag in _tags(context, SEALED_RECORD):
        raise SessionReuseError(f"session {sid.hex()[:8]}… was already used to seal payloads for "
                                f"{peer.name}; refusing to reuse it")
    session, handshake = seal_for(home.identity(), own_name(context), home.trust(), peer, sid,
                                  context.run_id)
    _remember(context, SEALED_RECORD, tag)
    return session, handshake


def _opened(context: Context, conf, sfx: str = ""):
    """Receiver: the session a sharer's frames are sealed under, after
    :func:`edgefuse.c2c.handshake.open_from` checked its handshake (``peer_name``,
    ``peer_identity_key``, ``ephemeral_key``, ``handshake_signature``, ``session_id``, each
    with the suffix ``sfx``) against this device's own trust store and its run prekey.

    Each exchange (sharer, ephemeral key) opens once per node: a replay is refused.

    Raises:
        UntrustedPeerError: the sharer's identity or signature is not its pinned one's;
            :class:`ReplayedExchangeError`: an exchange this node already opened.
        HandshakeError: no prekey held for this run, or a malformed session id or key.
    """
    home = DeviceHome.of(context.node_config)
    handshake = Handshake(_bytes(conf, f"ephemeral_key{sfx}"), _bytes(conf, f"handshake_signature{sfx}"))
    sharer = _str(conf, f"peer_name{sfx}")
    session = open_from(home.identity(), own_name(context), _run_prekey(context), home.trust(),
                        sharer, _bytes(conf, f"peer_identity_key{sfx}"), handshake,
                        _session_id(conf, f"session_id{sfx}"))
    tag = f"{sharer}:{handshake.ephemeral.hex()}"
    if tag in _tags(context, OPENED_RECORD):
        raise ReplayedExchangeError(f"{sharer!r}: the exchange under ephemeral key "
                                    f"{fingerprint(handshake.ephemeral)} was already opened here: "
                                    "refusing a replay")
    _remember(context, OPENED_RECORD, tag)
    return session


def _handshake_fields(handshake: Handshake) -> dict:
    return {"ephemeral_key": handshake.ephemeral, "handshake_signature": handshake.signature}


def _frames_record(frames: list[bytes]) -> tuple[ArrayRecord, list[int]]:
    flat, lengths = pack_frames(frames)
    return ArrayRecord({"frames": Array(flat)}), lengths


def _frames_in(msg: Message, name: str = "frames") -> list[bytes]:
    conf = msg.content["c2c"]
    return unpack_frames(msg.content[name]["frames"].numpy(), list(conf[f"{name}_lengths"]))


# ----------------------------------------------------------------------------- fusers
def _stored_meta(key: str) -> str:
    """The state record holding the meta of installed fuser ``key`` (``fusermeta.<sharer>[@control]``)."""
    return "fusermeta" + key[len("fuser"):]


def _controls_of(conf, sharer: str) -> list[str]:
    """The control fusers ``query.fusers`` says it carries for ``sharer`` (``controls.<sharer>``,
    absent: none), checked: names of :data:`~edgefuse.app.messages.FUSER_CONTROLS`, each at most once."""
    key = f"controls.{sharer}"
    if key not in conf:
        return []
    got = conf[key]
    names = [str(c) for c in got] if isinstance(got, list) else None
    if (names is None or len(names) > len(FUSER_CONTROLS) or len(set(names)) != len(names)
            or set(names) - set(FUSER_CONTROLS)):
        raise FuserVersionError(f"{key} must list distinct controls among {', '.join(FUSER_CONTROLS)}, "
                                f"got {str(got)[:80]!r}")
    return names


def install_fusers(msg: Message, context: Context, client) -> dict:
    """Check every fuser in ``msg`` (records ``fuser.<sharer>`` and, for the controls that
    ``controls.<sharer>`` lists, ``fuser.<sharer>@<control>``:
    :func:`edgefuse.app.messages.fuser_key`), then store
    them all and the gate; one refusal stores nothing.

    Per fuser: its card parses and is self-consistent, it was trained for this receiver's
    spec and adapter, the KV shapes are this model's, its config's ``sharer_control`` is
    the slot's (``none`` for the real fuser: a control cannot stand in for it, nor the
    reverse), and (:func:`edgefuse.c2c.registry.check_received`) it carries a registry
    save record, is for the sharer the message names, its config hashes and its weights
    digest to what the card says.

    Raises:
        FuserVersionError: a fuser trained for another receiver spec or adapter, KV shapes
            that are not this model's, a control list or a ``sharer_control`` that is not
            the slot's; as :class:`~edgefuse.c2c.registry.FuserIntegrityError`, a
            card without a registry save record (unknown source), a card for another sharer,
            or a config / state that does not match its card (tampered).
    """
    me = my_version(client)
    conf = msg.content["c2c"]
    mine = kv_spec_from_config(client.slot["peft"].config)
    checked = []
    for sharer in list(conf["sharers"]):
        for control in ["none"] + _controls_of(conf, str(sharer)):
            key = fuser_key(str(sharer), control)
            meta = json.loads(str(conf[fuser_meta_key(str(sharer), control)]))
            card = FuserCard.from_json(meta["card"])
            FuserRegistry.check_compatible(card.version, card.version.sharer, me)
            if KVSpec.from_dict(meta["receiver_kv"]) != mine:
                raise FuserVersionError(f"fuser {card.version_id} was built for KV shapes "
                                        f"{meta['receiver_kv']}, this model has {mine.to_dict()}")
            arrays = {k: v.numpy() for k, v in msg.content[key].items()}
            check_received(card, unpack_state(arrays, meta["index"]), meta["config"], str(sharer))
            got = FuserConfig.from_dict(meta["config"]).sharer_control
            if got != control:
                raise FuserVersionError(f"fuser {card.version_id} is a sharer_control={got!r} fuser, "
                                        f"sent as {key!r} (sharer_control={control!r}): refusing it")
            checked.append((key, meta))
    for key, meta in checked:  # all or nothing: store only once every fuser passed
        context.state[key] = msg.content[key]
        context.state[_stored_meta(key)] = ConfigRecord({"meta": json.dumps(meta)})
    installed = [key[len("fuser."):] for key, _ in checked]
    if "gate" in msg.content.array_records:
        context.state["gate"] = msg.content["gate"]
        context.state["gatemeta"] = ConfigRecord({"meta": str(conf["gate_meta"])})
    return {"installed": installed, "version": me}


def load_fuser(context: Context, client, sharer: str, control: str = "none") -> tuple[C2CFuser, FuserCard]:
    """Rebuild an installed fuser (``control``: the pair's real one, ``none``, or its
    ``zero`` / ``shuffled`` control); refused if this client's adapter changed since, or if
    the stored fuser no longer matches its card or slot (checked again, as at install).

    Raises:
        FuserVersionError: no such fuser installed for ``sharer``, or a version mismatch;
            :class:`~edgefuse.c2c.registry.FuserIntegrityError` for a stored fuser that fails
            :func:`edgefuse.c2c.registry.check_received`.
    """
    key = fuser_key(sharer, control)
    if key not in context.state.array_records:
        what = "fuser" if control == "none" else f"{control}-sharer control fuser"
        raise FuserVersionError(f"no {what} installed for sharer {sharer!r}: the server must send "
                                "query.fusers first")
    meta = json.loads(str(context.state[_stored_meta(key)]["meta"]))
    card = FuserCard.from_json(meta["card"])
    FuserRegistry.check_compatible(card.version, card.version.sharer, my_version(client))
    arrays = {k: v.numpy() for k, v in context.state[key].items()}
    state = unpack_state(arrays, meta["index"])
    check_received(card, state, meta["config"], sharer)
    if FuserConfig.from_dict(meta["config"]).sharer_control != control:
        raise FuserVersionError(f"fuser {card.version_id} stored as {key!r} is not a "
                                f"sharer_control={control!r} fuser")
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
    """Sharer (kv) or T2T sharer (text): seal one payload per query for the peer.

    The reply's ``c2c`` record holds the frame lengths, the compute ms and the
    :class:`~edgefuse.c2c.handshake.Handshake` (``ephemeral_key``, ``handshake_signature``)
    the receiver needs; nothing is prefilled if the peer's keys are refused."""
    conf = msg.content["c2c"]
    cfg, ev = client.cfg, client.cfg.c2c.eval
    queries = _queries(conf)
    session, handshake = _session(context, conf)
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
                       "c2c": ConfigRecord({"frames_lengths": lengths, "ms": [float(x) for x in ms],
                                            **_handshake_fields(handshake)})})


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
    """Co-C2C refiner: open the partner's cache (its handshake checked against its pin),
    fuse it into ours, and seal the refined cache back under a fresh handshake of our own
    to the partner's checked prekey (both checks before anything is opened)."""
    conf = msg.content["c2c"]
    ev = client.cfg.c2c.eval
    partner = str(conf["peer_model"])
    fuser, card = load_fuser(context, client, partner)
    incoming = _opened(context, conf)  # the partner sealed its cache for our prekey
    outgoing, handshake = _session(context, conf)
    frames, ms = refine_prefill(incoming, outgoing, client.slot["peft"], client.slot["tok"],
                                my_version(client), _queries(conf), _frames_in(msg), fuser,
                                tokenizer(client.cfg, partner), card.version.sharer,
                                int(ev.max_prompt_tokens))
    record, lengths = _frames_record(frames)
    return RecordDict({"frames": record,
                       "c2c": ConfigRecord({"frames_lengths": lengths, "ms": [float(x) for x in ms],
                                            **_handshake_fields(handshake)})})


ANSWER_MODES = ("alone", "t2t", "c2c", "c2c_zero", "c2c_shuffled", "co_c2c", "multi")


def answer(msg: Message, context: Context, client) -> RecordDict:
    """Receiver: answer the queries in ``mode`` (:data:`ANSWER_MODES`); ``c2c_zero`` and
    ``c2c_shuffled`` fuse the sharer's cache with the pair's control fuser, fed as
    :func:`edgefuse.c2c.peer.answer_queries` says (zeros; another query's cache of this
    message). Queries with a reference also get their response NLL
    (``c2c.eval.nll_max_tokens`` tokens).

    Every sharer's handshake (``peer_name.<i>``, ``ephemeral_key.<i>``, ...) is checked
    before any payload is opened: one refused key opens and fuses nothing.

    Raises:
        ValueError: a mode not in :data:`ANSWER_MODES`."""
    conf = msg.content["c2c"]
    ev = client.cfg.c2c.eval
    queries = _queries(conf)
    mode = str(conf["mode"])
    if mode not in ANSWER_MODES:
        raise ValueError(f"unknown C2C mode {mode[:32]!r}: use one of {', '.join(ANSWER_MODES)}")
    control = CONTROL_OF_MODE.get(mode, "none")
    sharers, hints, gate = [], None, None
    names = list(conf["sharers"]) if "sharers" in conf else []
    sessions = [_opened(context, conf, f".{i}") for i in range(len(names))]
    for i, (name, session) in enumerate(zip(names, sessions)):
        frames = unpack_frames(msg.content[f"frames.{i}"]["frames"].numpy(),
                               list(conf[f"frames.{i}_lengths"]))
        if mode == "t2t":
            payloads = open_payloads(session, frames, queries, "text")
            hints = {p.qid: p.body.decode("utf-8", errors="replace") for p in payloads}
            continue
        fuser, card = load_fuser(context, client, name, control)
        payloads = open_payloads(session, frames, queries, "kv", card.version.sharer)
        sharers.append({"fuser": fuser, "tok": tokenizer(client.cfg, name), "payloads": payloads,
                        "control": control})
    if mode == "multi":
        gate = load_gate(context, client, names)
    rows = answer_queries(client.slot["peft"], client.slot["tok"], queries, sharers=sharers,
                          gate=gate, hints=hints, max_prompt_tokens=int(ev.max_prompt_tokens),
                          max_new_tokens=int(ev.max_new_tokens),
                          nll_max_tokens=int(ev.get("nll_max_tokens", 0)))
    return RecordDict({"c2c": ConfigRecord({"results": json.dumps(rows),
                                            "gate": "trained" if gate is not None else "none"})})


def reply(msg: Message, content: RecordDict, seconds: float) -> Message:
    content["metrics"] = MetricRecord({"seconds": seconds})
    return Message(content, reply_to=msg)


__all__ = ["ANSWER_MODES", "prekey", "signed_prekey", "forget_prekey", "own_name", "install_fusers", "load_fuser", "load_gate", "share", "refine", "answer",
           "reply", "my_version", "tokenizer"]
