"""Decoding on the device, alone or together with the cloud over a :class:`edgefuse.cloud.link.CloudLink`.

Modes (``MODES``):

- ``edge``: the edge SLM alone (its own LoRA merged in), no link.
- ``cloud``: remote autoregressive decoding — one VERIFY with γ = 0 per token, so one round
  trip per token; the reference output of the target.
- ``spec_sync``: speculative decoding. The device drafts γ tokens, the cloud verifies them
  in one forward pass and answers (accepted, next token); both sides roll back what was
  rejected. γ adapts to the acceptance rate and the RTT (:class:`GammaController`).
- ``spec_async``: pipelined speculative decoding. While block k is in flight the device
  guesses the cloud's next token and drafts block k+1 on top of it; when the answer shows
  the guess right (all of block k accepted and the token equals the guess) block k+1 is
  sent at once, otherwise it is discarded and the device rolls back. Drafting overlaps the
  RTT and the cloud's verify, and the block length follows what fits in one round trip.
- ``fusion_static`` / ``fusion_adaptive``: per token the device fuses its log-probabilities
  with the cloud's top-k (:mod:`edgefuse.cloud.fusion`); a per-token deadline makes the device emit
  its own token when the cloud is late (the cloud stays in sync because every request
  carries the tokens the device committed).

Speculative modes are lossless: greedy output equals ``cloud``'s token for token and
sampled output has the target's distribution. If the cloud goes away mid-generation every
mode carries on edge-only and says so in :attr:`DecodeResult.fallback`.

Every link mode runs under :attr:`DecodeConfig.auth`, the endpoint-authorized cache control
(flagCache, LCache) of the edge–cloud seed design (:class:`edgefuse.cloud.protocol.CloudAuth`): the
OPEN and every request carry the tuple, the device mirrors what the cloud holds
(``auth.held``) and re-sends as ``context`` what the request's window (``auth.window``)
needs beyond it (with ``flag_cache`` off: the last ``l_cache`` committed tokens, or all of
them, every request). Under a window the cloud's model is the target restricted to the last
``l_cache`` tokens before each position, so ``cloud`` and greedy ``spec_*`` still agree
token for token.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from edgefuse.cloud import protocol as P
from edgefuse.cloud.fusion import FusionConfig, fuse
from edgefuse.cloud.protocol import CloudAuth
from edgefuse.cloud.speculative import GammaController, draft_q, sample_sparse, sparse_q
from edgefuse.cloud.target import batched_forward, cache_from_layers

MODES = ("edge", "cloud", "spec_sync", "spec_async", "fusion_static", "fusion_adaptive")
LINK_MODES = tuple(m for m in MODES if m != "edge")


class DecodeError(ValueError):
    """Bad decoding settings (unknown mode, out-of-range values)."""


@dataclass
class DecodeConfig:
    """Settings shared by all modes.

    ``max_new_tokens``: tokens to generate (at most); ``temperature``: 0 = greedy;
    ``top_k``: the target's sampling top-k (0 = none); ``seed``: sampling seed;
    ``gamma``: fixed γ, or None to adapt within [gamma_min, gamma_max]; ``draft_topk``: the
    draft's sparse q size at temperature > 0; ``fuse_topk``: the cloud's top-k for fusion;
    ``fusion``: weights (see :class:`FusionConfig`); ``deadline_ms``: per-token deadline of
    fusion (ms from request to answer); ``timeout_s``: a request unanswered this long (for
    fusion: no answer at all for this long) means the cloud is gone (s); ``auth``: the
    cloud cache tuple (flagCache, LCache) every request carries (default: keep all)."""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    gamma: int | None = None
    gamma_min: int = 1
    gamma_max: int = 8
    draft_topk: int = 16
    fuse_topk: int = 16
    fusion: FusionConfig = field(default_factory=FusionConfig)
    deadline_ms: float = 1000.0
    timeout_s: float = 60.0
    auth: CloudAuth = field(default_factory=CloudAuth)

    def __post_init__(self):
        if not isinstance(self.auth, CloudAuth):
            raise DecodeError(f"auth must be a CloudAuth, got {type(self.auth).__name__}")
        if self.max_new_tokens < 1:
            raise DecodeError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise DecodeError(f"temperature must be >= 0, got {self.temperature}")
        if self.gamma is not None and not 0 <= self.gamma <= P.MAX_GAMMA:
            raise DecodeError(f"gamma must be in 0..{P.MAX_GAMMA}, got {self.gamma}")
        if not 1 <= self.gamma_min <= self.gamma_max <= P.MAX_GAMMA:
            raise DecodeError(f"need 1 <= gamma_min <= gamma_max <= {P.MAX_GAMMA}")
        if not 1 <= self.draft_topk <= 255 or not 1 <= self.fuse_topk <= P.MAX_TOPK:
            raise DecodeError("draft_topk must be in 1..255 and fuse_topk in 1..1024")
        if not self.deadline_ms > 0 or not self.timeout_s > 0:
            raise DecodeError("deadline_ms and timeout_s must be > 0")


def auth_from_config(privacy_cfg) -> CloudAuth:
    """The cloud cache tuple of a ``privacy`` config group (``privacy.cloud_auth.{flag_cache,
    l_cache}``, ``conf/privacy/default.yaml``; l_cache null = unlimited); a group without
    ``cloud_auth`` gives the default (keep all). Raises :class:`DecodeError` for values of
    the wrong type or range."""
    ca = privacy_cfg.get("cloud_auth") if hasattr(privacy_cfg, "get") else \
        getattr(privacy_cfg, "cloud_auth", None)
    if ca is None:
        return CloudAuth()
    get = ca.get if hasattr(ca, "get") else (lambda k, d=None: getattr(ca, k, d))
    try:
        return CloudAuth(get("flag_cache", True), get("l_cache", None))
    except P.ProtocolError as exc:
        raise DecodeError(f"privacy.cloud_auth: {exc}") from None


def decode_config(c, auth: CloudAuth | None = None) -> DecodeConfig:
    """The :class:`DecodeConfig` of a ``cloud`` config group (``conf/cloud/default.yaml``),
    with the cloud cache tuple ``auth`` (None = keep all; see :func:`auth_from_config`).
    Raises :class:`DecodeError` / ``ValueError`` for out-of-range settings."""
    d = c.decode
    if int(d.top_k) < 0:
        raise DecodeError(f"cloud.decode.top_k must be >= 0, got {d.top_k}")
    return DecodeConfig(
        max_new_tokens=int(c.eval.max_new_tokens), temperature=float(d.temperature),
        top_k=int(d.top_k), seed=0, gamma=None if d.gamma is None else int(d.gamma),
        gamma_max=int(d.gamma_max), draft_topk=int(d.draft_topk), fuse_topk=int(d.fuse_topk),
        fusion=FusionConfig(weight=float(d.fusion_weight), confidence=str(d.confidence)),
        deadline_ms=float(d.deadline_ms), timeout_s=float(d.timeout_s),
        auth=auth if auth is not None else CloudAuth())


def check_config(cfg) -> None:
    """Check the ``cloud`` section at compose time (nothing when ``cloud.enabled`` is false).

    Raises:
        ConfigError: a ``device_model`` no client runs, an unknown mode or WAN preset, or an
            out-of-range decoding setting.
    """
    from omegaconf import OmegaConf

    from edgefuse.config import ConfigError, positive_int

    cloud = cfg.get("cloud")
    if cloud is None or not cloud.get("enabled"):
        return
    from edgefuse.transport.wan import WanProfile

    models = [str(c.model) for c in cfg.federation.clients]
    if str(cloud.device_model) not in models:
        raise ConfigError(f"cloud.device_model {cloud.device_model!r} is not a federation client's "
                          f"model ({', '.join(dict.fromkeys(models))})")
    unknown = sorted(set(map(str, cloud.modes)) - set(MODES))
    if unknown or not cloud.modes:
        raise ConfigError(f"cloud.modes has unknown modes {unknown or '[]'}: use {', '.join(MODES)}")
    try:
        WanProfile.from_name(str(cloud.wan))
    except ValueError as e:
        raise ConfigError(f"cloud.wan: {e}") from None
    for key in ("cloud.devices", "cloud.eval.max_new_tokens", "cloud.eval.max_prompt_tokens",
                "cloud.service.max_batch", "cloud.service.max_context", "cloud.decode.gamma_max",
                "cloud.decode.fuse_topk", "cloud.decode.draft_topk"):
        positive_int(OmegaConf.select(cfg, key), key)
    if int(cloud.eval.gsm8k_n) < 0 or int(cloud.eval.dolly_per_category) < 0 or \
            int(cloud.eval.gsm8k_n) + int(cloud.eval.dolly_per_category) == 0:
        raise ConfigError("cloud.eval needs gsm8k_n > 0 or dolly_per_category > 0 (both >= 0)")
    if float(cloud.decode.temperature) < 0:
        raise ConfigError(f"cloud.decode.temperature must be >= 0, got {cloud.decode.temperature}")
    try:
        decode_config(cloud)
    except ValueError as e:  # DecodeError and FusionConfig's checks
        raise ConfigError(f"cloud.decode: {e}") from None
    if float(cloud.service.max_wait_ms) < 0 or int(cloud.devices) > int(cloud.service.max_sessions):
        raise ConfigError("cloud.service.max_wait_ms must be >= 0 and cloud.devices <= "
                          "cloud.service.max_sessions")
    if str(cloud.decode.confidence) not in ("entropy", "margin"):
        raise ConfigError(f"cloud.decode.confidence must be entropy or margin, got {cloud.decode.confidence!r}")
    if not 0 <= float(cloud.decode.fusion_weight) <= 1:
        raise ConfigError(f"cloud.decode.fusion_weight must be in [0, 1], got {cloud.decode.fusion_weight}")


@dataclass
class DecodeResult:
    """One generation. Times in seconds, bytes as counted on the socket (length prefixes and
    AES-GCM framing included, handshake excluded), tokens = generated tokens."""
    mode: str
    tokens: list[int]
    text: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    prefill_bytes_up: int = 0
    prefill_bytes_down: int = 0
    drafted: int = 0
    accepted: int = 0
    blocks: int = 0
    deadline_misses: int = 0
    edge_weight_mean: float | None = None
    fallback: str | None = None

    @property
    def n(self) -> int:
        return max(len(self.tokens), 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.n

    @property
    def round_trips_per_token(self) -> float:
        return self.round_trips / self.n

    @property
    def bytes_up_per_token(self) -> float:
        return self.bytes_up / self.n

    @property
    def bytes_down_per_token(self) -> float:
        return self.bytes_down / self.n

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def summary(self) -> dict:
        """A JSON-ready dict of the counters and the per-token figures."""
        out = {k: v for k, v in asdict(self).items() if k != "tokens"}
        out.update(new_tokens=len(self.tokens), tokens_per_s=self.tokens_per_s,
                   ms_per_token=self.ms_per_token, round_trips_per_token=self.round_trips_per_token,
                   bytes_up_per_token=self.bytes_up_per_token,
                   bytes_down_per_token=self.bytes_down_per_token,
                   acceptance_rate=self.acceptance_rate)
        return out


class DraftBatcher:
    """Runs the forward passes of simulated devices that share one edge model as one batched
    pass, each device keeping its own KV cache (:func:`edgefuse.cloud.target.batched_forward`).

    An emulation aid, not something a real device does: real devices compute in parallel on
    their own hardware, while N simulated devices in one process would queue behind each
    other on the host's cores. The first caller waits ``max_wait_ms`` (ms) for the others,
    then runs everyone's step at once; each caller gets its own rows back. Thread-safe."""

    def __init__(self, model, pad_id: int, max_wait_ms: float = 2.0):
        self.body = model.get_decoder()
        self.pad_id = int(pad_id)
        self.max_wait_s = max_wait_ms / 1000
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self.batches = 0
        self.rows = 0

    def run(self, layers, past: int, ids: list[int]) -> tuple[torch.Tensor, list]:
        """Feed ``ids`` after ``past`` cached positions (``layers``: ``[(k, v)]`` or None);
        returns the hidden states ``[len(ids), H]`` and the new cache layers. Re-raises the
        batch's error in every caller."""
        slot = {"req": (layers, past, list(ids)), "done": threading.Event()}
        with self._lock:
            self._pending.append(slot)
            leader = len(self._pending) == 1
        if leader:
            time.sleep(self.max_wait_s)
            with self._lock:
                batch, self._pending = self._pending, []
            try:
                outs, kvs = batched_forward(self.body, [b["req"][0] for b in batch],
                                            [b["req"][1] for b in batch], [b["req"][2] for b in batch],
                                            self.pad_id, output="last_hidden_state")
                for b, o, kv in zip(batch, outs, kvs):
                    b["out"] = (o, kv)
                self.batches += 1
                self.rows += len(batch)
            except BaseException as exc:  # every waiting device gets the error
                for b in batch:
                    b["error"] = exc
            finally:
                for b in batch:
                    b["done"].set()
        slot["done"].wait()
        if "error" in slot:
            raise slot["error"]
        return slot["out"]


def _crop(cache: DynamicCache, n: int) -> None:
    """Keep the first ``n`` positions of ``cache`` (transformers 5 ``crop`` takes a negative
    count of positions to drop)."""
    drop = cache.get_seq_length() - n
    if drop > 0:
        cache.crop(-drop)


class EdgeLM:
    """The device's language model with a rollback-able KV cache.

    ``tokens`` are the committed + drafted ids; the cache holds all of them but possibly the
    last few, which :meth:`logits` feeds. ``head``: an optional cheap draft head (an object
    with ``keep_ids`` LongTensor[N] and ``logits(hidden[B, T, H]) -> [B, T, N]``, e.g.
    :class:`edgefuse.cloud.decoding.drafters.DraftHead`) used by :meth:`draft_logits`; output tokens of the edge
    itself always come from the full head. ``batcher``: a :class:`DraftBatcher` shared by
    simulated devices that share this model."""

    def __init__(self, model, tok, head=None, batcher: DraftBatcher | None = None):
        self.model = model.eval()
        self.tok = tok
        self.head = head
        self.batcher = batcher
        self.vocab_size = int(model.config.vocab_size)
        self.tokens: list[int] = []
        self.cache = DynamicCache()
        eos = tok.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        for extra in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>"):
            i = tok.convert_tokens_to_ids(extra) if extra in tok.get_vocab() else None
            if i is not None:
                self.eos_ids.add(int(i))

    def start(self, prompt: list[int]) -> None:
        """Prefill ``prompt`` (all ids but the last go into the cache)."""
        self.tokens = list(prompt)
        self.cache = DynamicCache()
        self._hidden()

    def push(self, token: int) -> None:
        self.tokens.append(int(token))

    def rollback(self, n: int) -> None:
        """Keep the first ``n`` tokens; the cache is cropped to match."""
        self.tokens = self.tokens[:n]
        _crop(self.cache, n)

    @torch.no_grad()
    def _hidden(self) -> torch.Tensor | None:
        """Feed the uncached tokens (at least the last one); the last hidden state [H]."""
        past = self.cache.get_seq_length()
        if past >= len(self.tokens):
            past = len(self.tokens) - 1
            _crop(self.cache, past)
        if self.batcher is not None:
            layers = [(la.keys, la.values) for la in self.cache.layers] if past else None
            hidden, kv = self.batcher.run(layers, past, self.tokens[past:])
            self.cache = cache_from_layers(kv)
            return hidden[-1]
        ids = torch.tensor([self.tokens[past:]])
        pos = torch.arange(past, len(self.tokens)).unsqueeze(0)
        out = self.model.get_decoder()(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.last_hidden_state[0, -1]

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        """Full-vocabulary next-token logits ``float32[V]``."""
        h = self._hidden()
        return self.model.get_output_embeddings()(h).float()

    @torch.no_grad()
    def draft_logits(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits for drafting and the id map: ``(logits[N], keep_ids[N])`` with the
        cheap head, ``(logits[V], None)`` without."""
        h = self._hidden()
        if self.head is None:
            return self.model.get_output_embeddings()(h).float(), None
        return self.head.logits(h.view(1, 1, -1))[0, 0].float(), self.head.keep_ids


def _pick(logits: torch.Tensor, keep: torch.Tensor | None, cfg: DecodeConfig,
          gen: torch.Generator) -> tuple[int, np.ndarray | None, np.ndarray | None]:
    """One token from ``logits`` (greedy or from the sparse q); returns (id, q_ids, q_probs)."""
    if cfg.temperature == 0:
        i = int(torch.argmax(logits))
        return (int(keep[i]) if keep is not None else i), None, None
    ids, probs = draft_q(logits, cfg.temperature, cfg.draft_topk)
    if keep is not None:
        ids = keep[torch.as_tensor(ids)].numpy().astype(np.int64)
    q_ids, q = sparse_q(ids, probs)
    return sample_sparse(q_ids, q, gen), ids, probs


def _poll(link):
    """The next message if one has arrived, else None (never waits)."""
    try:
        return link.recv(timeout_s=0)
    except TimeoutError:
        return None


def _stop(tokens: list[int], eos_ids: set[int], max_new: int) -> tuple[list[int], bool]:
    """Cut ``tokens`` at the first EOS (dropped) or at ``max_new``; returns (tokens, done)."""
    for i, t in enumerate(tokens[:max_new]):
        if t in eos_ids:
            return tokens[:i], True
    return tokens[:max_new], len(tokens) >= max_new


class Decoder:
    """Runs one mode for one prompt on the device.

    Args:
        edge: the device's :class:`EdgeLM`.
        link: a connected :class:`edgefuse.cloud.link.CloudLink` (None: only ``edge`` works).
        fingerprint: the edge tokenizer's fingerprint (:func:`edgefuse.cloud.target.tokenizer_fingerprint`).
        rtt_ms: the link's RTT the γ controller assumes (ms; e.g. the WAN preset's).
    """

    def __init__(self, edge: EdgeLM, link=None, fingerprint: str = "", rtt_ms: float = 20.0):
        self.edge, self.link, self.fingerprint = edge, link, fingerprint
        self.rtt_ms = rtt_ms
        self.draft_ms = 50.0
        self.verify_ms = 100.0
        self._req = 0
        self._held = 0  # mirror: committed tokens the cloud holds after the last request

    # -- public ----------------------------------------------------------------------

    def generate(self, mode: str, prompt: list[int], cfg: DecodeConfig) -> DecodeResult:
        """Generate up to ``cfg.max_new_tokens`` after ``prompt`` in ``mode``.

        Raises :class:`DecodeError` for an unknown mode or a link mode without a link, and
        :class:`edgefuse.cloud.protocol.RemoteError` when the cloud refuses the session (``fingerprint``:
        another tokenizer; ``context``: too long). The cloud sees only what ``cfg.auth``
        lets it keep and attend to. A cloud that is unreachable, busy, or fails
        mid-way does not raise: the rest is edge-only (``fallback`` says so)."""
        if mode not in MODES:
            raise DecodeError(f"unknown decoding mode {mode!r}; choose from {', '.join(MODES)}")
        if mode != "edge" and self.link is None:
            raise DecodeError(f"mode {mode!r} needs a cloud link")
        res = DecodeResult(mode=mode, tokens=[])
        gen = torch.Generator().manual_seed(cfg.seed)
        t0 = time.perf_counter()
        c0 = self._counters()
        self.edge.start(prompt)
        if mode != "edge":
            try:
                self._open(prompt, cfg)
            except (ConnectionError, TimeoutError, OSError, P.RemoteError) as exc:
                if isinstance(exc, P.RemoteError) and exc.code != "busy":
                    raise  # a refused pair (fingerprint, context) is an error, not an outage
                res.fallback = f"cloud unavailable at the start ({exc}); edge only"
                mode = "edge"
        t1 = time.perf_counter()
        res.prefill_s = t1 - t0
        c1 = self._counters()
        res.prefill_bytes_up, res.prefill_bytes_down = c1[0] - c0[0], c1[1] - c0[1]
        try:
            if mode == "edge":
                self._edge_only(prompt, cfg, gen, res)
            elif mode in ("cloud", "spec_sync"):
                self._speculative(prompt, cfg, gen, res, gamma0=(mode == "cloud"))
            elif mode == "spec_async":
                self._speculative_async(prompt, cfg, gen, res)
            else:
                fcfg = cfg.fusion
                if (mode == "fusion_adaptive") != fcfg.adaptive:
                    fcfg = FusionConfig(**{**asdict(fcfg), "adaptive": mode == "fusion_adaptive"})
                self._fusion(prompt, cfg, fcfg, gen, res)
        finally:
            res.decode_s = time.perf_counter() - t1
            if mode != "edge" and res.fallback is None:
                self.link.send(P.Close())  # frees the cloud's cache; the connection stays
            c2 = self._counters()
            res.bytes_up, res.bytes_down, res.round_trips = (c2[i] - c1[i] for i in range(3))
        res.text = self.edge.tok.decode(res.tokens, skip_special_tokens=True)
        return res

    def _open(self, prompt: list[int], cfg: DecodeConfig) -> None:
        """Start a session on the link, sending only the prompt ids the cloud may keep
        (``cfg.auth.held``; the others count as ``offset``); answers to the previous session
        still in flight (a late fusion top-k) are skipped. Raises ``RemoteError`` if the
        cloud refuses."""
        keep = cfg.auth.held(len(prompt))
        self.link.send(P.Open(list(prompt[len(prompt) - keep:]), self.fingerprint, cfg.temperature,
                              cfg.top_k, cfg.seed, cfg.max_new_tokens + cfg.gamma_max + 1,
                              auth=cfg.auth, offset=len(prompt) - keep))
        self._held = keep
        deadline = time.perf_counter() + cfg.timeout_s
        while True:
            msg = self.link.recv(timeout_s=max(deadline - time.perf_counter(), 0.0))
            if isinstance(msg, P.Opened):
                return

    def _counters(self) -> tuple[int, int, int]:
        link = self.link
        return (link.bytes_up, link.bytes_down, link.round_trips) if link is not None else (0, 0, 0)

    # -- modes -----------------------------------------------------------------------

    def _edge_only(self, prompt, cfg, gen, res, start: int = 0) -> None:
        """Edge decoding from the current edge state until done (``start`` tokens exist)."""
        e = self.edge
        while len(res.tokens) < cfg.max_new_tokens:
            logits = e.logits()
            if cfg.temperature == 0:
                t = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits.double() / cfg.temperature, -1)
                t = int(torch.multinomial(probs.float(), 1, generator=gen))
            if t in e.eos_ids:
                return
            e.push(t)
            res.tokens.append(t)

    def _fallback(self, res: DecodeResult, exc: Exception, cfg, gen, committed: list[int]) -> None:
        res.fallback = (f"cloud unavailable after {len(res.tokens)} tokens "
                        f"({type(exc).__name__}: {exc}); the rest is edge only")
        try:  # end the cloud session, so the link can open the next one
            self.link.send(P.Close())
        except (ConnectionError, OSError):
            pass
        self.edge.rollback(len(committed))
        self._edge_only(None, cfg, gen, res)

    def _next_req(self) -> int:
        self._req = (self._req + 1) % 2**32
        return self._req

    def _draft(self, n: int, cfg, gen) -> tuple[list[int], list, list, float]:
        """Draft ``n`` tokens on top of the edge state (pushed); returns ids, q rows, ms/token."""
        ids, q_ids, q_probs = [], [], []
        t0 = time.perf_counter()
        for _ in range(n):
            logits, keep = self.edge.draft_logits()
            t, qi, qp = _pick(logits, keep, cfg, gen)
            self.edge.push(t)
            ids.append(t)
            q_ids.append(qi)
            q_probs.append(qp)
        ms = 1000 * (time.perf_counter() - t0) / max(n, 1)
        if n:
            self.draft_ms = 0.7 * self.draft_ms + 0.3 * ms
        return ids, q_ids, q_probs, ms

    def _context(self, committed: list[int], base_len: int, cfg) -> list[int]:
        """The ids a request on top of ``committed[:base_len]`` re-sends: what its window
        (``cfg.auth.window``) needs beyond the ``self._held`` the cloud holds (the device's
        mirror of the cloud's rule, :class:`edgefuse.cloud.protocol.CloudAuth`)."""
        need = cfg.auth.window(base_len)
        return list(committed[base_len - need:base_len - self._held]) if need > self._held else []

    def _verify_msg(self, committed: list[int], draft, q_ids, q_probs, cfg) -> P.Verify:
        base_len = len(committed)
        ctx = dict(auth=cfg.auth, context=self._context(committed, base_len, cfg))
        if cfg.temperature == 0 or not draft:
            return P.Verify(self._next_req(), base_len, draft, **ctx)
        k = max(len(q) for q in q_ids)
        qi = np.zeros((len(draft), k), np.int64)
        qp = np.zeros((len(draft), k), np.float16)
        for i, (a, b) in enumerate(zip(q_ids, q_probs)):
            used = set(a.tolist())
            pad = list(itertools.islice((j for j in range(self.edge.vocab_size) if j not in used),
                                        k - len(a)))
            qi[i] = np.concatenate([a, np.asarray(pad, np.int64)])  # zero-probability padding
            qp[i, :len(b)] = b
        return P.Verify(self._next_req(), base_len, draft, qi, qp, **ctx)

    def _commit(self, res, committed, draft, n, token, cfg, sync_edge: bool = True) -> bool:
        """Apply a VERIFIED answer (the edge rolls back to it unless ``sync_edge`` is False);
        returns True when generation is done."""
        res.drafted += len(draft)
        res.accepted += n
        res.blocks += 1
        new = list(draft[:n]) + [int(token)]
        if sync_edge:
            self.edge.rollback(len(committed) + n)
            self.edge.push(int(token))
        committed.extend(new)
        self._held = cfg.auth.held(len(committed))
        kept, done = _stop(res.tokens + new, self.edge.eos_ids, cfg.max_new_tokens)
        res.tokens[:] = kept
        return done

    def _speculative(self, prompt, cfg, gen, res, gamma0: bool) -> None:
        ctl = GammaController(cfg.gamma_min, cfg.gamma_max, fixed=0 if gamma0 else cfg.gamma)
        committed = list(prompt)
        while True:
            left = cfg.max_new_tokens - len(res.tokens)
            g = min(ctl.choose(self.draft_ms, self.rtt_ms, self.verify_ms), max(left - 1, 0))
            draft, q_ids, q_probs, _ = self._draft(g, cfg, gen)
            msg = self._verify_msg(committed, draft, q_ids, q_probs, cfg)
            t0 = time.perf_counter()
            try:
                reply = self.link.request(msg, timeout_s=cfg.timeout_s)
            except (ConnectionError, TimeoutError, OSError, P.RemoteError) as exc:
                return self._fallback(res, exc, cfg, gen, committed)
            self._observe(1000 * (time.perf_counter() - t0), ctl, len(draft))
            ctl.update(reply.accepted, len(draft))
            if self._commit(res, committed, draft, reply.accepted, reply.token, cfg):
                return

    def _observe(self, rt_ms: float, ctl: GammaController, gamma: int) -> None:
        """Split a measured round trip (ms) into the assumed RTT and the cloud's verify time,
        normalised to one token, for the γ controller."""
        base = ctl.verify_base_ms(max(rt_ms - self.rtt_ms, 1.0), gamma)
        self.verify_ms = 0.7 * self.verify_ms + 0.3 * base

    def _speculative_async(self, prompt, cfg, gen, res) -> None:
        ctl = GammaController(cfg.gamma_min, cfg.gamma_max, fixed=cfg.gamma)
        committed = list(prompt)
        link = self.link
        # the first block: nothing to overlap with yet
        g = min(ctl.choose(self.draft_ms, self.rtt_ms, self.verify_ms), max(cfg.max_new_tokens - 1, 0))
        draft, q_ids, q_probs, _ = self._draft(g, cfg, gen)
        try:
            while True:
                msg = self._verify_msg(committed, draft, q_ids, q_probs, cfg)
                link.send(msg)
                link.count_round_trip()
                sent = time.perf_counter()
                # draft ahead on the guess that the whole block is accepted
                guess, ahead, a_ids, a_probs = None, [], [], []
                reply = None
                left = cfg.max_new_tokens - len(res.tokens) - len(draft)
                # look ahead at most the γ that best fills a round trip when drafting overlaps it
                gmax = ctl.choose(self.draft_ms, self.rtt_ms, self.verify_ms, overlap=True)
                while reply is None:
                    if guess is None and left > 0:
                        (guess,), _, _, _ = self._draft(1, cfg, gen)
                    elif guess is not None and len(ahead) < min(gmax, max(left - 2, 0)):
                        t, qi, qp, _ = self._draft(1, cfg, gen)
                        ahead += t
                        a_ids += qi
                        a_probs += qp
                    else:
                        reply = link.recv(timeout_s=cfg.timeout_s)
                        break
                    reply = _poll(link)
                if not isinstance(reply, P.Verified) or reply.req != msg.req:
                    raise P.ProtocolError(f"expected VERIFIED for request {msg.req}, got {reply!r}")
                self._observe(1000 * (time.perf_counter() - sent), ctl, len(draft))
                ctl.update(reply.accepted, len(draft))
                hit = reply.accepted == len(draft) and guess is not None and reply.token == guess
                if self._commit(res, committed, draft, reply.accepted, reply.token, cfg,
                                sync_edge=not hit):
                    return
                if hit and ahead:
                    # the guess was right: the edge already holds committed + the look-ahead
                    draft, q_ids, q_probs = ahead, a_ids, a_probs
                else:
                    # rejected (or nothing drafted ahead): discard the look-ahead, draft afresh
                    self.edge.rollback(len(committed))
                    left = cfg.max_new_tokens - len(res.tokens)
                    g = min(ctl.choose(self.draft_ms, self.rtt_ms, self.verify_ms), max(left - 1, 0))
                    draft, q_ids, q_probs, _ = self._draft(g, cfg, gen)
        except (ConnectionError, TimeoutError, OSError, P.RemoteError) as exc:
            return self._fallback(res, exc, cfg, gen, committed)

    def _fusion(self, prompt, cfg, fcfg: FusionConfig, gen, res) -> None:
        link, e = self.link, self.edge
        committed = list(prompt)
        sent_len, unsent = len(prompt), []
        weights = []
        last_answer = time.perf_counter()
        try:
            while len(res.tokens) < cfg.max_new_tokens:
                if time.perf_counter() - last_answer > cfg.timeout_s:
                    raise TimeoutError(f"no answer from the cloud for {cfg.timeout_s:g} s")
                msg = P.Fuse(self._next_req(), sent_len, unsent, cfg.fuse_topk, auth=cfg.auth,
                             context=self._context(committed, sent_len, cfg))
                link.send(msg)
                link.count_round_trip()
                deadline = time.perf_counter() + cfg.deadline_ms / 1000
                sent_len += len(unsent)
                unsent = []
                self._held = cfg.auth.held(sent_len)  # the cloud answers FUSEs in order
                logits = e.logits()  # computed while the request is in flight
                reply = None
                while reply is None:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    try:
                        got = link.recv(timeout_s=left)
                    except TimeoutError:
                        break
                    if isinstance(got, P.TopK):
                        last_answer = time.perf_counter()
                        if got.req == msg.req:
                            reply = got  # older answers (late ones) are dropped
                if reply is None:
                    res.deadline_misses += 1
                    scores = torch.log_softmax(logits.double(), -1)
                else:
                    scores, w = fuse(logits, reply, fcfg)
                    weights.append(w)
                if cfg.temperature == 0:
                    t = int(torch.argmax(scores))
                else:
                    t = int(torch.multinomial(torch.softmax(scores / cfg.temperature, -1).float(), 1,
                                              generator=gen))
                if t in e.eos_ids:
                    break
                e.push(t)
                committed.append(t)
                unsent.append(t)
                res.tokens.append(t)
        except (ConnectionError, OSError, TimeoutError, P.RemoteError) as exc:
            self._fallback(res, exc, cfg, gen, committed)
        finally:
            res.edge_weight_mean = float(np.mean(weights)) if weights else None
