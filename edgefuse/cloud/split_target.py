"""The cloud's side of split inference: per-session middle-layer caches, batched MID steps,
the split head's partial logits.

A split session's device runs the embeddings and the first ``k`` decoder layers and the
last ``m`` (+ the final norm and its share of the LM head); the cloud runs only the middle
layers ``k .. L-m-1`` (:func:`edgefuse.cloud.split.split_model`'s ``middle``, sharing the
target's parameters) and never sees token ids: only the activations after layer ``k``
(MID) and, with a split head, the tail columns of the final hidden state (HEAD). The wire
is :mod:`edgefuse.cloud.protocol` (MID / MIDOUT / HEAD / LOGITS / MASK / MASKED).

State of a :class:`SplitSession` (mirrors :class:`edgefuse.cloud.protocol.SplitLedger`, the
row arithmetic both ends share): ``rows`` — the input activations (float32 ``[r, D]``) of
absolute positions ``start .. start + r - 1``: the held committed rows, then the pending
rows of the last MID when the tuple lets the cloud keep them; ``kv`` — the middle's KV cache
of the first ``kv_len`` of those rows, computed with attention starting at ``start``.

Cache authorization (the endpoint-authorized cache control (flagCache, LCache) of the
edge–cloud seed design, :class:`edgefuse.cloud.protocol.CloudAuth`), the VERIFY rule applied
to middle rows: a MID with ``base_len`` = B needs the last ``auth.window(B)`` committed rows
(the held ones + its ``c`` re-sent rows: fewer is ERROR ``evicted``, more ERROR
``protocol``); its ``n`` new rows attend to that window and to each other (causally), at
absolute positions (B − window .. B + n − 1), so with ``l_cache`` = None a split session
computes exactly what the unsplit target does. Between requests the cloud keeps the last
``auth.held(B)`` committed rows and the n new ones (none with ``flag_cache`` off). Whenever
rows leave at the front (the window slides, a tuple shrinks, AUTH revokes) the KV is
dropped, never cropped (deeper-layer entries of the kept rows carry the dropped ones), and
rebuilt from the kept input rows by the next MID (counted: ``rebuilds`` /
``rebuild_rows``); pending rows rolled back at the end are cropped (causal: no earlier row
depends on them).

Limits (checked in this order, before any activation is decoded): ``c + n`` and the window
+ ``n`` at most ``max_context`` (ERROR ``context``), the rows one MID feeds (rebuilt window +
``n``) at most ``max_batch_tokens`` (ERROR ``limit``), the last absolute position below the
model's ``max_position_embeddings`` (``context``), then the acts' length exactly
``acts_nbytes(c + n, D, act)`` and every decoded value finite (``protocol``). D is the
cloud's own hidden size, never read from the wire. A HEAD has 1 ..
``min(pending, MAX_HEAD_ROWS)`` rows and ``k`` at most the mask's size.

Batching: :meth:`SplitTarget.step` runs the MID jobs of several sessions (of one split
``(k, m)`` per forward) through :func:`edgefuse.cloud.target.batched_forward` with input
embeddings and per-row absolute position offsets (:func:`edgefuse.cloud.split.middle_forward`): caches left-padded, new rows
right-padded, a 2-D mask hides both, and each session gets back only its own rows. MID
jobs are never batched with VERIFY / FUSE jobs (the service keeps batches of one kind).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from edgefuse.cloud import protocol as P
from edgefuse.cloud import split as S
from edgefuse.cloud import vocab as V
from edgefuse.cloud.rows import RowPadding
from edgefuse.cloud.target import (MIN_BATCH_TOKENS, SessionError, Target, pack_rows,
                                   tokenizer_fingerprint)
from edgefuse.transport.crypto import FRAME_OVERHEAD


@dataclass(frozen=True)
class SplitPolicy:
    """Which splits a service serves (config ``cloud.service.split``).

    ``allowed``: ``"any"`` (every split the model admits) or a tuple of ``(k, m)`` pairs;
    ``head_split``: whether a split head (HEAD / LOGITS) is served; ``acts``: the activation
    encodings accepted. A split outside them gets ERROR ``split`` at OPEN.
    Raises ``ValueError`` for a malformed value."""
    allowed: str | tuple[tuple[int, int], ...] = "any"
    head_split: bool = True
    acts: tuple[str, ...] = P.SPLIT_ACTS

    def __post_init__(self):
        if self.allowed != "any":
            try:
                pairs = tuple((int(k), int(m)) for k, m in self.allowed)
            except (TypeError, ValueError):
                raise ValueError(f"split.allowed must be 'any' or a list of {{k, m}}, got "
                                 f"{self.allowed!r:.80}") from None
            if not pairs or any(k < 1 or m < 0 for k, m in pairs):
                raise ValueError(f"split.allowed needs k >= 1, m >= 0 pairs, got {pairs!r:.80}")
            object.__setattr__(self, "allowed", pairs)
        if not isinstance(self.head_split, bool):
            raise ValueError(f"split.head_split must be a bool, got {self.head_split!r}")
        bad = [a for a in self.acts if a not in P.SPLIT_ACTS]
        if bad or not self.acts:
            raise ValueError(f"split.acts must be a non-empty subset of {P.SPLIT_ACTS}, got "
                             f"{self.acts!r}")

    @classmethod
    def from_config(cls, node) -> "SplitPolicy":
        """From a config mapping ``{allowed: any | [{k, m}, ...], head_split: bool, acts:
        [...]}`` (missing keys keep their defaults). Raises ``ValueError`` for a value that is
        not a mapping or an unknown key (a misspelt restriction must not serve any split)."""
        if node is not None and not hasattr(node, "keys"):
            raise ValueError(f"split policy must be a mapping {{allowed, head_split, acts}}, got {node!r:.80}")
        node = dict(node or {})
        unknown = sorted(set(map(str, node)) - {"allowed", "head_split", "acts"})
        if unknown:
            raise ValueError(f"split policy: unknown key(s) {', '.join(unknown)} (known: allowed, head_split, acts)")
        allowed = node.get("allowed", "any")
        if allowed != "any":
            if isinstance(allowed, (str, bytes, dict)) or not hasattr(allowed, "__iter__"):
                raise ValueError(f"split.allowed must be 'any' or a list of {{k, m}}, got "
                                 f"{allowed!r:.80}")
            try:
                allowed = tuple((d["k"], d["m"]) for d in allowed)
            except (KeyError, TypeError):
                raise ValueError(f"split.allowed entries are {{k, m}} mappings, got "
                                 f"{allowed!r:.80}") from None
        return cls(allowed, node.get("head_split", True),
                   tuple(node.get("acts", P.SPLIT_ACTS)))

    def to_config(self) -> dict:
        """The plain mapping :meth:`from_config` reads (JSON-ready)."""
        allowed = "any" if self.allowed == "any" else [{"k": k, "m": m} for k, m in self.allowed]
        return {"allowed": allowed, "head_split": self.head_split, "acts": list(self.acts)}

    def permits(self, k: int, m: int) -> bool:
        return self.allowed == "any" or (k, m) in self.allowed


@dataclass
class SplitSession:
    """One device's split session at the cloud (see the module docstring).

    ``spec``: the accepted :class:`edgefuse.cloud.split.SplitSpec`; ``request``: the OPEN's
    :class:`edgefuse.cloud.protocol.SplitRequest`; ``ledger``: the row arithmetic;
    ``rows`` / ``kv`` / ``kv_len``: held input rows and their middle KV; ``mask``: the split
    head's vocabulary mask (int64 sorted ids; None before an explicit MASK)."""
    spec: "S.SplitSpec"
    request: P.SplitRequest
    auth: P.CloudAuth
    ledger: P.SplitLedger
    rows: torch.Tensor
    kv: list | None = None
    kv_len: int = 0
    mask: np.ndarray | None = None
    closed: bool = False
    mids: int = 0

    @property
    def start(self) -> int:
        """Absolute position of ``rows[0]``."""
        return self.ledger.committed - self.ledger.held

    @property
    def held(self) -> int:
        """Committed rows the cloud holds."""
        return self.ledger.held

    @property
    def committed(self) -> int:
        return self.ledger.committed


@dataclass
class _MidPlan:
    """One MID job: ``inputs`` fed after ``past`` cached rows (``layers``) at absolute offset
    ``origin`` (the window's first position); ``window`` rows then ``n`` new ones."""
    origin: int
    window: int
    n: int
    past: int
    layers: list | None
    inputs: torch.Tensor
    rows: torch.Tensor  # the window's input rows + the new ones [window + n, D]
    group: tuple[int, int] = field(default=(0, 0))


class SplitTarget:
    """Runs the middle layers of the target for many split sessions. Not thread-safe: call
    from one thread (the service's worker).

    Args:
        model: the target causal LM (eval mode); the middles share its parameters.
        tok: its tokenizer (fingerprint, named vocabulary masks).
        name: the model's name, reported to devices.
        policy: which splits are served (:class:`SplitPolicy`).
        max_context: rows one session's window + new rows may hold (as the target's).
        max_batch_tokens: rows one forward pass may feed, padding included (≥ max_context
            and ≥ 512).
        row_padding: as :class:`edgefuse.cloud.target.Target`'s (the service passes the
            table calibrated on the whole target: the middle layers are most of it).

    Counters: ``batches`` / ``jobs`` (step calls that ran a forward, MID jobs run),
    ``forwards`` / ``forward_tokens`` / ``forward_tokens_max``, ``rebuilds`` /
    ``rebuild_rows`` (MIDs whose window KV had to be recomputed, and its rows),
    ``rows_in`` / ``rows_out`` (activation rows received / sent), ``head_jobs``,
    ``limit_refusals``.

    Raises ``ValueError`` for out-of-range limits or a model :func:`split_model` cannot
    split.
    """

    def __init__(self, model, tok, name: str, policy: SplitPolicy | None = None,
                 max_context: int = 2048, *, max_batch_tokens: int = 8192,
                 row_padding: RowPadding | int = 4):
        if max_batch_tokens < max(int(max_context), MIN_BATCH_TOKENS):
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_context "
                             f"({max_context}) and >= {MIN_BATCH_TOKENS}")
        self.model = model.eval()
        self.tok = tok
        self.name = name
        self.policy = policy if policy is not None else SplitPolicy()
        self.fingerprint = tokenizer_fingerprint(tok)
        self.context_len = int(max_context)
        self.max_batch_tokens = int(max_batch_tokens)
        self.padding = RowPadding.coerce(row_padding)
        cfg = model.config
        self.n_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self._middles: dict[tuple[int, int], object] = {}
        self._tails: dict[int, torch.Tensor] = {}
        self.batches = self.jobs = 0
        self.forwards = self.forward_tokens = self.forward_tokens_max = 0
        self.rebuilds = self.rebuild_rows = 0
        self.rows_in = self.rows_out = 0
        self.head_jobs = 0
        self.limit_refusals = 0

    # -- sizes --------------------------------------------------------------------------

    def frame_limit(self, request: P.SplitRequest | None) -> int:
        """The largest frame (bytes, sealed) a split session with ``request`` can need: a
        MID of ``max_context`` rows in its encoding (capped at the framing's 16 MiB)."""
        act = request.act if request is not None and request.act in P.SPLIT_ACTS else "float16"
        need = FRAME_OVERHEAD + P.MID_HEADER_BYTES + S.acts_nbytes(self.context_len,
                                                                  self.hidden_size, act)
        return min(need, P.MAX_MESSAGE_BYTES)

    # -- sessions -----------------------------------------------------------------------

    def _middle(self, k: int, m: int):
        if (k, m) not in self._middles:
            self._middles[(k, m)] = S.split_model(self.model, k, m).middle
        return self._middles[(k, m)]

    def _tail(self, s: int) -> torch.Tensor:
        if s not in self._tails:
            self._tails[s] = S.head_tail(self.model.get_output_embeddings().weight, s)
        return self._tails[s]

    def open(self, msg: P.Open) -> SplitSession:
        """Open a split session (no prompt: it comes as the first MID). Raises
        :class:`SessionError`: ``fingerprint`` (another tokenizer), ``split`` (a split the
        model or this cloud's policy does not allow, a mask it does not know), ``protocol``
        (no split, prompt ids, a bad tuple)."""
        req = msg.split
        if not isinstance(req, P.SplitRequest):
            raise SessionError("protocol", "not a split OPEN")
        if msg.prompt:
            raise SessionError("protocol", "a split OPEN carries no prompt ids")
        if msg.fingerprint != self.fingerprint:
            raise SessionError("fingerprint", f"tokenizer fingerprint {msg.fingerprint!r} does "
                               f"not match the cloud's {self.fingerprint!r}")
        if not isinstance(msg.auth, P.CloudAuth):
            raise SessionError("protocol", f"bad cache tuple {msg.auth!r}")
        try:
            spec = S.SplitSpec(req.k, req.m, req.head_split, req.act)
            spec.check(self.n_layers, self.hidden_size)
        except (ValueError, TypeError) as exc:
            raise SessionError("split", f"split refused for this model ({self.n_layers} "
                               f"layers, hidden {self.hidden_size}): {exc}") from None
        if not self.policy.permits(req.k, req.m):
            raise SessionError("split", f"this cloud does not serve the split k={req.k}, "
                               f"m={req.m} (allowed: {self.policy.allowed})")
        if req.act not in self.policy.acts:
            raise SessionError("split", f"this cloud does not accept {req.act} activations "
                               f"(allowed: {', '.join(self.policy.acts)})")
        mask = None
        if req.head_split is not None:
            if not self.policy.head_split:
                raise SessionError("split", "this cloud does not serve a split head")
            if req.mask is None:
                raise SessionError("split", f"a split head needs a vocabulary mask (one of "
                                   f"{', '.join(V.MASK_NAMES + (V.EXPLICIT,))})")
            if req.mask != V.EXPLICIT:
                try:
                    mask = V.vocab_mask(self.tok, req.mask, vocab_size=self.vocab_size)
                except ValueError as exc:
                    raise SessionError("split", str(exc)) from None
        elif req.mask is not None:
            raise SessionError("split", "a vocabulary mask without a split head")
        self._middle(req.k, req.m)
        ledger = P.SplitLedger(committed=int(msg.offset))
        return SplitSession(spec, req, msg.auth, ledger,
                            torch.zeros((0, self.hidden_size), dtype=torch.float32), mask=mask)

    def close(self, sess: SplitSession) -> None:
        """Free the session's rows and cache."""
        sess.kv, sess.kv_len, sess.closed = None, 0, True
        sess.rows = sess.rows[:0]

    def authorize(self, sess: SplitSession, auth: P.CloudAuth) -> int:
        """Apply a new cache tuple at once (an AUTH): the rows it no longer allows, and the
        middle KV with them, are gone before this returns. Returns the committed rows held.
        Raises :class:`SessionError` ``protocol`` for a closed session or a bad tuple."""
        if sess.closed:
            raise SessionError("protocol", "session is closed")
        self._apply(sess, self._check_auth(auth))
        return sess.held

    _check_auth = staticmethod(Target._check_auth)  # one check of a cache tuple, the target's

    @staticmethod
    def _trim(sess: SplitSession, old_start: int) -> None:
        """Cut ``rows`` / ``kv`` to what the ledger holds now (rows at ``old_start`` ..)."""
        start, end = sess.start, sess.ledger.committed + sess.ledger.pending_held
        a, b = start - old_start, end - old_start
        sess.rows = sess.rows[a:b]
        if a != 0:  # rows left at the front: the KV goes (deeper entries carry them)
            sess.kv, sess.kv_len = None, 0
        elif sess.kv is not None and sess.kv_len > b:
            sess.kv = [(k[:, :, :b], v[:, :, :b]) for k, v in sess.kv]
            sess.kv_len = b
        if sess.rows.shape[0] == 0:
            sess.kv, sess.kv_len = None, 0

    def _apply(self, sess: SplitSession, auth: P.CloudAuth) -> None:
        old = sess.start
        sess.auth = auth
        sess.ledger.apply(auth)
        self._trim(sess, old)

    # -- MID --------------------------------------------------------------------------

    def _prepare(self, sess: SplitSession, req: P.Mid) -> _MidPlan:
        """Apply ``req``'s tuple (evicting first, even if the request is then refused),
        check it and plan its forward. Counts are checked before the acts are decoded."""
        if sess.closed:
            raise SessionError("protocol", "session is closed")
        auth = self._check_auth(req.auth)
        self._apply(sess, auth)
        led = sess.ledger
        try:
            led.check(req.base_len)
        except P.SyncError as exc:
            raise SessionError("sync", str(exc)) from None
        if auth.l_cache == 0:
            raise SessionError("protocol", "l_cache = 0 authorizes no rows: nothing to compute")
        c, n, B = int(req.c), int(req.n), int(req.base_len)
        if n < 1:
            raise SessionError("protocol", "a MID needs at least one new row")
        if c + n > self.context_len:
            raise SessionError("context", f"a MID of {c} + {n} rows exceeds the context of "
                               f"{self.context_len}")
        need = auth.window(B)
        held = min(led.held_at(B), need)
        if held + c < need:
            raise SessionError("evicted", f"the MID needs the last {need} committed rows; the "
                               f"cloud holds {held} and the MID re-sent {c}: re-send the "
                               f"missing {need - held - c}")
        if held + c > need:
            raise SessionError("protocol", f"{c} re-sent rows + {held} held exceed the "
                               f"authorized window of {need} rows")
        if need + n > self.context_len:
            raise SessionError("context", f"window {need} + {n} new rows exceed the context "
                               f"of {self.context_len}")
        origin = B - need
        if self.max_positions is not None and B + n > self.max_positions:
            raise SessionError("context", f"position {B + n - 1} is past the model's "
                               f"{self.max_positions} positions")
        # the KV of the window is usable if nothing was re-sent and it starts at the window
        first_held = B - held  # absolute position of the first held row we use
        usable = c == 0 and sess.kv is not None and sess.start == origin
        past = min(sess.kv_len, need) if usable else 0
        cost = self.padding.fed(1, need - past + n)
        if cost > self.max_batch_tokens:
            self.limit_refusals += 1
            raise SessionError("limit", f"the MID would feed {cost} rows; this cloud runs at "
                               f"most {self.max_batch_tokens} per forward pass")
        want = S.acts_nbytes(c + n, self.hidden_size, sess.spec.act)
        if len(req.acts) != want:
            raise SessionError("protocol", f"MID acts are {len(req.acts)} bytes; {c + n} rows "
                               f"of {self.hidden_size} {sess.spec.act} are {want}")
        try:
            x = S.decode_acts(req.acts, c + n, self.hidden_size, sess.spec.act)
        except ValueError as exc:
            raise SessionError("protocol", f"MID acts do not decode: {exc}") from None
        if not bool(torch.isfinite(x).all()):
            raise SessionError("protocol", "MID acts hold a non-finite value")
        kept = sess.rows[first_held - sess.start:B - sess.start] if held else sess.rows[:0]
        rows = torch.cat([x[:c], kept, x[c:]])  # window (re-sent + held) + new rows
        layers = ([(k[:, :, :past], v[:, :, :past]) for k, v in sess.kv] if past else None)
        self.rows_in += c + n
        if past < need:  # window rows fed again (re-sent, or held with their KV dropped)
            self.rebuilds += 1
            self.rebuild_rows += need - past
        return _MidPlan(origin, need, n, past, layers, rows[past:], rows,
                        (sess.spec.k, sess.spec.m))

    @torch.no_grad()
    def step(self, jobs: list[tuple[SplitSession, P.Mid]]) -> list[P.Message]:
        """Answer the MID jobs of several sessions, one forward pass per split ``(k, m)``
        (more when ``max_batch_tokens`` needs it). Returns one ``MidOut`` or ``Error`` per job,
        in order; a refused job leaves its session unchanged but for its cache tuple, the
        others proceed. At most one job per session."""
        if len({id(s) for s, _ in jobs}) != len(jobs):
            raise ValueError("at most one job per session in a batch")
        replies: list[P.Message | None] = [None] * len(jobs)
        plans: dict[int, _MidPlan] = {}
        for j, (sess, req) in enumerate(jobs):
            try:
                plans[j] = self._prepare(sess, req)
            except SessionError as exc:
                replies[j] = P.Error(exc.code, str(exc))
        if not plans:
            return replies  # type: ignore[return-value]
        outs: dict[int, torch.Tensor] = {}
        kvs: dict[int, list] = {}
        for group in self._groups(plans):
            middle = self._middle(*plans[group[0]].group)
            hs, caches = S.middle_forward(middle, [plans[j].layers for j in group],
                                          [plans[j].past for j in group],
                                          [plans[j].inputs for j in group],
                                          offsets=[plans[j].origin for j in group],
                                          padding=self.padding)
            outs.update(zip(group, hs))
            kvs.update(zip(group, caches))
        for j, plan in plans.items():
            sess, req = jobs[j]
            try:
                replies[j] = self._finish(sess, req, plan, outs[j], kvs[j])
            except Exception as exc:  # noqa: BLE001 - one bad job never costs the others
                code = getattr(exc, "code", "protocol" if isinstance(exc, ValueError) else "internal")
                replies[j] = P.Error(code, f"{type(exc).__name__}: {exc}")
        self.batches += 1
        self.jobs += len(plans)
        return replies  # type: ignore[return-value]

    def _groups(self, plans: dict[int, _MidPlan]) -> list[list[int]]:
        """Jobs of one split ``(k, m)`` in consecutive groups feeding at most
        ``max_batch_tokens`` rows each (padding included); counts the forwards."""
        by_split: dict[tuple[int, int], list[int]] = {}
        for j, p in plans.items():
            by_split.setdefault(p.group, []).append(j)
        groups: list[list[int]] = []
        for js in by_split.values():
            groups += pack_rows(js, [plans[j].inputs.shape[0] for j in js], self.padding,
                                self.max_batch_tokens)
        for g in groups:
            fed = self.padding.fed(len(g), max(plans[j].inputs.shape[0] for j in g))
            self.forwards += 1
            self.forward_tokens += fed
            self.forward_tokens_max = max(self.forward_tokens_max, fed)
        return groups

    def _finish(self, sess: SplitSession, req: P.Mid, plan: _MidPlan, out: torch.Tensor,
                kv: list) -> P.MidOut:
        """Encode the new rows' output and commit: rows and KV now cover the window + the new
        rows (from ``plan.origin``); then keep what the tuple lets the cloud keep."""
        total = plan.window + plan.n
        new = out[-plan.n:].float()
        payload = S.encode_acts(new, sess.spec.act)
        sess.rows = plan.rows
        sess.kv = [(k[:, :, :total], v[:, :, :total]) for k, v in kv]
        sess.kv_len = total
        old_start = plan.origin
        sess.ledger.commit(sess.auth, req.base_len, plan.n)
        # commit() sets held = auth.held(B); the rows tensor starts at the window's origin
        self._trim(sess, old_start)
        sess.mids += 1
        self.rows_out += plan.n
        return P.MidOut(req.req, plan.n, payload)

    # -- split head -------------------------------------------------------------------

    def head(self, sess: SplitSession, req: P.Head) -> P.Message:
        """Partial logits of the head's tail columns over the session's mask (LOGITS).
        Raises :class:`SessionError`: ``protocol`` (no split head, no mask yet, rows outside
        1..pending, k beyond the mask, acts of the wrong length or non-finite)."""
        if sess.closed:
            raise SessionError("protocol", "session is closed")
        s = sess.spec.head_split
        if s is None:
            raise SessionError("protocol", "HEAD in a session without a split head")
        if sess.mask is None:
            raise SessionError("protocol", "HEAD before the session's explicit MASK")
        n, k = int(req.n), int(req.k)
        top = min(sess.ledger.pending, P.MAX_HEAD_ROWS)
        if not 1 <= n <= top:
            raise SessionError("protocol", f"HEAD of {n} rows; the last MID had "
                               f"{sess.ledger.pending} (at most {P.MAX_HEAD_ROWS})")
        if k > len(sess.mask):
            raise SessionError("protocol", f"HEAD top-k {k} exceeds the mask's "
                               f"{len(sess.mask)} tokens")
        width = self.hidden_size - s
        want = S.acts_nbytes(n, width, sess.spec.act)
        if len(req.acts) != want:
            raise SessionError("protocol", f"HEAD acts are {len(req.acts)} bytes; {n} rows of "
                               f"{width} {sess.spec.act} are {want}")
        try:
            h = S.decode_acts(req.acts, n, width, sess.spec.act)
        except ValueError as exc:
            raise SessionError("protocol", f"HEAD acts do not decode: {exc}") from None
        if not bool(torch.isfinite(h).all()):
            raise SessionError("protocol", "HEAD acts hold a non-finite value")
        with torch.no_grad():
            z = S.partial_logits(self._tail(s), h, ids=torch.as_tensor(sess.mask))
        try:
            payload = V.encode_masked(z, k)
        except ValueError as exc:  # partial logits out of float16's range: hostile rows
            raise SessionError("protocol", f"HEAD rows give logits that cannot be sent: {exc}") from None
        self.head_jobs += 1
        self.rows_in += n
        return P.Logits(req.req, payload)

    def set_mask(self, sess: SplitSession, req: P.Mask) -> P.Masked:
        """Set an explicit session's mask from its bitmap (the special / EOS ids are always
        added). Raises :class:`SessionError` ``protocol``: not an explicit-mask session, a
        bitmap of the wrong length, padding bits set, or empty."""
        if sess.closed:
            raise SessionError("protocol", "session is closed")
        if sess.spec.head_split is None or sess.request.mask != V.EXPLICIT:
            raise SessionError("protocol", "MASK in a session without an explicit mask")
        try:
            ids = V.mask_from_bitmap(req.bitmap, self.vocab_size)
            sess.mask = V.vocab_mask(self.tok, V.EXPLICIT, vocab_size=self.vocab_size, ids=ids)
        except ValueError as exc:
            raise SessionError("protocol", f"bad MASK: {exc}") from None
        return P.Masked(int(len(sess.mask)))
