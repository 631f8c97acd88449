"""The device ↔ cloud decoding protocol: message types and their compact binary encoding.

One TCP connection per device session. On the wire every message is a 4-byte big-endian
length followed by that many bytes. The first two messages are the cleartext handshake
(HELLO and WELCOME, :mod:`edgefuse.cloud.wire`: a SIGMA-I signed ephemeral Diffie-Hellman);
every later message is an AES-GCM frame of :class:`edgefuse.transport.SecureSession` whose
plaintext is one of the messages below, the first one always IDENTIFY (the device's identity
and its signature of the transcript; nothing else is served before it verified).

Plaintext layout: 1 type byte, then the body (integers big-endian, token ids int32,
probabilities float16)::

    IDENTIFY  device→cloud  32-byte Ed25519 public key ‖ 64-byte signature   (first frame only)
    OPEN      device→cloud  u16 len ‖ JSON {fingerprint, temperature, top_k, seed, max_new,
                            flag_cache, l_cache, offset} ‖ int32[n] prompt ids
    VERIFY    device→cloud  u32 req ‖ u32 base_len ‖ AUTH5 ‖ u32 c ‖ int32[c] context
                            ‖ u8 γ ‖ int32[γ] draft ids
                            ‖ u8 kq ‖ γ × (int32[kq] ids ‖ f16[kq] q-probs)   (kq = 0: greedy)
    FUSE      device→cloud  u32 req ‖ u32 base_len ‖ AUTH5 ‖ u32 c ‖ int32[c] context
                            ‖ u8 m ‖ int32[m] committed ids ‖ u16 k
    AUTH      device→cloud  AUTH5
    CLOSE     device→cloud  (empty)
    OPENED    cloud→device  u16 len ‖ JSON {model, fingerprint, context_len}
    VERIFIED  cloud→device  u32 req ‖ u8 accepted ‖ int32 token
    TOPK      cloud→device  u32 req ‖ u16 k ‖ int32[k] ids ‖ uint8[k] q ‖ f16 top ‖ f16 scale
                            ‖ f16 tail
    AUTHED    cloud→device  u32 held   (committed tokens the cloud holds after the AUTH)
    ERROR     cloud→device  u16 len ‖ JSON {code, message}

    AUTH5 = u8 flag_cache (0 | 1) ‖ u32 l_cache (0xFFFFFFFF = unlimited)

``base_len`` is the number of tokens (prompt + generated) the device has committed, counted
from the start of the session whatever the cloud has evicted; the cloud refuses a request
whose ``base_len`` differs from its own count (:class:`SyncError`), so a lost or duplicated
request can never silently desynchronize the two sides.

Cache authorization — the endpoint-authorized cache control (flagCache, LCache) of the
edge–cloud seed design (:class:`CloudAuth`): OPEN, VERIFY and FUSE each carry the device's
tuple, and AUTH changes it between requests (answered by AUTHED). The rule, one place
(:meth:`CloudAuth.window` / :meth:`CloudAuth.held`), mirrored exactly by both ends:

- a request with ``base_len`` = B needs the last ``window(B)`` = min(l_cache, B) committed
  tokens (all B when unlimited), followed by its own new ids (VERIFY: the drafts; FUSE: the
  ``m`` newly committed ids); each score it returns (every drafted position of a VERIFY,
  the next token of a FUSE) conditions on at most the last l_cache ids before that
  position, with positions counted from 0 at that window's first id — the target
  restricted to an l_cache window, so speculative decoding stays lossless with respect to
  it and a session equals one opened over just its window;
- between requests the cloud keeps the ids and KV cache of the last ``held(n)`` committed
  tokens: min(l_cache, n) when ``flag_cache``, none otherwise (evicted right after each
  reply, or at once on an AUTH that shrinks or revokes: AUTH(flag_cache=0, l_cache=0));
- a request's ``context`` are the ids just before the held ones that the window needs and
  the cloud does not hold (always the whole window when ``flag_cache`` is 0); held +
  context must be the window exactly: fewer is refused with ERROR ``evicted`` (the cloud
  never decodes silently without the authorized context), more with ERROR ``protocol``;
- a request's tuple takes effect first (a shrink evicts even if the request is then
  refused); under l_cache = 0 nothing can be scored, so requests get ERROR ``protocol``
  until a later tuple authorizes a window again (its context re-sent);
- OPEN's ``offset`` counts committed tokens before ``prompt`` that the device does not send
  (those outside what the cloud may hold), so ``base_len`` stays absolute.

A tuple that does not parse (flag byte not 0/1, JSON values of the wrong type or range) is a
:class:`ProtocolError`, answered with ERROR ``protocol``.

VERIFY (speculative decoding, Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"): the cloud scores the γ drafted tokens in one forward pass and
answers the number accepted and one more token (the correction on a rejection, the bonus
token when all γ are accepted). γ = 0 is remote autoregressive decoding: one target token
per round trip. At temperature > 0 the device drafts from a sparse distribution q (its
top-kq, renormalised) and sends it, so the cloud can run exact rejection sampling.

FUSE (logit fusion, Floe): the cloud appends the ``m`` tokens the device committed since
its last request and returns the top-k of its next-token log-probabilities, 8-bit quantized
below the largest (``logprob ≈ top − q · scale``, q in 0..255) plus ``tail`` = log of the
probability mass outside the top-k. The full vocabulary never crosses the link.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

# the handshake's magic carries its version: EFC2 = SIGMA-I (authenticated, the only one a
# default service or link speaks), EFC1 = anonymous X25519 (the benchmark's "auth off" only)
MAGIC_HELLO = b"EFC2"  # device → cloud: magic ‖ X25519 key ‖ u8 n ‖ session id
MAGIC_WELCOME = b"EFC2"  # cloud → device: magic ‖ X25519 key ‖ Ed25519 key ‖ signature
MAGIC_HELLO_ANONYMOUS = b"EFC1"  # device → cloud: magic ‖ X25519 key ‖ u8 n ‖ session id
MAGIC_WELCOME_ANONYMOUS = b"EFC1"  # cloud → device: magic ‖ X25519 key
MAGIC_HEALTH = b"EFH1"  # a health probe: the cloud answers one cleartext JSON status message
LENGTH_PREFIX_BYTES = 4
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the framing's own ceiling (both ends)
# what the cloud service accepts (its ``max_frame_bytes`` default): a real request is at most
# ~8 KB (an OPEN of 2,048 prompt ids, a VERIFY re-sending a 2,048-id window), 64 KiB leaves
# room for a sampled VERIFY's draft distributions (γ × kq × 6 bytes)
MAX_REQUEST_BYTES = 64 * 1024
# a connection's first message: a hello (≤ 4 + 32 + 1 + 255 bytes) or a health probe
# (magic ‖ token); the IDENTIFY frame that follows a hello is 97 + 26 bytes
MAX_FIRST_MESSAGE_BYTES = 512

OPEN, VERIFY, FUSE, CLOSE, AUTH, IDENTIFY = 1, 2, 3, 4, 5, 6
OPENED, VERIFIED, TOPK, AUTHED, ERROR = 101, 102, 103, 104, 127
TYPE_NAMES = {OPEN: "OPEN", VERIFY: "VERIFY", FUSE: "FUSE", CLOSE: "CLOSE", AUTH: "AUTH",
              IDENTIFY: "IDENTIFY", OPENED: "OPENED", VERIFIED: "VERIFIED", TOPK: "TOPK",
              AUTHED: "AUTHED", ERROR: "ERROR"}
MAX_GAMMA = 255
MAX_TOPK = 1024
L_UNLIMITED = 0xFFFFFFFF  # l_cache on the wire for "no limit"


class ProtocolError(ValueError):
    """A message that does not parse: unknown type, wrong length, out-of-range field."""


class SyncError(ProtocolError):
    """A request's ``base_len`` disagrees with the cloud's committed token count."""


class RemoteError(RuntimeError):
    """The cloud answered ERROR; ``code`` names the reason (``unauthorized`` (the device's
    identity is not authorized, its signature does not verify, or it sent something else
    before IDENTIFY: the cloud closes the connection), ``sync``, ``protocol``, ``busy``,
    ``fingerprint``, ``context``, ``evicted``, ``limit`` (the request exceeds a service limit:
    too many drafted tokens, too much work for one forward pass), ``internal``)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"cloud error [{code}]: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class CloudAuth:
    """The endpoint-authorized cache control (flagCache, LCache) of the edge–cloud seed
    design: what of a device's past the cloud may keep and attend to.

    ``flag_cache``: whether the cloud may keep ids and KV cache between requests (False:
    it evicts everything right after each reply, and each request re-sends its context);
    ``l_cache``: the most committed tokens (counted from the newest) the cloud may keep and
    attend to, None = unlimited. On the wire: u8 flag ‖ u32 l_cache, 0xFFFFFFFF = None.
    Raises :class:`ProtocolError` for values out of range (a non-bool flag, l_cache not
    None and not an int in 0..0xFFFFFFFE). Revocation is ``CloudAuth(False, 0)``."""
    flag_cache: bool = True
    l_cache: int | None = None

    def __post_init__(self):
        if not isinstance(self.flag_cache, (bool, np.bool_)):
            raise ProtocolError(f"flag_cache must be a bool, got {self.flag_cache!r}")
        object.__setattr__(self, "flag_cache", bool(self.flag_cache))
        lc = self.l_cache
        if lc is not None:
            if isinstance(lc, (bool, np.bool_)) or not isinstance(lc, (int, np.integer)) \
                    or not 0 <= int(lc) < L_UNLIMITED:
                raise ProtocolError(f"l_cache must be None or an int in 0..{L_UNLIMITED - 1}, "
                                    f"got {lc!r}")
            object.__setattr__(self, "l_cache", int(lc))

    def window(self, n: int) -> int:
        """How many of ``n`` committed tokens (the newest) a request may attend to."""
        return n if self.l_cache is None else min(self.l_cache, n)

    def held(self, n: int) -> int:
        """How many of ``n`` committed tokens (the newest) the cloud keeps between requests."""
        return self.window(n) if self.flag_cache else 0


REVOKE = CloudAuth(False, 0)


@dataclass
class Open:
    """Start a session: the tokenizer fingerprint, sampling settings, the prompt ids, the
    cache tuple ``auth`` and ``offset`` (committed tokens before ``prompt`` the device does
    not send, counted in ``base_len``; normally ``n - auth.held(n)`` of an n-token prompt)."""
    prompt: list[int]
    fingerprint: str
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    max_new: int = 256
    auth: CloudAuth = field(default_factory=CloudAuth)
    offset: int = 0


@dataclass
class Verify:
    """Verify ``draft`` (γ ids) on top of ``base_len`` committed tokens.

    ``q_ids`` / ``q_probs``: per drafted position the draft's sparse distribution
    (``γ × kq``), empty for greedy decoding. ``auth``: the cache tuple; ``context``: ids
    just before the ones the cloud holds that the authorized window needs (re-sent)."""
    req: int
    base_len: int
    draft: list[int]
    q_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    q_probs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float16))
    auth: CloudAuth = field(default_factory=CloudAuth)
    context: list[int] = field(default_factory=list)


@dataclass
class Fuse:
    """Append ``committed`` (ids since the last request) and ask for the top-``k``;
    ``auth`` / ``context`` as for :class:`Verify`."""
    req: int
    base_len: int
    committed: list[int]
    k: int
    auth: CloudAuth = field(default_factory=CloudAuth)
    context: list[int] = field(default_factory=list)


@dataclass
class Auth:
    """Change the session's cache tuple now (shrink, grow, revoke); answered by AUTHED."""
    auth: CloudAuth


@dataclass
class Authed:
    """``held``: committed tokens the cloud holds once the AUTH took effect."""
    held: int


IDENTIFY_KEY_BYTES, IDENTIFY_SIG_BYTES = 32, 64


@dataclass
class Identify:
    """The device's identity proof, the first sealed frame of a connection (SIGMA-I's third
    message): its Ed25519 public key and its signature of the handshake transcript
    (:func:`edgefuse.cloud.wire.identify_transcript`). Sealed, so a passive observer never
    learns which device connected."""
    public_key: bytes
    signature: bytes


@dataclass
class Close:
    """End the session; the cloud frees its KV cache."""


@dataclass
class Opened:
    model: str
    fingerprint: str
    context_len: int


@dataclass
class Verified:
    """``accepted`` of the γ drafted tokens were kept; ``token`` follows them."""
    req: int
    accepted: int
    token: int


@dataclass
class TopK:
    """The cloud's next-token distribution, top-k only: ``ids`` int[k], ``q`` uint8[k]
    (log-prob ≈ top − q·scale, nats), ``tail`` = log of the mass outside the top-k."""
    req: int
    ids: np.ndarray
    q: np.ndarray
    top: float
    scale: float
    tail: float

    def logprobs(self) -> np.ndarray:
        """float32[k] dequantized log-probabilities (nats)."""
        return np.float32(self.top) - self.q.astype(np.float32) * np.float32(self.scale)


@dataclass
class Error:
    code: str
    message: str


Message = Identify | Open | Verify | Fuse | Auth | Close | Opened | Verified | TopK | Authed | Error

_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")
_REQ = struct.Struct(">II")  # req, base_len
_AUTH = struct.Struct(">BI")  # flag_cache, l_cache
_VERIFIED = struct.Struct(">IBi")
_TOPK_HEAD = struct.Struct(">IH")


def _json(obj: dict) -> bytes:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    if len(raw) > 0xFFFF:
        raise ProtocolError(f"JSON header is {len(raw)} bytes (max 65535)")
    return _U16.pack(len(raw)) + raw


def _ids(ids) -> bytes:
    return np.asarray(ids, dtype=">i4").tobytes()


def _auth(auth: CloudAuth) -> bytes:
    if not isinstance(auth, CloudAuth):
        raise ProtocolError(f"auth must be a CloudAuth, got {type(auth).__name__}")
    return _AUTH.pack(int(auth.flag_cache), L_UNLIMITED if auth.l_cache is None else auth.l_cache)


def _request_head(msg: Verify | Fuse) -> bytes:
    """u32 req ‖ u32 base_len ‖ AUTH5 ‖ u32 c ‖ int32[c] context."""
    return (_REQ.pack(msg.req, msg.base_len) + _auth(msg.auth) + _U32.pack(len(msg.context))
            + _ids(msg.context))


def encode(msg: Message) -> bytes:
    """The plaintext bytes of ``msg``; raises :class:`ProtocolError` for out-of-range fields."""
    if isinstance(msg, Open):
        if not isinstance(msg.auth, CloudAuth):
            raise ProtocolError(f"auth must be a CloudAuth, got {type(msg.auth).__name__}")
        if msg.offset < 0:
            raise ProtocolError(f"offset {msg.offset} < 0")
        head = {"fingerprint": msg.fingerprint, "temperature": float(msg.temperature),
                "top_k": int(msg.top_k), "seed": int(msg.seed), "max_new": int(msg.max_new),
                "flag_cache": msg.auth.flag_cache, "l_cache": msg.auth.l_cache,
                "offset": int(msg.offset)}
        return bytes([OPEN]) + _json(head) + _ids(msg.prompt)
    if isinstance(msg, Verify):
        g = len(msg.draft)
        if g > MAX_GAMMA:
            raise ProtocolError(f"γ = {g} drafted tokens (max {MAX_GAMMA})")
        q_ids = np.asarray(msg.q_ids, dtype=np.int64)
        kq = q_ids.shape[-1] if q_ids.size else 0
        if kq and q_ids.shape != (g, kq):
            raise ProtocolError(f"q has {q_ids.shape[0]} rows for γ = {g} drafted tokens")
        if kq > 255:
            raise ProtocolError(f"draft top-k {kq} (max 255)")
        out = [bytes([VERIFY]), _request_head(msg), _U8.pack(g), _ids(msg.draft), _U8.pack(kq)]
        if kq:
            probs = np.asarray(msg.q_probs, dtype=">f2").reshape(g, kq)
            for i in range(g):
                out.append(_ids(q_ids[i]))
                out.append(probs[i].tobytes())
        return b"".join(out)
    if isinstance(msg, Fuse):
        m = len(msg.committed)
        if m > 255:
            raise ProtocolError(f"{m} committed tokens in one FUSE (max 255)")
        if not 1 <= msg.k <= MAX_TOPK:
            raise ProtocolError(f"top-k {msg.k} out of range 1..{MAX_TOPK}")
        return (bytes([FUSE]) + _request_head(msg) + _U8.pack(m) + _ids(msg.committed)
                + _U16.pack(msg.k))
    if isinstance(msg, Identify):
        if len(msg.public_key) != IDENTIFY_KEY_BYTES or len(msg.signature) != IDENTIFY_SIG_BYTES:
            raise ProtocolError(f"IDENTIFY carries a {IDENTIFY_KEY_BYTES}-byte key and a "
                                f"{IDENTIFY_SIG_BYTES}-byte signature")
        return bytes([IDENTIFY]) + bytes(msg.public_key) + bytes(msg.signature)
    if isinstance(msg, Auth):
        return bytes([AUTH]) + _auth(msg.auth)
    if isinstance(msg, Authed):
        return bytes([AUTHED]) + _U32.pack(msg.held)
    if isinstance(msg, Close):
        return bytes([CLOSE])
    if isinstance(msg, Opened):
        return bytes([OPENED]) + _json({"model": msg.model, "fingerprint": msg.fingerprint,
                                        "context_len": int(msg.context_len)})
    if isinstance(msg, Verified):
        return bytes([VERIFIED]) + _VERIFIED.pack(msg.req, msg.accepted, msg.token)
    if isinstance(msg, TopK):
        k = len(msg.ids)
        return (bytes([TOPK]) + _TOPK_HEAD.pack(msg.req, k) + _ids(msg.ids)
                + np.asarray(msg.q, dtype=np.uint8).tobytes()
                + np.array([msg.top, msg.scale, msg.tail], dtype=">f2").tobytes())
    if isinstance(msg, Error):
        return bytes([ERROR]) + _json({"code": msg.code, "message": msg.message})
    raise ProtocolError(f"cannot encode {type(msg).__name__}")


class _Reader:
    def __init__(self, data: bytes, kind: str):
        self.data, self.pos, self.kind = memoryview(data), 1, kind

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError(f"{self.kind} message truncated: needs {self.pos + n} bytes, "
                                f"has {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))

    def ids(self, n: int) -> np.ndarray:
        return np.frombuffer(self.take(4 * n), dtype=">i4").astype(np.int64)

    def json(self) -> dict:
        (n,) = self.unpack(_U16)
        try:
            obj = json.loads(bytes(self.take(n)))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # nesting bomb
            raise ProtocolError(f"{self.kind} JSON header does not parse: {exc}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"{self.kind} JSON header is not an object")
        return obj

    def auth(self) -> CloudAuth:
        flag, lc = self.unpack(_AUTH)
        if flag > 1:
            raise ProtocolError(f"{self.kind} flag_cache byte is {flag} (must be 0 or 1)")
        return CloudAuth(bool(flag), None if lc == L_UNLIMITED else lc)

    def request_head(self) -> tuple[int, int, CloudAuth, list[int]]:
        req, base_len = self.unpack(_REQ)
        auth = self.auth()
        (c,) = self.unpack(_U32)
        return req, base_len, auth, self.ids(c).tolist()

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.kind} message has {len(self.data) - self.pos} trailing bytes")


def decode(data: bytes) -> Message:
    """Parse one plaintext message; raises :class:`ProtocolError` on anything malformed."""
    if not data:
        raise ProtocolError("empty message")
    t = data[0]
    if t not in TYPE_NAMES:
        raise ProtocolError(f"unknown message type {t}")
    r = _Reader(data, TYPE_NAMES[t])
    try:
        if t == OPEN:
            h = r.json()
            n = (len(data) - r.pos) // 4
            prompt = r.ids(n).tolist()
            offset = h["offset"]
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ProtocolError(f"OPEN offset must be an int >= 0, got {offset!r}")
            msg = Open(prompt=prompt, fingerprint=str(h["fingerprint"]),
                       temperature=float(h["temperature"]), top_k=int(h["top_k"]),
                       seed=int(h["seed"]), max_new=int(h["max_new"]),
                       auth=CloudAuth(h["flag_cache"], h["l_cache"]), offset=offset)
        elif t == VERIFY:
            req, base_len, auth, context = r.request_head()
            (g,) = r.unpack(_U8)
            draft = r.ids(g).tolist()
            (kq,) = r.unpack(_U8)
            q_ids = np.zeros((g, kq), np.int64)
            q_probs = np.zeros((g, kq), np.float32)
            for i in range(g if kq else 0):
                q_ids[i] = r.ids(kq)
                q_probs[i] = np.frombuffer(r.take(2 * kq), dtype=">f2")
            msg = Verify(req, base_len, draft, auth=auth, context=context)
            if kq:
                msg.q_ids, msg.q_probs = q_ids, q_probs
        elif t == FUSE:
            req, base_len, auth, context = r.request_head()
            (m,) = r.unpack(_U8)
            committed = r.ids(m).tolist()
            (k,) = r.unpack(_U16)
            msg = Fuse(req, base_len, committed, k, auth=auth, context=context)
        elif t == IDENTIFY:
            msg = Identify(bytes(r.take(IDENTIFY_KEY_BYTES)), bytes(r.take(IDENTIFY_SIG_BYTES)))
        elif t == AUTH:
            msg = Auth(r.auth())
        elif t == AUTHED:
            (held,) = r.unpack(_U32)
            msg = Authed(held)
        elif t == CLOSE:
            msg = Close()
        elif t == OPENED:
            h = r.json()
            msg = Opened(str(h["model"]), str(h["fingerprint"]), int(h["context_len"]))
        elif t == VERIFIED:
            req, acc, tok = r.unpack(_VERIFIED)
            msg = Verified(req, acc, tok)
        elif t == TOPK:
            req, k = r.unpack(_TOPK_HEAD)
            ids = r.ids(k)
            q = np.frombuffer(r.take(k), dtype=np.uint8).copy()
            top, scale, tail = np.frombuffer(r.take(6), dtype=">f2").astype(np.float32)
            msg = TopK(req, ids, q, float(top), float(scale), float(tail))
        else:
            h = r.json()
            msg = Error(str(h.get("code", "unknown")), str(h.get("message", "")))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # int(1e400): OverflowError
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"{TYPE_NAMES[t]} message has a bad field: {exc!r:.200}") from None
    r.end()
    return msg


def message_type(data: bytes) -> str:
    """The type name of a plaintext message (for logs), ``"?"`` if unknown."""
    return TYPE_NAMES.get(data[0], "?") if data else "?"
