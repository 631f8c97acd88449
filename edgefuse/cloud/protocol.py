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
                            flag_cache, l_cache, offset[, split]} ‖ int32[n] prompt ids
                            (split: {k, m, head_split, act, mask}; a split OPEN has n = 0)
    VERIFY    device→cloud  u32 req ‖ u32 base_len ‖ AUTH5 ‖ u32 c ‖ int32[c] context
                            ‖ u8 γ ‖ int32[γ] draft ids
                            ‖ u8 kq ‖ γ × (int32[kq] ids ‖ f16[kq] q-probs)   (kq = 0: greedy)
    FUSE      device→cloud  u32 req ‖ u32 base_len ‖ AUTH5 ‖ u32 c ‖ int32[c] context
                            ‖ u8 m ‖ int32[m] committed ids ‖ u16 k
    AUTH      device→cloud  AUTH5
    CLOSE     device→cloud  (empty)
    MID       device→cloud  u32 req ‖ u32 base_len ‖ AUTH5 ‖ u32 c ‖ u32 n ‖ acts[c + n]
    HEAD      device→cloud  u32 req ‖ u32 n ‖ u16 k ‖ acts[n] of the D − s tail columns
    MASK      device→cloud  bitmap of the vocabulary (⌈V/8⌉ bytes, bit i = id i, LSB first)
    OPENED    cloud→device  u16 len ‖ JSON {model, fingerprint, context_len[, split]}
    VERIFIED  cloud→device  u32 req ‖ u8 accepted ‖ int32 token
    TOPK      cloud→device  u32 req ‖ u16 k ‖ int32[k] ids ‖ uint8[k] q ‖ f16 top ‖ f16 scale
                            ‖ f16 tail
    AUTHED    cloud→device  u32 held   (committed tokens the cloud holds after the AUTH)
    MIDOUT    cloud→device  u32 req ‖ u32 n ‖ acts[n]
    LOGITS    cloud→device  u32 req ‖ the masked partial logits (:mod:`edgefuse.cloud.vocab`)
    MASKED    cloud→device  u32 count  (ids in the mask the cloud now uses)
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

Split inference (MID / HEAD / MASK; the cloud side is :mod:`edgefuse.cloud.split_target`,
the math :mod:`edgefuse.cloud.split`): the device runs the embeddings and the first ``k``
decoder layers and the last ``m`` (+ the final norm and its share of the LM head), the cloud
only the middle layers, and it never sees token ids. A split OPEN carries no prompt ids (a
ProtocolError if it does): the prompt travels as activations in the first MID. ``acts[r]``
is ``r`` rows of the session's ``act`` encoding (``int8``: per row a float16 absmax scale
then D int8 values; ``float16``: D raw float16 values); D is the cloud's own hidden size,
never read from the wire, and the body's length must be exactly ``acts_nbytes(r, D, act)``.
A MID's ``base_len`` is the rows the device commits: the cloud's rows past it (the previous
MID's drafted positions) are rolled back, valid iff committed ≤ base_len ≤ committed +
pending (else ERROR ``sync``); its ``c`` rows are the re-sent window (exactly as VERIFY's
context, :class:`SplitLedger`), its ``n`` rows the positions base_len .. base_len + n − 1
(absolute positions everywhere), answered by MIDOUT with the middle's output for those n.
HEAD (split head, ``s`` = head_split) sends the tail columns of the final hidden state of
n rows, answered by LOGITS: the partial logits over the session's vocabulary mask (its top
``k`` within the mask, 0 = the whole mask). MASK sets an ``explicit`` mask.

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

OPEN, VERIFY, FUSE, CLOSE, AUTH, IDENTIFY, MID, HEAD, MASK = 1, 2, 3, 4, 5, 6, 7, 8, 9
OPENED, VERIFIED, TOPK, AUTHED, MIDOUT, LOGITS, MASKED, ERROR = 101, 102, 103, 104, 105, 106, 107, 127
TYPE_NAMES = {OPEN: "OPEN", VERIFY: "VERIFY", FUSE: "FUSE", CLOSE: "CLOSE", AUTH: "AUTH",
              IDENTIFY: "IDENTIFY", MID: "MID", HEAD: "HEAD", MASK: "MASK", OPENED: "OPENED",
              VERIFIED: "VERIFIED", TOPK: "TOPK", AUTHED: "AUTHED", MIDOUT: "MIDOUT",
              LOGITS: "LOGITS", MASKED: "MASKED", ERROR: "ERROR"}
MAX_GAMMA = 255
MAX_TOPK = 1024
L_UNLIMITED = 0xFFFFFFFF  # l_cache on the wire for "no limit"
SPLIT_ACTS = ("int8", "float16")  # activation encodings a split session may use
SPLIT_KEYS = ("k", "m", "head_split", "act", "mask")
MAX_SPLIT_INT = 1 << 20  # k, m, head_split on the wire (the cloud checks them against its model)
MAX_MASK_NAME = 32  # characters of a mask name
MAX_HEAD_ROWS = MAX_GAMMA + 1  # rows of one HEAD (a verified block: γ drafts + 1)
# the header bytes of a MID before its acts: type, req, base_len, AUTH5, c, n
MID_HEADER_BYTES = 1 + 4 + 4 + 5 + 4 + 4


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


def _wire_int(name: str, v, lo: int = 0, hi: int = MAX_SPLIT_INT) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        raise ProtocolError(f"split {name} must be an int in {lo}..{hi}, got {v!r:.40}")
    return int(v)


@dataclass(frozen=True)
class SplitRequest:
    """A split OPEN's ``split`` field: the device holds layers ``[0, k)`` and the last ``m``
    (+ the final norm and the head's first ``head_split`` columns; None = the whole head),
    the cloud the middle; ``act``: the activation encoding (:data:`SPLIT_ACTS`); ``mask``:
    the vocabulary mask of a split head (a name of :data:`edgefuse.cloud.vocab.MASK_NAMES`,
    ``"explicit"`` = a MASK follows, None without a split head). Only the wire types are
    checked here (:class:`ProtocolError`); whether the cloud's model and its policy allow
    the split is the cloud's check (ERROR ``split``)."""
    k: int
    m: int
    head_split: int | None = None
    act: str = "int8"
    mask: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "k", _wire_int("k", self.k))
        object.__setattr__(self, "m", _wire_int("m", self.m))
        if self.head_split is not None:
            object.__setattr__(self, "head_split", _wire_int("head_split", self.head_split))
        if not isinstance(self.act, str) or self.act not in SPLIT_ACTS:
            raise ProtocolError(f"split act must be one of {SPLIT_ACTS}, got {self.act!r:.40}")
        if self.mask is not None and (not isinstance(self.mask, str)
                                      or not 1 <= len(self.mask) <= MAX_MASK_NAME):
            raise ProtocolError(f"split mask must be null or a name of 1..{MAX_MASK_NAME} "
                                f"characters, got {self.mask!r:.40}")

    def to_dict(self) -> dict:
        return {"k": self.k, "m": self.m, "head_split": self.head_split, "act": self.act,
                "mask": self.mask}

    @classmethod
    def from_dict(cls, d) -> "SplitRequest":
        """Parse the JSON object; raises :class:`ProtocolError` for a non-object, a missing
        ``k`` / ``m``, an unknown key or a value of the wrong type or range."""
        if not isinstance(d, dict):
            raise ProtocolError(f"split must be a JSON object, got {type(d).__name__}")
        extra = sorted(set(d) - set(SPLIT_KEYS))
        if extra:
            raise ProtocolError(f"split has unknown keys {extra[:4]!r:.80}")
        if "k" not in d or "m" not in d:
            raise ProtocolError("split needs k and m")
        return cls(d["k"], d["m"], d.get("head_split"), d.get("act", "int8"), d.get("mask"))


@dataclass
class SplitLedger:
    """The row bookkeeping of a split session, the same arithmetic on both ends (the cloud's
    :class:`edgefuse.cloud.split_target.SplitSession` and the device): the CloudAuth rule of
    VERIFY applied to middle-layer rows.

    ``committed``: rows the device committed (the last MID's ``base_len``, or OPEN's
    ``offset``); ``pending``: the last MID's ``n`` rows (drafted positions past
    ``committed``); ``held``: the committed rows (the newest) whose input activations the
    cloud keeps; ``pending_held``: of the pending rows, those it keeps (all or none).

    - between requests the cloud keeps the last ``auth.held(committed)`` committed rows and,
      while ``flag_cache`` and ``l_cache != 0``, the pending rows; nothing under
      ``flag_cache`` = 0 (each MID re-sends its whole window);
    - a MID with ``base_len`` = B (valid iff committed ≤ B ≤ committed + pending) rolls the
      pending rows past B back; it needs the last ``auth.window(B)`` committed rows: the held
      ones (a suffix ending at B) and ``c`` = :meth:`resend` rows just before them;
    - once answered: committed = B, pending = n, held = ``auth.held(B)``.
    """
    committed: int = 0
    pending: int = 0
    held: int = 0
    pending_held: int = 0

    @staticmethod
    def keeps_pending(auth: CloudAuth) -> bool:
        """Whether ``auth`` lets the cloud keep a MID's rows until the next one."""
        return auth.flag_cache and auth.l_cache != 0

    def apply(self, auth: CloudAuth) -> int:
        """A new tuple takes effect (an AUTH, or a MID's own tuple first): evict what it no
        longer allows. Returns the rows dropped (any: the middle KV is dropped too)."""
        keep = min(self.held, auth.held(self.committed))
        keep_p = self.pending_held if self.keeps_pending(auth) else 0
        dropped = (self.held - keep) + (self.pending_held - keep_p)
        self.held, self.pending_held = keep, keep_p
        return dropped

    def check(self, base_len: int) -> None:
        """Raises :class:`SyncError` unless committed ≤ base_len ≤ committed + pending."""
        if not self.committed <= base_len <= self.committed + self.pending:
            raise SyncError(f"MID base_len {base_len} outside {self.committed}.."
                            f"{self.committed + self.pending} (committed {self.committed}, "
                            f"{self.pending} pending rows)")

    def held_at(self, base_len: int) -> int:
        """Rows the cloud holds of the first ``base_len`` once the pending rows past it are
        rolled back: a suffix ending at ``base_len`` (0 if a pending row before it is not
        held). Call after :meth:`check`."""
        extra = base_len - self.committed
        if extra > self.pending_held:
            return 0
        return self.held + extra

    def resend(self, auth: CloudAuth, base_len: int) -> int:
        """``c``: the rows a MID with ``auth`` and ``base_len`` must re-send (the window's
        rows the cloud does not hold), on a ledger ``auth`` was applied to."""
        return max(auth.window(base_len) - min(self.held_at(base_len), auth.window(base_len)), 0)

    def commit(self, auth: CloudAuth, base_len: int, n: int) -> None:
        """A MID (``base_len``, ``n`` new rows) was answered."""
        self.committed, self.pending = int(base_len), int(n)
        self.held = auth.held(self.committed)
        self.pending_held = self.pending if self.keeps_pending(auth) else 0


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
    split: SplitRequest | None = None


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
class Mid:
    """Split inference: the device's front-layer output rows for the cloud's middle layers.

    ``base_len``: rows the device commits (the cloud rolls its rows past it back);
    ``c``: re-sent window rows (:meth:`SplitLedger.resend`); ``n``: new rows (positions
    ``base_len .. base_len + n - 1``); ``acts``: the ``c + n`` rows in the session's
    encoding (``acts_nbytes(c + n, D, act)`` bytes, checked by the cloud);
    ``auth``: the cache tuple, as VERIFY's."""
    req: int
    base_len: int
    c: int
    n: int
    acts: bytes
    auth: CloudAuth = field(default_factory=CloudAuth)


@dataclass
class MidOut:
    """The middle layers' output for a MID's ``n`` new rows (``acts``: ``n`` rows)."""
    req: int
    n: int
    acts: bytes


@dataclass
class Head:
    """Split head: the tail columns (``D - head_split``) of ``n`` final hidden rows;
    ``k``: the top-k within the mask wanted back (0 = the whole mask)."""
    req: int
    n: int
    k: int
    acts: bytes


@dataclass
class Logits:
    """The cloud's partial logits over the session's mask: ``payload`` is
    :func:`edgefuse.cloud.vocab.encode_masked`'s bytes."""
    req: int
    payload: bytes


@dataclass
class Mask:
    """An explicit vocabulary mask: ``bitmap`` (⌈V/8⌉ bytes, bit i = id i, LSB first)."""
    bitmap: bytes


@dataclass
class Masked:
    """``count``: ids in the mask the session now uses."""
    count: int


@dataclass
class Opened:
    """The session is open; ``split``: the accepted split (echoed), None for a plain one."""
    model: str
    fingerprint: str
    context_len: int
    split: SplitRequest | None = None


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


Message = (Identify | Open | Verify | Fuse | Auth | Close | Mid | Head | Mask | Opened | Verified
           | TopK | Authed | MidOut | Logits | Masked | Error)

_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")
_REQ = struct.Struct(">II")  # req, base_len
_AUTH = struct.Struct(">BI")  # flag_cache, l_cache
_VERIFIED = struct.Struct(">IBi")
_TOPK_HEAD = struct.Struct(">IH")
_MID_COUNTS = struct.Struct(">II")  # c, n
_REQ_N = struct.Struct(">II")  # req, n
_HEAD = struct.Struct(">IIH")  # req, n, k


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


def _check_u32(kind: str, **fields) -> None:
    for name, v in fields.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) <= 0xFFFFFFFF:
            raise ProtocolError(f"{kind} {name} must be an int in 0..{0xFFFFFFFF}, got {v!r:.40}")


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
        if msg.split is not None:
            if not isinstance(msg.split, SplitRequest):
                raise ProtocolError(f"split must be a SplitRequest, got {type(msg.split).__name__}")
            if len(msg.prompt):
                raise ProtocolError("a split OPEN carries no prompt ids (the prompt goes as "
                                    "activations in the first MID)")
            head["split"] = msg.split.to_dict()
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
    if isinstance(msg, Mid):
        _check_u32("MID", req=msg.req, base_len=msg.base_len, c=msg.c, n=msg.n)
        return (bytes([MID]) + _REQ.pack(msg.req, msg.base_len) + _auth(msg.auth)
                + _MID_COUNTS.pack(msg.c, msg.n) + bytes(msg.acts))
    if isinstance(msg, MidOut):
        _check_u32("MIDOUT", req=msg.req, n=msg.n)
        return bytes([MIDOUT]) + _REQ_N.pack(msg.req, msg.n) + bytes(msg.acts)
    if isinstance(msg, Head):
        _check_u32("HEAD", req=msg.req, n=msg.n)
        if not 0 <= msg.k <= 0xFFFF:
            raise ProtocolError(f"HEAD k {msg.k} out of range 0..65535")
        return bytes([HEAD]) + _HEAD.pack(msg.req, msg.n, msg.k) + bytes(msg.acts)
    if isinstance(msg, Logits):
        _check_u32("LOGITS", req=msg.req)
        return bytes([LOGITS]) + _U32.pack(msg.req) + bytes(msg.payload)
    if isinstance(msg, Mask):
        return bytes([MASK]) + bytes(msg.bitmap)
    if isinstance(msg, Masked):
        _check_u32("MASKED", count=msg.count)
        return bytes([MASKED]) + _U32.pack(msg.count)
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
        head = {"model": msg.model, "fingerprint": msg.fingerprint,
                "context_len": int(msg.context_len)}
        if msg.split is not None:
            head["split"] = msg.split.to_dict()
        return bytes([OPENED]) + _json(head)
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

    def rest(self) -> bytes:
        """Every byte left (a message's variable-length tail)."""
        return bytes(self.take(len(self.data) - self.pos))

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
            split = h.get("split")
            if split is not None:
                split = SplitRequest.from_dict(split)
                if prompt:
                    raise ProtocolError(f"a split OPEN carries no prompt ids, this one has "
                                        f"{len(prompt)} (the prompt goes as activations in "
                                        f"the first MID)")
            msg = Open(prompt=prompt, fingerprint=str(h["fingerprint"]),
                       temperature=float(h["temperature"]), top_k=int(h["top_k"]),
                       seed=int(h["seed"]), max_new=int(h["max_new"]),
                       auth=CloudAuth(h["flag_cache"], h["l_cache"]), offset=offset,
                       split=split)
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
        elif t == MID:
            req, base_len = r.unpack(_REQ)
            auth = r.auth()
            c, n = r.unpack(_MID_COUNTS)
            msg = Mid(req, base_len, c, n, r.rest(), auth=auth)
        elif t == MIDOUT:
            req, n = r.unpack(_REQ_N)
            msg = MidOut(req, n, r.rest())
        elif t == HEAD:
            req, n, k = r.unpack(_HEAD)
            msg = Head(req, n, k, r.rest())
        elif t == LOGITS:
            (req,) = r.unpack(_U32)
            msg = Logits(req, r.rest())
        elif t == MASK:
            msg = Mask(r.rest())
        elif t == MASKED:
            (count,) = r.unpack(_U32)
            msg = Masked(count)
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
            split = h.get("split")
            msg = Opened(str(h["model"]), str(h["fingerprint"]), int(h["context_len"]),
                         None if split is None else SplitRequest.from_dict(split))
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
