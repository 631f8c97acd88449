"""The ServerApp's Cache-to-Cache phase: train and host fusers, relay the exchange, score it.

After the last round (or every round, ``c2c.train.at``: :meth:`C2C.after_round`) the server

1. brings the fuser of every ordered pair up to date (:class:`edgefuse.c2c.hub.FuserService`)
   among one representative client per base model (its lowest partition-id), and trains a
   several-sharers gate per receiver that has two or more sharers;
2. sends each receiver its fusers (``query.fusers``); a receiver refuses any fuser that was
   not trained for its current model version;
3. (:meth:`C2C.run`, after the rounds) evaluates the same queries (MMLU letters, held-out Dolly rows) per receiver in each mode
   of ``c2c.eval.modes``:

   - ``alone``: the receiver by itself;
   - ``t2t``: a sharer's generated answer, sealed for the receiver, given as context;
   - ``c2c``: a sharer's sealed int8 prompt cache, fused by the receiver;
   - ``co_c2c``: the receiver's cache goes to the sharer first, which fuses it into its own
     (its fuser sharer ← receiver) and sends the refined cache back to be fused;
   - ``multi``: every sharer's cache, combined by the receiver's gate;
   - ``c2c_zero`` / ``c2c_shuffled`` (with ``c2c.eval.controls: true``, after each ``c2c``
     row): the controls. The exchange is c2c's (the sharer seals its real prompt cache);
     the receiver fuses with the pair's control fuser (trained with the same budget and
     ``sharer_control`` zero / shuffled, its own registry version), fed all zeros of the
     received cache's shapes, or the cache received for the next query of the same
     message (query ``k`` of a message reads query ``(k + 1) % n``'s: a rotation, so never
     its own, and deterministic; a message holds at least two queries here). Doing c2c's
     exchange keeps the shapes (sliding windows included) exactly those the control fuser
     was trained on and makes the control rows' latency and bytes c2c's by construction.

Metrics per row (:func:`_score`, :func:`_paired_with_alone`): MMLU accuracy (Wilson 95 %),
ROUGE-L on Dolly (bootstrap 95 %), and the held-out response NLL of every Dolly and GSM8K
query (``c2c.eval.gsm8k_n`` test questions, the reference solution as the response): the
receiver's teacher-forced mean nats per reference token after the (fused or hinted) prompt
cache, the fusers' training loss (:func:`edgefuse.c2c.peer.response_nll`), averaged over
items with a bootstrap 95 % interval. Every mode is compared with ``alone`` on the same
items (paired bootstrap: ``*_vs_alone``), ``c2c`` with each control (``nll_vs_zero``,
``nll_vs_shuffled``: c2c minus control, below zero = the sharer's own cache helps). Power:
``mmlu_above_chance`` (the receiver alone's Wilson low end above 0.25),
``mmlu_resolvable_difference`` (the paired interval's half-width) and a ``note`` when the
MMLU n cannot resolve a 3-point difference (:func:`_power`).

The server relays sealed bytes only and holds no key of an exchange
(:mod:`edgefuse.c2c.handshake`: the signed-prekey idea of Signal's X3DH, one signed
ephemeral per side). It forwards each device's name, identity key and signed run prekey
(from ``query.info``); the sharer checks them against its own pins, seals under a fresh
ephemeral key and returns it with its signature, which the server forwards with the frames
and the receiver checks against its pin for the sharer. A refused key is the node's error
reply, so that (receiver, mode) row records it (``error``) and the run goes on. Each
exchange has a fresh session id. When the phase ends the server sends every node
``query.forget`` (its prekey's private part is dropped: recordings can no longer be opened).

Latency per query (ms) is built from the devices' measured compute and the emulated link
(``c2c.eval.wan``; each relayed payload takes two hops, device → server → device, of
:meth:`edgefuse.transport.wan.WanLink.delay_s`). The exchange time is the sharer's compute
plus its payload's hops (Co-C2C: both legs; ``multi``: the slowest sharer, as sharers work
in parallel). Then ``alone``/``t2t``: exchange + receiver prefill + decode (T2T's prompt
needs the hint first); ``c2c``/``co_c2c``/``multi``: max(exchange, receiver prefill) + fuse
+ decode, since the receiver prefills its own prompt while the sharers work. Flower's own
message overhead is not included (it is a simulation artefact; it is in the phase's wall time). ``bytes_sent`` counts the sealed
payload bytes the devices send per query (what each device puts on its uplink) plus the
handshake of each exchange (ephemeral key + signature,
:data:`~edgefuse.c2c.handshake.HANDSHAKE_BYTES` = 96 bytes per sealed leg), spread evenly
over the queries of that exchange (the one-off prekey in ``query.info`` is not counted).
"""

from __future__ import annotations

import json
import math
import os
import time
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log

from edgefuse.app import messages as M
from edgefuse.app.messages import NodeError, fuser_key, fuser_meta_key, last_line
from edgefuse.app.phases.base import Phase, PhaseContext
from edgefuse.app.strategy import GroupedLoRA, NodeInfo
from edgefuse.c2c.hub import FuserService, Side, kv_spec, pair_list
from edgefuse.c2c.hub import check_config
from edgefuse.c2c.handshake import HANDSHAKE_BYTES
from edgefuse.c2c.peer import pack_frames, unpack_frames
from edgefuse.c2c.registry import FuserRegistry, FuserVersion, FuserVersionError, pack_state
from edgefuse.config import ConfigError
from edgefuse.data import mirror_dir
from edgefuse.eval import stats
from edgefuse.eval.queries import Query, dolly_eval_queries, load_gsm8k, load_mmlu, rouge_l
from edgefuse.transport.identity import device_name
from edgefuse.transport.wan import WanLink, WanProfile


def representatives(strategy: GroupedLoRA) -> dict[str, NodeInfo]:
    """One node per base model: the one with the lowest partition-id, among models whose
    group has a global adapter (a model none of whose clients ever trained is left out)."""
    reps: dict[str, NodeInfo] = {}
    for node in sorted(strategy.nodes.values(), key=lambda n: n.partition_id):
        if node.model in strategy.groups:
            reps.setdefault(node.model, node)
    return reps


def sides(strategy: GroupedLoRA, reps: dict[str, NodeInfo]) -> dict[str, Side]:
    """The :class:`Side` of each representative: its model and current adapter."""
    alpha = float(strategy.cfg.training.lora_alpha)
    return {m: Side(m, n.partition_id, strategy.client_state(n), n.lora_rank, alpha)
            for m, n in reps.items()}


CONTROL_MODES = ("c2c_zero", "c2c_shuffled")  # with c2c.eval.controls, after each c2c row
CONTROL_OF = {"c2c_zero": "zero", "c2c_shuffled": "shuffled"}
CHANCE = 0.25  # MMLU: four letters
RESOLVE = 0.03  # the difference (3 points) the MMLU n should resolve


def load_queries(cfg) -> list[Query]:
    """The evaluation queries: ``c2c.eval.mmlu_n`` MMLU questions,
    ``c2c.eval.dolly_per_category`` public Dolly rows per category (the public split's eval
    slice) and ``c2c.eval.gsm8k_n`` GSM8K test questions whose ``reference`` is the whole
    reference solution (calculator annotations ``<<...>>`` removed), scored by NLL only."""
    ev = cfg.c2c.eval
    out = []
    if int(ev.mmlu_n) > 0:
        out += load_mmlu(cfg.data.mirror, int(ev.mmlu_n), int(cfg.seed), split=str(ev.mmlu_split))
    if int(ev.dolly_per_category) > 0:
        out += dolly_eval_queries(cfg.data, int(cfg.seed), int(ev.dolly_per_category))
    if int(ev.get("gsm8k_n", 0)) > 0:
        out += load_gsm8k(cfg.data.mirror, int(ev.gsm8k_n), int(cfg.seed), split="test", full_answer=True)
    return out


def check_eval(cfg) -> None:
    """Compose-time checks of the evaluation keys this phase adds (``c2c.enabled`` only).

    Raises:
        ConfigError: ``c2c.eval.controls`` not a bool, controls without ``c2c`` in
            ``c2c.eval.modes``, a control mode listed in ``c2c.eval.modes`` without
            ``c2c.eval.controls: true``, a negative ``gsm8k_n`` or ``nll_max_tokens``, a
            ``gsm8k_n`` above the GSM8K test split (checked when the mirror is local).
    """
    c2c = cfg.get("c2c")
    if c2c is None or not c2c.get("enabled"):
        return
    ev = c2c.eval
    controls = ev.get("controls", False)
    if not isinstance(controls, bool):
        raise ConfigError(f"c2c.eval.controls must be true or false, got {controls!r}")
    modes = [str(m) for m in ev.modes]
    if controls and "c2c" not in modes:
        raise ConfigError("c2c.eval.controls: true needs c2c in c2c.eval.modes (each control row "
                          "sits beside a c2c row)")
    listed = sorted(set(modes) & set(CONTROL_MODES))
    if listed and not controls:
        raise ConfigError(f"c2c.eval.modes lists {listed}: the controls run with c2c.eval.controls: true")
    for key in ("gsm8k_n", "nll_max_tokens"):
        value = ev.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"c2c.eval.{key} must be an integer >= 0, got {value!r}")
    mirror = mirror_dir(cfg.data.get("mirror"))
    if ev.get("gsm8k_n", 0) > 0 and mirror is not None:
        # a local mirror: its rows counted now (no dataset loaded), not after the federation trained
        path = mirror / "gsm8k" / "test.jsonl"
        if not path.is_file():
            raise ConfigError(f"c2c.eval.gsm8k_n={ev.gsm8k_n}: GSM8K mirror file not found: {path} "
                              f"(data.mirror={str(mirror)!r}); point data.mirror at the folder holding "
                              "gsm8k/test.jsonl, or set data.mirror=hub")
        with path.open("rb") as f:
            held = sum(1 for line in f if line.strip())
        if ev.gsm8k_n > held:
            raise ConfigError(f"c2c.eval.gsm8k_n={ev.gsm8k_n} but the GSM8K test split holds {held} "
                              f"questions: use c2c.eval.gsm8k_n <= {held}")


def control_version(service: FuserService, sharer: Side, receiver: Side, control: str) -> FuserVersion:
    """The registry version of a pair's control fuser (:meth:`FuserService.version`: the
    run's fuser config with ``sharer_control=control``)."""
    return service.version(sharer, receiver, control)


class C2C(Phase):
    """The Cache-to-Cache phase (results sections ``fusers`` and ``c2c``).

    State for one run: the fuser service (registry in ``c2c.registry_dir``, else the run's
    ``fusers/``), the representatives, the pairs whose fuser trained, and the gates."""

    name = "c2c"
    seconds_key = "c2c_eval"
    after_round_key = "fusers"

    def enabled(self, cfg) -> bool:
        return bool(cfg.get("c2c") and cfg.c2c.enabled)

    def check(self, cfg) -> None:
        """:func:`edgefuse.c2c.hub.check_config` and :func:`check_eval`."""
        check_config(cfg)
        check_eval(cfg)

    def controls(self) -> bool:
        """Whether the control rows run (``c2c.eval.controls``)."""
        return bool(self.cfg.c2c.eval.get("controls", False)) and "c2c" in self.cfg.c2c.eval.modes

    def start(self, ctx: PhaseContext) -> None:
        """Open the fuser registry and the emulated link."""
        cfg = ctx.cfg
        root = Path(cfg.c2c.registry_dir).expanduser() if cfg.c2c.registry_dir else ctx.out / "fusers"
        self.ctx, self.cfg, self.strategy = ctx, cfg, ctx.strategy
        self.service = FuserService(cfg, FuserRegistry(root))
        self.gates: dict[str, tuple[list[str], dict, dict]] = {}  # receiver -> (sharers, state, meta)
        self.reps: dict[str, NodeInfo] = {}
        self.pairs: list[tuple[str, str]] = []  # (sharer, receiver) whose fuser is up to date
        self.wan = WanLink(WanProfile.from_name(str(cfg.c2c.eval.wan)))

    def after_round(self, ctx: PhaseContext, round_idx: int) -> dict:
        """``{"fusers": rows}`` after the last round, and after every round with
        ``c2c.train.at: every_round``; ``{}`` otherwise."""
        if round_idx == ctx.last_round or str(self.cfg.c2c.train.at) == "every_round":
            return {"fusers": self.update_fusers(round_idx)}
        return {}

    def run(self, ctx: PhaseContext) -> dict:
        """``{"c2c": rows}``: every receiver in every mode (see :meth:`evaluate`); then,
        whatever happened, every node is told to drop its prekey (:meth:`forget`)."""
        try:
            return {"c2c": self.evaluate()}
        finally:
            self.forget()

    def forget(self) -> dict[int, str]:
        """Send ``query.forget`` to every identified node (config and group only, no adapter);
        returns ``{node id: "forgot" | "none held" | error}``. A node that does not answer
        keeps its prekey until its process or run ends (logged, not raised)."""
        nodes = list(self.strategy.nodes.values())
        msgs = []
        for node in nodes:
            content, _ = self.strategy.content(self.ctx.round, None, node)
            msgs.append(Message(content, dst_node_id=int(node.node_id),
                                message_type=M.query_type(M.FORGET)))
        status = {n.node_id: "no reply" for n in nodes}
        try:
            replies = list(self.ctx.grid.send_and_receive(msgs, timeout=self.ctx.timeout)) if msgs else []
        except Exception as e:  # noqa: BLE001 - the results are saved; the keys go with the run
            log(WARNING, "c2c: query.forget not sent: %s", e)
            return status
        for rep in replies:
            nid = rep.metadata.src_node_id
            if rep.has_error():
                status[nid] = f"error: {last_line(rep.error.reason)}"
            else:
                try:
                    status[nid] = "forgot" if bool(rep.content["c2c"]["forgot"]) else "none held"
                except (KeyError, TypeError):  # never let a bad reply mask the phase's rows
                    status[nid] = "error: the reply has no c2c.forgot"
        for nid, st in status.items():
            if st not in ("forgot", "none held"):
                log(WARNING, "c2c: node %d did not drop its prekey (%s)", nid, st)
        return status

    # -- messaging ----------------------------------------------------------------
    def _ask(self, node: NodeInfo, kind: str, conf: dict, arrays: dict[str, ArrayRecord] | None = None):
        return self.ctx.ask(node, M.query_type(kind), {"c2c": ConfigRecord(conf), **(arrays or {})})

    # -- 1 + 2: fusers --------------------------------------------------------------
    def update_fusers(self, round_idx: int) -> list[dict]:
        """Train / carry over / reuse the pair fusers and gates; send them to receivers.

        Returns the ``fusers`` rows (one per pair, with ``download`` status per receiver)."""
        reps = representatives(self.strategy)
        self.reps = reps
        configured = list(dict.fromkeys(str(c.model) for c in self.cfg.federation.clients))
        pairs = pair_list(self.cfg.c2c.pairs, configured)
        self.pairs = [(a, b) for a, b in pairs if a in reps and b in reps]
        for a, b in sorted(set(pairs) - set(self.pairs)):
            log(WARNING, "c2c: skipping pair %s -> %s: a side has no trained client", a, b)
        if not self.pairs:
            log(WARNING, "c2c: fewer than two base models in the federation, nothing to fuse")
            return []
        s = sides(self.strategy, reps)
        rows = self.service.update(s, self.pairs, round_idx)
        self.pairs = [(r["sharer"], r["receiver"]) for r in rows  # a pair once: its real fuser's row
                      if r["action"] != "failed" and r.get("control", "none") == "none"]
        if "multi" in self.cfg.c2c.eval.modes:
            self._train_gates(s)
        status = self._distribute()
        for row in rows:
            row["download"] = status.get(row["receiver"], "not sent")
        return rows

    def _train_gates(self, s: dict[str, Side]) -> None:
        from edgefuse.c2c.hub import train_multi_gate

        for receiver in self.reps:
            sharers = [a for a, b in self.pairs if b == receiver]
            if len(sharers) < 2:
                continue
            state, meta = train_multi_gate(self.cfg, self.service, s, receiver, sharers)
            self.gates[receiver] = (sharers, state, meta)

    def _distribute(self) -> dict[str, str]:
        status = {}
        for receiver, node in self.reps.items():
            sharers = [a for a, b in self.pairs if b == receiver]
            if not sharers:
                continue
            conf, arrays = {"sharers": sharers}, {}
            r_kv = kv_spec(self.cfg, receiver).to_dict()
            nbytes, sd = 0, sides(self.strategy, self.reps)
            for sharer in sharers:
                versions = [("none", self.service.version(sd[sharer], sd[receiver]))]
                if self.controls():
                    versions += [(c, control_version(self.service, sd[sharer], sd[receiver], c))
                                 for c in CONTROL_OF.values()]
                sent = []
                for control, version in versions:
                    try:
                        state, fcfg, card = self.service.registry.load_state(version)
                    except FuserVersionError as e:
                        if control == "none":
                            raise
                        log(WARNING, "c2c: no %s-sharer control fuser %s -> %s (%s): its rows will "
                            "fail", control, sharer, receiver, e)
                        continue
                    packed, index = pack_state(state)
                    key = fuser_key(sharer, control)
                    arrays[key] = ArrayRecord({k: Array(v) for k, v in packed.items()})
                    conf[fuser_meta_key(sharer, control)] = json.dumps({
                        "card": card.to_json(), "config": fcfg, "index": index, "receiver_kv": r_kv,
                        "sharer_kv": kv_spec(self.cfg, sharer).to_dict()})
                    nbytes += sum(v.nbytes for v in packed.values())
                    sent += [control] if control != "none" else []
                if sent:
                    conf[f"controls.{sharer}"] = sent
            if receiver in self.gates:
                g_sharers, g_state, g_meta = self.gates[receiver]
                packed, index = pack_state(g_state)
                arrays["gate"] = ArrayRecord({k: Array(v) for k, v in packed.items()})
                conf["gate_meta"] = json.dumps({**g_meta, "sharers": g_sharers, "index": index})
            try:
                self._ask(node, M.FUSERS, conf, arrays)
                status[receiver] = "installed"
                log(INFO, "c2c: partition %d (%s) installed %d fusers (%.2f MB)", node.partition_id,
                    receiver, len(sharers), nbytes / 1e6)
            except NodeError as e:
                status[receiver] = f"refused: {e}"
                log(WARNING, "c2c: %s", e)
        return status

    # -- 3: evaluation ------------------------------------------------------------------
    def evaluate(self) -> list[dict]:
        """One row per (receiver, sharers, mode) (results.json ``c2c``)."""
        if not self.pairs:
            return []
        queries = load_queries(self.cfg)
        modes = list(self.cfg.c2c.eval.modes)
        rows = []
        for receiver, r_node in self.reps.items():
            sharers = [a for a, b in self.pairs if b == receiver]
            plan = []
            if "alone" in modes:
                plan.append(("alone", []))
            for s in sharers:
                plan += [(m, [s]) for m in ("t2t", "c2c") if m in modes]
                if self.controls():
                    plan += [(m, [s]) for m in CONTROL_MODES]
                if "co_c2c" in modes and (receiver, s) in self.pairs:
                    plan.append(("co_c2c", [s]))
            if "multi" in modes and len(sharers) >= 2:
                plan.append(("multi", sharers))
            for mode, ss in plan:
                t0 = time.perf_counter()
                try:
                    per_query = []
                    size = int(self.cfg.c2c.eval.batch_queries)
                    for chunk in _chunks(queries, size, 2 if mode == "c2c_shuffled" else 1):
                        per_query += self._run(mode, receiver, ss, chunk)
                    row = _score(receiver, ss, mode, queries, per_query)
                except NodeError as e:
                    log(WARNING, "c2c: %s with %s on %s failed: %s", mode, ss, receiver, e)
                    row = {"receiver": receiver, "sharers": ss, "mode": mode, "n": 0,
                           "mmlu_acc": None, "rougeL": None, "nll": None, "latency_ms": None,
                           "bytes_sent": None, "error": str(e)}
                row["wall_seconds"] = time.perf_counter() - t0
                log(INFO, "c2c: %-18s %-12s sharers %-40s MMLU %s ROUGE-L %s NLL %s latency %s ms",
                    receiver, mode, ",".join(ss) or "-", _f(row["mmlu_acc"]), _f(row["rougeL"]),
                    _f(row.get("nll")), _f(row["latency_ms"], ".0f"))
                rows.append(row)
        return _paired_with_alone(rows)

    @staticmethod
    def _peer_fields(node: NodeInfo, sfx: str = "") -> dict:
        """What the server forwards about ``node`` (it vouches for none of it)."""
        return {f"peer_name{sfx}": device_name(node.partition_id),
                f"peer_identity_key{sfx}": node.identity_key}

    def _share(self, sharer: str, peer: str, kind: str, chunk: list[Query],
               refine_frames: list[bytes] | None = None, refine_handshake: dict | None = None,
               session_id: bytes | None = None):
        """Ask ``sharer`` to seal ``kind`` payloads for ``peer`` (with ``refine_frames``: the
        Co-C2C refine of ``peer``'s frames, whose ``refine_handshake`` goes along); returns
        ``(frames, ms, sid, handshake)`` with ``handshake`` the sharer's
        ``{"ephemeral_key", "handshake_signature"}``."""
        node, peer_node = self.reps[sharer], self.reps[peer]
        sid = session_id or os.urandom(16)
        conf = {"queries": json.dumps([q.to_dict() for q in chunk]), "kind": kind,
                "peer_model": peer, **self._peer_fields(peer_node),
                "peer_public_key": peer_node.public_key,
                "peer_prekey_signature": peer_node.prekey_signature, "session_id": sid.hex()}
        arrays = None
        msg_type = M.SHARE
        if refine_frames is not None:
            msg_type = M.REFINE
            flat, conf["frames_lengths"] = pack_frames(refine_frames)
            conf.update(refine_handshake or {})
            arrays = {"frames": ArrayRecord({"frames": Array(flat)})}
        reply = self._ask(node, msg_type, conf, arrays)
        rec = reply["c2c"]
        frames = unpack_frames(reply["frames"]["frames"].numpy(), list(rec["frames_lengths"]))
        try:
            handshake = {k: bytes(rec[k]) for k in ("ephemeral_key", "handshake_signature")}
        except (KeyError, TypeError) as e:
            raise NodeError(f"partition {node.partition_id} {msg_type}: the reply has no handshake ({e})") from None
        return frames, [float(x) for x in rec["ms"]], sid, handshake

    def _hop(self, nbytes: int) -> float:
        """ms for one payload relayed device → server → device over the emulated link."""
        return 1000.0 * (self.wan.delay_s(nbytes) + self.wan.delay_s(nbytes))

    def _run(self, mode: str, receiver: str, sharers: list[str], chunk: list[Query]) -> list[dict]:
        n = len(chunk)
        pre_ms, sent = [0.0] * n, [0] * n
        conf = {"queries": json.dumps([q.to_dict() for q in chunk]), "mode": mode,
                "sharers": sharers}
        arrays = {}
        hs = HANDSHAKE_BYTES / max(n, 1)  # one handshake per sealed leg, spread over its queries
        for i, s in enumerate(sharers):
            if mode == "co_c2c":
                f1, ms1, sid, h1 = self._share(receiver, s, "kv", chunk)
                frames, ms2, _, handshake = self._share(s, receiver, "kv", chunk, refine_frames=f1,
                                                        refine_handshake=h1, session_id=sid)
                lat = [a + self._hop(len(x) + hs) + b + self._hop(len(y) + hs)
                       for a, x, b, y in zip(ms1, f1, ms2, frames)]
                nb = [len(x) + len(y) + 2 * hs for x, y in zip(f1, frames)]
            else:
                frames, ms, sid, handshake = self._share(s, receiver, "text" if mode == "t2t" else "kv",
                                                         chunk)  # the controls: c2c's exchange
                lat = [a + self._hop(len(x) + hs) for a, x in zip(ms, frames)]
                nb = [len(x) + hs for x in frames]
            flat, conf[f"frames.{i}_lengths"] = pack_frames(frames)
            arrays[f"frames.{i}"] = ArrayRecord({"frames": Array(flat)})
            conf.update(self._peer_fields(self.reps[s], f".{i}"))  # the frames' sealer
            conf.update({f"{k}.{i}": v for k, v in handshake.items()})
            conf[f"session_id.{i}"] = sid.hex()
            pre_ms = [max(a, b) for a, b in zip(pre_ms, lat)]  # sharers work in parallel
            sent = [a + b for a, b in zip(sent, nb)]
        results = self._ask(self.reps[receiver], M.ANSWER, conf, arrays).json("c2c", "results")
        for r, p, b in zip(results, pre_ms, sent):
            r["exchange_ms"] = p
            r["bytes_sent"] = b
            if mode in ("alone", "t2t"):  # the prompt needs the hint first
                r["latency_ms"] = p + r["prefill_ms"] + r["decode_ms"]
            else:  # the receiver prefills its own prompt while the sharers work
                r["latency_ms"] = max(p, r["prefill_ms"]) + r["fuse_ms"] + r["decode_ms"]
        return results


def _chunks(items: list, size: int, least: int = 1):
    """``items`` in runs of ``size`` (at least ``least``); a last run shorter than ``least``
    joins the one before it (so no message of the shuffled control holds a single query)."""
    size = max(1, size, least)
    runs = [items[i:i + size] for i in range(0, len(items), size)]
    if len(runs) > 1 and len(runs[-1]) < least:
        runs[-2:] = [runs[-2] + runs[-1]]
    yield from runs


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _score(receiver: str, sharers: list[str], mode: str, queries: list[Query], results: list[dict]) -> dict:
    """Aggregate per-query results into one results.json ``c2c`` row: MMLU accuracy with its
    Wilson 95 % interval, ROUGE-L and the response NLL (mean over items of each item's nats
    per reference token) with bootstrap ones (:mod:`edgefuse.eval.stats`), their ``n``, and
    the per-item scores (``_items``, dropped by :func:`_paired_with_alone`)."""
    by_id = {q.qid: q for q in queries}
    mmlu = [(by_id[r["qid"]], r) for r in results if by_id[r["qid"]].kind == "mmlu"]
    dolly = [(by_id[r["qid"]], r) for r in results if by_id[r["qid"]].kind == "dolly"]
    n_gsm8k = sum(by_id[r["qid"]].kind == "gsm8k" for r in results)
    correct = {q.qid: float(r["pred"] == q.answer) for q, r in mmlu}
    rouge = {q.qid: rouge_l(r["text"] or "", q.reference or "") for q, r in dolly}
    nll = {r["qid"]: float(r["nll"]) for r in results if r.get("nll") is not None}
    acc = stats.proportion(list(correct.values()))
    rl = stats.bootstrap_mean_interval(list(rouge.values()))
    nl = stats.bootstrap_mean_interval(list(nll.values()))
    return {
        "receiver": receiver, "sharers": list(sharers), "mode": mode, "n": len(results),
        "n_mmlu": len(mmlu), "n_dolly": len(dolly), "n_gsm8k": n_gsm8k,
        "mmlu_acc": acc.value, "mmlu_acc_ci95_low": acc.low, "mmlu_acc_ci95_high": acc.high,
        "rougeL": rl.value, "rougeL_ci95_low": rl.low, "rougeL_ci95_high": rl.high,
        "n_nll": nl.n, "nll": nl.value, "nll_ci95_low": nl.low, "nll_ci95_high": nl.high,
        "latency_ms": _mean([r["latency_ms"] for r in results]),
        "latency_ms_mmlu": _mean([r["latency_ms"] for _, r in mmlu]),
        "latency_ms_dolly": _mean([r["latency_ms"] for _, r in dolly]),
        "exchange_ms": _mean([r["exchange_ms"] for r in results]),
        "prefill_ms": _mean([r["prefill_ms"] for r in results]),
        "fuse_ms": _mean([r["fuse_ms"] for r in results]),
        "decode_ms": _mean([r["decode_ms"] for r in results]),
        "bytes_sent": _mean([r["bytes_sent"] for r in results]),
        "_items": {"mmlu_acc": correct, "rougeL": rouge, "nll": nll},
    }


def _paired(row: dict, name: str, items: dict, base: dict, metrics) -> None:
    """Add ``<metric>_<name>`` (row minus base on the items both scored, paired bootstrap
    95 %: :func:`edgefuse.eval.stats.paired_difference`) to ``row`` for each metric."""
    for metric in metrics:
        common = sorted(set(items[metric]) & set(base[metric]))
        if common:
            d = stats.paired_difference([items[metric][q] for q in common],
                                        [base[metric][q] for q in common])
            row.update(d.to_dict(f"{metric}_{name}"))


def _paired_with_alone(rows: list[dict]) -> list[dict]:
    """Add to each row of one receiver its paired difference from that receiver's ``alone``
    row on the items both scored (``mmlu_acc_vs_alone``, ``rougeL_vs_alone``,
    ``nll_vs_alone``, each with ``_n`` and a paired-bootstrap 95 % interval); to each ``c2c``
    row its difference from the control rows of the same receiver and sharer
    (``nll_vs_zero``, ``nll_vs_shuffled``: c2c minus control); the MMLU power fields
    (:func:`_power`); then drop the per-item scores. Rows without an ``alone`` row get no
    difference from it."""
    alone = {r["receiver"]: r.get("_items") for r in rows if r["mode"] == "alone" and r.get("_items")}
    controls = {(r["receiver"], tuple(r["sharers"]), CONTROL_OF[r["mode"]]): r.get("_items")
                for r in rows if r["mode"] in CONTROL_OF and r.get("_items")}
    for row in rows:
        items, base = row.get("_items"), alone.get(row["receiver"])
        if items is None:
            continue
        if base is not None and row["mode"] != "alone":
            _paired(row, "vs_alone", items, base, ("mmlu_acc", "rougeL", "nll"))
        if row["mode"] == "c2c":
            for control in CONTROL_OF.values():
                other = controls.get((row["receiver"], tuple(row["sharers"]), control))
                if other is not None:
                    _paired(row, f"vs_{control}", items, other, ("nll",))
    for row in rows:
        row.pop("_items", None)
    return _power(rows)


def _power(rows: list[dict]) -> list[dict]:
    """The MMLU power fields of every row (nothing else changes).

    ``mmlu_above_chance``: the receiver alone's Wilson 95 % low end is above 0.25 (``None``
    without an alone row with MMLU items). ``mmlu_resolvable_difference``: the half-width
    of the row's paired interval vs alone (``None`` for alone). A paired 95 % interval
    over ``n`` items can exclude zero for a true difference ``d`` only if ``d`` exceeds
    about ``z·sqrt(d/n)`` (all discordant items going one way), i.e. ``n ≥ z²/d``: 129 for
    3 points; so ``note`` says the row cannot resolve a 3-point difference when
    ``n_mmlu < 129`` or the half-width exceeds 0.03, and that the receiver is at chance
    when it is not above it.
    """
    chance = {}
    for r in rows:
        if r["mode"] == "alone" and r.get("n_mmlu") and r.get("mmlu_acc_ci95_low") is not None:
            chance[r["receiver"]] = bool(r["mmlu_acc_ci95_low"] > CHANCE)
    need = math.ceil(_Z95 ** 2 / RESOLVE)
    for r in rows:
        if not r.get("n_mmlu"):
            continue
        r["mmlu_above_chance"] = chance.get(r["receiver"])
        notes = []
        if r["mmlu_above_chance"] is False:
            notes.append(f"{r['receiver']} alone is not above chance on MMLU (Wilson low end <= {CHANCE})")
        lo, hi = r.get("mmlu_acc_vs_alone_ci95_low"), r.get("mmlu_acc_vs_alone_ci95_high")
        half = None if lo is None or hi is None else (hi - lo) / 2
        r["mmlu_resolvable_difference"] = half
        if r["mode"] != "alone" and (r["n_mmlu"] < need or (half is not None and half > RESOLVE)):
            notes.append(f"{r['receiver']} {r['mode']}: n={r['n_mmlu']} MMLU items cannot resolve a "
                         f"{RESOLVE * 100:.0f}-point difference"
                         + ("" if half is None else f" (paired 95 % interval ±{half:.3f})")
                         + (f", that needs n >= {need}" if r["n_mmlu"] < need else ""))
        if notes:
            r["note"] = "; ".join(notes)
    return rows


_Z95 = 1.959964


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)
