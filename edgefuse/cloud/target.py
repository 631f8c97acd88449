"""The cloud's target LLM: per-session KV caches and batched verify / top-k steps.

A :class:`TargetSession` holds the committed tokens of one device that the device lets the
cloud keep, and the target's KV cache of all of them but the last (the last one is fed with
the next VERIFY, so one forward pass both extends the cache and scores the first drafted
token; after a FUSE the cache holds every token, so the next FUSE feeds only the device's
new token: one row, not two). :meth:`Target.step` runs the requests of several sessions in
ONE forward pass: the sessions' caches are left-padded to a common length, the new tokens
right-padded, and a 2-D attention mask hides both pads; afterwards each session gets back
exactly its own rows, cropped to what it committed (rollback of rejected draft tokens).
Sessions never share tensors, so one session cannot read another's cache.

Cache authorization (the endpoint-authorized cache control (flagCache, LCache) of the
edge–cloud seed design; the rule is :class:`edgefuse.cloud.protocol.CloudAuth`, the wire format in
:mod:`edgefuse.cloud.protocol`): a request needs the last ``auth.window(base_len)`` committed tokens
(the held ones plus the ids it re-sends as ``context``); every logit row it scores
conditions on at most the last ``l_cache`` ids before that position, computed fresh with
positions from 0 at that window's first id: the target restricted to an ``l_cache`` window,
so speculative decoding stays lossless with respect to it. Afterwards the session keeps only
the last ``auth.held(n)`` tokens. When the window slides (or a request re-sends context)
the old KV is dropped, never cropped: deeper-layer entries of the kept tokens carry
information from the evicted ones. Rows that start at the window's first id share the
session's main row (its KV re-prefilled in a separate forward before the batch when it was
dropped); every later position of a sliding window gets its own row of exactly ``l_cache``
ids (one extra forward over all such rows, last position only). Cost under a full window:
about ``l_cache`` token-rows of forward per scored position instead of one.

Limits (what one request may cost): a VERIFY drafts at most ``max_draft`` tokens, and every
forward pass feeds at most ``max_batch_tokens`` token rows (padding included), like vLLM's
``--max-num-batched-tokens``: the main rows of a batch and the fresh window rows are split
over as many forwards as that takes, and a request whose own plan (re-prefill + main row +
window rows) exceeds it is refused with ERROR ``limit`` before anything runs (its session
goes on). So one ~1 KB VERIFY can no longer plan (γ + 1) × l_cache ≈ 522,000 token rows.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from . import protocol as P
from edgefuse.cloud.rows import RowPadding
from edgefuse.cloud.speculative import sparse_q, target_probs, verify_greedy, verify_sampled
from edgefuse.kvcache import cache_from_layers, cache_layers


def tokenizer_fingerprint(tok) -> str:
    """sha256 (hex, first 16 chars) of the tokenizer's vocabulary (id → piece): equal
    fingerprints mean token ids denote the same strings on both ends."""
    h = hashlib.sha256()
    for piece, idx in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{piece}\n".encode())
    return h.hexdigest()[:16]


def job_error(exc: Exception) -> P.Error:
    """The ERROR answering one job whose reply could not be built: the exception's own
    ``code`` if it has one, else ``protocol`` for a ``ValueError`` and ``internal`` otherwise."""
    code = getattr(exc, "code", "protocol" if isinstance(exc, ValueError) else "internal")
    return P.Error(code, f"{type(exc).__name__}: {exc}")


class SessionError(ValueError):
    """A request the target refuses; ``code`` is the protocol ERROR code (``fingerprint``,
    ``context``, ``sync``, ``evicted``, ``limit``, ``protocol``)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class TargetSession:
    """One device's state at the cloud.

    ``tokens``: the committed ids (prompt + generated) the cloud holds: the last
    ``auth.held(committed)`` of them, never more; ``evicted``: committed tokens before
    ``tokens[0]`` the cloud no longer holds (or never got), so ``committed = evicted +
    len(tokens)`` is what a request's ``base_len`` must equal; ``cache``: the target's KV
    cache of ``tokens[:-1]`` (of all ``tokens`` after a FUSE), positions from 0 at
    ``tokens[0]``, None when nothing is cached (after an eviction: re-prefilled fresh by the
    next request); ``auth``: the current :class:`edgefuse.cloud.protocol.CloudAuth`;
    ``temperature`` / ``top_k``: the target's sampling settings (0 = greedy); ``gen``: the
    session's random generator (seeded by the device's ``seed``)."""

    def __init__(self, prompt: list[int], temperature: float, top_k: int, seed: int, max_new: int,
                 auth: P.CloudAuth | None = None, offset: int = 0):
        self.tokens = list(prompt)
        self.evicted = int(offset)
        self.auth = auth if auth is not None else P.CloudAuth()
        self.cache: DynamicCache | None = None
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.max_new = int(max_new)
        # its own stream: the device samples drafts from ``seed`` itself, and shared draws
        # would correlate draft and acceptance (biasing the output distribution)
        digest = hashlib.sha256(b"edgefuse/cloud-sampler/" + str(int(seed)).encode()).digest()
        self.gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
        self.closed = False

    @property
    def cached(self) -> int:
        """Tokens in the KV cache (``len(tokens) - 1``, or ``len(tokens)`` after a FUSE; 0
        after an eviction)."""
        return 0 if self.cache is None else self.cache.get_seq_length()

    @property
    def committed(self) -> int:
        """Committed tokens of the session (held or evicted): the next ``base_len``."""
        return self.evicted + len(self.tokens)

    @property
    def held(self) -> int:
        """Committed tokens the cloud holds (ids, and KV once prefilled)."""
        return len(self.tokens)


def _kv(cache: DynamicCache | None, n_layers: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The first ``length`` positions of every layer of ``cache`` (views), None if empty."""
    if cache is None or length == 0:
        return None
    return [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in cache.layers[:n_layers]]


MIN_BATCH_TOKENS = 512  # the smallest max_batch_tokens: a 255-token FUSE row fits with room


def pack_rows(keys: list, lens: list[int], padding: RowPadding, max_tokens: int) -> list[list]:
    """``keys`` (one per sequence, ``lens`` new rows each) in consecutive groups whose padded
    :func:`batched_forward` feeds at most ``max_tokens`` token rows (:meth:`RowPadding.fed`);
    a sequence that alone exceeds it gets a group of its own (callers refuse those first)."""
    groups: list[list] = []
    cur: list = []
    longest = 0
    for key, n in zip(keys, lens):
        if cur and padding.fed(len(cur) + 1, max(longest, n)) > max_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(key)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    return groups


@torch.no_grad()
def batched_forward(model, per: list, pasts: list[int], inputs: list, pad_id: int,
                    padding: RowPadding | int | None = None, output: str = "logits",
                    offsets: list[int] | None = None):
    """One forward pass over several independent sequences, each with its own KV cache.

    Row b continues ``per[b]`` (``[(k, v)]`` per layer, ``(1, kv_heads, pasts[b], d)``, or
    None when ``pasts[b] == 0``) with ``inputs[b]``: ``m_b`` token ids (``list[int]``) or
    ``m_b`` input embeddings (a float Tensor ``[m_b, H]``, cast to the model's dtype; all
    rows of one call are of one kind). The caches are left-padded to the longest, the inputs
    right-padded (pad id, or zero vectors), and a 2-D attention mask hides both pads; row
    b's positions are ``offsets[b] + pasts[b] + 0, 1, ...`` (``offsets`` None = all 0: a
    cache that starts at position 0). The inputs are padded to ``padding.rows(n)`` token rows
    for ``n`` in all (:class:`~edgefuse.cloud.rows.RowPadding`; an int m pads 2..m-1 rows
    to m, None pads nothing; pad rows are never returned). A single sequence gets no batch
    padding or mask (only that row padding), so it computes exactly as alone.

    Args:
        model: a causal LM (``output="logits"``) or its decoder body
            (``output="last_hidden_state"``).
    Returns:
        ``(outs, kvs)``: per row ``[m_b, V]`` logits (or ``[m_b, H]`` hidden states) and its
        new cache ``[(k, v)]`` of ``pasts[b] + m_b`` positions, plus pad positions at the
        end for a single padded row (callers crop to what they keep).
    Raises:
        ValueError: ids and embeddings mixed, or ``offsets`` of another length than ``inputs``.
    """
    rows = RowPadding.coerce(padding).rows
    embeds = isinstance(inputs[0], torch.Tensor)
    if any(isinstance(x, torch.Tensor) != embeds for x in inputs):
        raise ValueError("batched_forward: inputs mix token ids and embeddings")
    offs = [0] * len(inputs) if offsets is None else [int(o) for o in offsets]
    if len(offs) != len(inputs):
        raise ValueError(f"batched_forward: {len(offs)} offsets for {len(inputs)} inputs")
    dtype = getattr(model, "dtype", None) if embeds else None

    def feed(batch) -> dict:
        return {"inputs_embeds": batch} if embeds else {"input_ids": batch}

    if len(inputs) == 1:
        x, past = inputs[0], pasts[0]
        real = len(x)
        cache = cache_from_layers(per[0]) if past else DynamicCache()
        pad = rows(real) - real
        if embeds:
            x = x.to(dtype or x.dtype)
            batch = torch.cat([x, x.new_zeros(pad, x.shape[1])]).unsqueeze(0)
        else:
            batch = torch.tensor([list(x) + [pad_id] * pad])
        pos = torch.arange(offs[0] + past, offs[0] + past + real + pad).unsqueeze(0)
        out = model(**feed(batch), position_ids=pos, cache=cache, use_cache=True)
        return [getattr(out, output)[0, :real]], [cache_layers(out)]
    lens, news, bsz = list(pasts), [len(x) for x in inputs], len(inputs)
    lmax = max(lens)
    mmax = -(-rows(bsz * max(news)) // bsz)
    if embeds:
        batch = torch.zeros((bsz, mmax, inputs[0].shape[1]), dtype=dtype or inputs[0].dtype)
    else:
        batch = torch.full((bsz, mmax), pad_id, dtype=torch.long)
    mask = torch.zeros((bsz, lmax + mmax), dtype=torch.long)
    pos = torch.zeros((bsz, mmax), dtype=torch.long)
    for b, (x, L) in enumerate(zip(inputs, lens)):
        batch[b, :len(x)] = x if embeds else torch.tensor(x)
        mask[b, lmax - L:lmax + len(x)] = 1
        pos[b] = torch.arange(offs[b] + L, offs[b] + L + mmax)
    cache = DynamicCache()
    if lmax > 0:
        ref = next(p for p in per if p is not None)
        for i in range(len(ref)):
            k0, v0 = ref[i]
            shape = (bsz, k0.shape[1], lmax, k0.shape[3])
            k, v = torch.zeros(shape, dtype=k0.dtype), torch.zeros(shape, dtype=v0.dtype)
            for b, L in enumerate(lens):
                if L:
                    k[b:b + 1, :, lmax - L:], v[b:b + 1, :, lmax - L:] = per[b][i]
            cache.update(k, v, i)
    out = model(**feed(batch), attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    layers = cache_layers(out)
    outs, kvs = [], []
    for b, (L, m) in enumerate(zip(lens, news)):
        outs.append(getattr(out, output)[b, :m])
        idx = torch.tensor(list(range(lmax - L, lmax)) + list(range(lmax, lmax + m)))
        kvs.append([(k[b:b + 1, :, idx], v[b:b + 1, :, idx]) for k, v in layers])
    return outs, kvs


@dataclass
class _Plan:
    """How one request runs. ``seq`` = window (the re-sent context + the held ids: the last
    ``auth.window(base_len)`` committed tokens) + the request's new ids. ``scores``: the
    prefix lengths of ``seq`` whose next-token logits the reply needs. Those whose own
    window starts at ``seq[0]`` come from the main row: ``ids`` fed after ``past`` cached
    positions (``layers``: the session's cache, or a fresh prefill when ``fresh``; ``ids``
    None = no main row); each longer one from its own fresh row of exactly ``l_cache``
    tokens (``extra``)."""
    seq: list[int]
    window: int
    context: int
    scores: list[int]
    ids: list[int] | None
    past: int
    fresh: bool
    extra: list[list[int]]
    layers: list | None = None


class Target:
    """Runs the target model for many sessions. Not thread-safe: call from one thread.

    Args:
        model: a causal LM (e.g. Qwen2.5-Coder-1.5B), eval mode.
        tok: its tokenizer (for the fingerprint and the pad id).
        name: the model's name, reported to devices.
        max_context: the most tokens one row of a forward may hold: without a window, the
            most a session may hold (prompt + generated); under a window, ``l_cache``.
        row_padding: the row count each forward of n new-token rows (batch × tokens) is
            padded to (:class:`~edgefuse.cloud.rows.RowPadding`; pads are ignored and never
            cached). An int m pads 2..m-1 rows to m (the fixed rule); the service passes a
            table :func:`edgefuse.cloud.rows.calibrate` measured on its machine, since a CPU's
            matrix kernels are not smooth in the rows (one machine: 2-3 rows slower than 4;
            another: 4-8 rows twice as slow as 3, 16 cheaper than 8).

        max_draft: drafted tokens one VERIFY may carry (1..255); more is ERROR ``limit``.
        max_batch_tokens: token rows one forward pass may feed, padding included
            (≥ ``max_context`` and ≥ 512, so a full prompt and a 255-token FUSE fit); more
            is split over several forwards, and one request planning more is ERROR ``limit``.
        prefill_chunk: 0 = an OPEN prefills its whole prompt at once; n > 0 = :meth:`open`
            leaves the prefill to :meth:`prefill_step`, n ids a call, so the service can run
            other sessions' decode batches between the chunks (chunked prefill, as vLLM's
            scheduler interleaves prefill chunks with decode steps): a long new prompt does
            not stall every other session. The cache equals a whole prefill's up to float
            rounding (the greedy answers are the same, tested).

    Counters: ``batches`` / ``jobs`` (:meth:`step` calls that ran, requests run),
    ``reprefills`` / ``reprefill_tokens`` (fresh rows a cache tuple forced — re-prefills of a
    window whose KV was dropped, and the own rows of positions past a full window — and the
    tokens they fed: the cost of a sliding window or of ``flag_cache`` off), ``forwards`` /
    ``forward_tokens`` / ``forward_tokens_max`` (forward passes run, token rows fed in all,
    the most fed to one), ``limit_refusals`` (requests refused with ERROR ``limit``).

    Raises ``ValueError`` for out-of-range limits.
    """

    def __init__(self, model, tok, name: str, max_context: int = 2048,
                 row_padding: RowPadding | int = 4,
                 *, max_draft: int = 16, max_batch_tokens: int = 8192, prefill_chunk: int = 0):
        self.model = model.eval()
        get_decoder = getattr(self.model, "get_decoder", None)
        self._body = get_decoder() if get_decoder is not None else None  # KV without the LM head
        self._setup(tok, name, model.config, max_context, row_padding, max_draft, max_batch_tokens,
                    prefill_chunk)

    def _setup(self, tok, name: str, config, max_context: int, row_padding: RowPadding | int, max_draft: int,
               max_batch_tokens: int, prefill_chunk: int) -> None:
        """Everything but the model: names, limits (checked), counters."""
        if not 1 <= max_draft <= P.MAX_GAMMA:
            raise ValueError(f"max_draft must be in 1..{P.MAX_GAMMA}, got {max_draft}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        if max_batch_tokens < max(int(max_context), MIN_BATCH_TOKENS):
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_context "
                             f"({max_context}) and >= {MIN_BATCH_TOKENS}")
        self.name = name
        self.fingerprint = tokenizer_fingerprint(tok)
        self.context_len = int(max_context)
        self.vocab_size = int(config.vocab_size)
        self.n_layers = int(config.num_hidden_layers)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad or 0)
        self.padding = RowPadding.coerce(row_padding)
        self.max_draft = int(max_draft)
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefill_chunk = int(prefill_chunk)
        self.prefill_chunks = 0
        self.batches = 0
        self.jobs = 0
        self.reprefills = 0
        self.reprefill_tokens = 0
        self.forwards = 0
        self.forward_tokens = 0
        self.forward_tokens_max = 0
        self.limit_refusals = 0

    def _count_forward(self, rows: int) -> None:
        """Record one forward pass feeding ``rows`` token rows (padding included)."""
        self.forwards += 1
        self.forward_tokens += rows
        self.forward_tokens_max = max(self.forward_tokens_max, rows)

    # -- sessions -----------------------------------------------------------------------

    @torch.no_grad()
    def open(self, msg: P.Open) -> TargetSession:
        """Start a session over ``msg.offset`` unsent + ``msg.prompt`` committed tokens; keep
        the last ``msg.auth.held(n)`` of them and prefill all kept ids but the last.

        Raises :class:`SessionError`: ``fingerprint`` (tokenizers differ: refuse rather than
        decode garbage), ``context`` (prompt + max_new, or under a window ``l_cache``, the
        longest row a request may run, exceeds max_context), ``protocol`` (no tokens, bad
        ids, settings or tuple)."""
        if msg.fingerprint != self.fingerprint:
            raise SessionError("fingerprint", f"tokenizer fingerprint {msg.fingerprint} does not "
                               f"match the target {self.name} ({self.fingerprint}): the pair "
                               "does not share a vocabulary")
        auth = self._check_auth(msg.auth)
        if msg.offset < 0 or msg.offset + len(msg.prompt) == 0:
            raise SessionError("protocol", f"empty prompt (offset {msg.offset}, "
                               f"{len(msg.prompt)} ids)")
        total = msg.offset + len(msg.prompt) + max(msg.max_new, 0)
        span = total if auth.l_cache is None else min(total, auth.l_cache)  # longest row
        if span > self.context_len:
            raise SessionError("context", f"prompt {msg.offset + len(msg.prompt)} + max_new "
                               f"{msg.max_new} tokens (window {auth.l_cache}) exceeds the "
                               f"context of {self.context_len}")
        self._check_ids(msg.prompt)
        if not (math.isfinite(msg.temperature) and msg.temperature >= 0) or msg.top_k < 0:
            raise SessionError("protocol", f"bad sampling settings: temperature {msg.temperature}, "
                               f"top_k {msg.top_k}")
        sess = TargetSession(msg.prompt, msg.temperature, msg.top_k, msg.seed, msg.max_new,
                             auth=auth, offset=msg.offset)
        self._evict(sess)
        if len(sess.tokens) > 1 and not self.prefill_chunk:
            self._open_prefill(sess)
        return sess

    def _open_prefill(self, sess: TargetSession) -> None:
        """The whole prefill of an OPEN: the cache of all prompt ids but the last."""
        sess.cache = cache_from_layers(self._prefill(sess.tokens[:-1]))

    def prefill_left(self, sess: TargetSession) -> int:
        """Prompt ids of an opened session not prefilled yet (0 once :meth:`open` or the
        last :meth:`prefill_step` has done them all)."""
        return max(len(sess.tokens) - 1 - sess.cached, 0) if not sess.closed else 0

    def prefill_step(self, sess: TargetSession) -> int:
        """Prefill the next ``prefill_chunk`` ids of ``sess``'s prompt onto its cache (one
        forward of one row at positions ``cached ..``); returns :meth:`prefill_left`."""
        done, left = sess.cached, self.prefill_left(sess)
        if left <= 0:
            return 0
        ids = sess.tokens[done:done + min(self.prefill_chunk or left, left)]
        self._count_forward(self.padding.rows(len(ids)))
        self.prefill_chunks += 1
        past = [_kv(sess.cache, self.n_layers, done)] if done else [None]
        model, output = (self._body, "last_hidden_state") if self._body is not None else (self.model, "logits")
        _, kvs = batched_forward(model, past, [done], [list(ids)], self.pad_id, output=output)
        sess.cache = cache_from_layers([(k[:, :, :done + len(ids)], v[:, :, :done + len(ids)])
                                        for k, v in kvs[0]])
        return self.prefill_left(sess)

    def authorize(self, sess: TargetSession, auth: P.CloudAuth) -> int:
        """Apply a new cache tuple at once (an AUTH): what it no longer allows is evicted
        before this returns. Returns the committed tokens the session now holds.
        Raises :class:`SessionError` ``protocol`` for a closed session or a bad tuple."""
        if sess.closed:
            raise SessionError("protocol", "session is closed")
        sess.auth = self._check_auth(auth)
        self._evict(sess)
        return sess.held

    def close(self, sess: TargetSession) -> None:
        """Free the session's KV cache."""
        sess.cache = None
        sess.closed = True

    @staticmethod
    def _check_auth(auth) -> P.CloudAuth:
        if not isinstance(auth, P.CloudAuth):
            raise SessionError("protocol", f"bad cache tuple {auth!r}")
        return auth

    @staticmethod
    def _evict(sess: TargetSession) -> None:
        """Keep only the last ``sess.auth.held(...)`` held ids. Whenever ids are dropped the
        KV cache goes too (deeper-layer entries of the kept ids carry the dropped ones); the
        next request re-prefills the window fresh."""
        drop = sess.held - sess.auth.held(sess.held)
        if drop > 0:
            sess.tokens = sess.tokens[drop:]
            sess.evicted += drop
            sess.cache = None

    def _check_ids(self, ids) -> None:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise SessionError("protocol", f"token id {bad[0]} outside the vocabulary "
                               f"(0..{self.vocab_size - 1})")

    def _prefill(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fresh KV layers of ``ids`` (one row, positions from 0, no LM head when the model
        exposes its decoder body)."""
        self._count_forward(self.padding.rows(len(ids)))
        if self._body is not None:
            _, kvs = batched_forward(self._body, [None], [0], [list(ids)], self.pad_id,
                                     output="last_hidden_state")
        else:
            _, kvs = batched_forward(self.model, [None], [0], [list(ids)], self.pad_id)
        return kvs[0]

    # -- batched steps ------------------------------------------------------------------

    def _prepare(self, sess: TargetSession, req) -> _Plan:
        """Apply ``req``'s tuple (evicting what it no longer allows, even if the request is
        then refused), validate ``req`` against ``sess`` and plan its forward passes.

        The window = re-sent context + held ids must be exactly ``auth.window(base_len)``:
        fewer is ``evicted``, more ``protocol``. Each scored prefix of ``seq`` = window + new
        conditions on its last ``l_cache`` ids. Prefixes within the first ``l_cache`` ids
        share the main row: a FUSE after a FUSE feeds only the newly committed ids (the cache
        already holds every token); otherwise the window's last token is fed again first, so
        its logits score the first drafted token."""
        if sess.closed:
            raise SessionError("protocol", "session is closed")
        auth = sess.auth = self._check_auth(req.auth)
        self._evict(sess)
        if req.base_len != sess.committed:
            raise SessionError("sync", f"request assumes {req.base_len} committed tokens, the "
                               f"cloud has {sess.committed}")
        if isinstance(req, P.Verify):
            new = list(req.draft)
            if len(new) > self.max_draft:
                self.limit_refusals += 1
                raise SessionError("limit", f"VERIFY drafts {len(new)} tokens; this cloud "
                                   f"verifies at most {self.max_draft} per request")
            if sess.temperature > 0 and new and np.shape(req.q_ids)[-1:] in ((0,), ()):
                raise SessionError("protocol", "sampling session sent a draft without its q")
            if np.size(req.q_ids):
                self._check_ids(np.asarray(req.q_ids).reshape(-1).tolist())
        else:
            new = list(req.committed)
            if not 1 <= req.k <= min(P.MAX_TOPK, self.vocab_size):
                raise SessionError("protocol", f"top-k {req.k} out of range")
        context = [int(t) for t in req.context]
        self._check_ids(new)
        self._check_ids(context)
        if auth.l_cache == 0:
            raise SessionError("protocol", "l_cache = 0 authorizes no context: nothing to score")
        need, have = auth.window(req.base_len), sess.held + len(context)
        if have < need:
            raise SessionError("evicted", f"the request needs the last {need} committed tokens; "
                               f"the cloud holds {sess.held} ({sess.evicted} evicted) and the "
                               f"request re-sent {len(context)}: re-send the missing "
                               f"{need - have} as context")
        if have > need:
            raise SessionError("protocol", f"{len(context)} context ids + {sess.held} held "
                               f"exceed the authorized window of {need} tokens")
        seq, w = context + sess.tokens + new, have
        span = len(seq) + 1 if auth.l_cache is None else min(len(seq) + 1, auth.l_cache)
        if span > self.context_len:
            raise SessionError("context", f"session would exceed the context of {self.context_len}")
        scores = list(range(w, len(seq) + 1)) if isinstance(req, P.Verify) else [len(seq)]
        if scores[0] == 0:
            raise SessionError("protocol", "nothing to score: no committed token before the request")
        lim = len(seq) if auth.l_cache is None else auth.l_cache
        main = [p for p in scores if p <= lim]
        extra = [seq[p - lim:p] for p in scores if p > lim]
        valid = 0 if context else min(sess.cached, w)  # cached positions still usable
        ids, past = None, 0
        if main:
            top = main[-1]
            if isinstance(req, P.Fuse) and new and valid == w:
                ids, past = seq[w:top], w
            else:
                ids, past = seq[w - 1:top], w - 1
        fresh = main != [] and valid < past
        cost = ((past if fresh else 0) + (self.padding.fed(1, len(ids)) if main else 0)
                + sum(len(r) for r in extra))
        if cost > self.max_batch_tokens:
            self.limit_refusals += 1
            raise SessionError("limit", f"the request would feed {cost} token rows "
                               f"({len(extra)} window rows of {lim} ids); this cloud runs at "
                               f"most {self.max_batch_tokens} per forward pass: draft fewer "
                               f"tokens or authorize a shorter window")
        return _Plan(seq, w, len(context), scores, ids, past, fresh, extra,
                     None if fresh or not main else _kv(sess.cache, self.n_layers, past))

    @torch.no_grad()
    def step(self, jobs: list[tuple[TargetSession, P.Verify | P.Fuse]]) -> list[P.Message]:
        """Answer VERIFY / FUSE requests of several sessions with one forward pass (plus,
        under a sliding window, one fresh prefill per session whose window KV was dropped
        and one forward over all rows of exactly ``l_cache`` ids, see :class:`_Plan`).

        Returns one message per job, in order: ``Verified``, ``TopK`` or ``Error``. A refused
        job leaves its session unchanged (but for its cache tuple, which applies first); the
        others proceed. At most one job per session."""
        if len({id(s) for s, _ in jobs}) != len(jobs):
            raise ValueError("at most one job per session in a batch")
        replies: list[P.Message | None] = [None] * len(jobs)
        live, plans = [], []
        for j, (sess, req) in enumerate(jobs):
            try:
                plan = self._prepare(sess, req)
                if plan.fresh:  # the window's KV from scratch: positions from 0
                    plan.layers = self._prefill(plan.seq[:plan.past])
                    self.reprefills += 1
                    self.reprefill_tokens += plan.past
                plans.append(plan)
                live.append(j)
            except SessionError as exc:
                replies[j] = P.Error(exc.code, str(exc))
        if not live:
            return replies  # type: ignore[return-value]
        main = [b for b, p in enumerate(plans) if p.ids is not None]
        outs: dict[int, torch.Tensor] = {}
        kvs: dict[int, list] = {}
        for group in self._groups(main, [len(plans[b].ids) for b in main]):
            logits, caches = batched_forward(self.model, [plans[b].layers for b in group],
                                             [plans[b].past for b in group],
                                             [plans[b].ids for b in group], self.pad_id,
                                             self.padding)
            outs.update(zip(group, logits))
            kvs.update(zip(group, caches))
        extra = self._extra_rows([p.extra for p in plans])
        for b, j in enumerate(live):
            sess, req, plan = *jobs[j], plans[b]
            n_main = len(plan.scores) - len(plan.extra)
            parts = [outs[b][[p - plan.past - 1 for p in plan.scores[:n_main]]]] if n_main else []
            if plan.extra:
                parts.append(extra[b])
            try:  # one bad job never costs the others their answers
                replies[j] = self._finish(sess, req, plan, torch.cat(parts), kvs.get(b))
            except Exception as exc:  # noqa: BLE001 - the session is left unchanged
                replies[j] = job_error(exc)
        self.batches += 1
        self.jobs += len(live)
        return replies  # type: ignore[return-value]

    def _groups(self, main: list[int], lens: list[int]) -> list[list[int]]:
        """Split the main rows (plan indices ``main``, ``lens`` new ids each) into
        consecutive groups whose padded forward feeds at most ``max_batch_tokens`` token rows
        (each row alone fits: :meth:`_prepare` refused any that does not); counts them."""
        groups = pack_rows(main, lens, self.padding, self.max_batch_tokens)
        for g in groups:
            self._count_forward(self.padding.fed(len(g), max(lens[main.index(b)] for b in g)))
        return groups

    def _extra_rows(self, per_plan: list[list[list[int]]]) -> list[torch.Tensor | None]:
        """Last-position logits ``[rows, V]`` of each plan's fresh window rows: forwards of
        rows of one length (= l_cache; equal lengths need no pads, no mask, and positions
        start at 0), each feeding at most ``max_batch_tokens`` token rows."""
        by_len: dict[int, list[tuple[int, int]]] = {}
        for b, rows in enumerate(per_plan):
            for i, row in enumerate(rows):
                by_len.setdefault(len(row), []).append((b, i))
        got: dict[tuple[int, int], torch.Tensor] = {}
        for length, keys in by_len.items():
            per_forward = max(1, self.max_batch_tokens // length)
            for start in range(0, len(keys), per_forward):
                chunk = keys[start:start + per_forward]
                ids = torch.tensor([per_plan[b][i] for b, i in chunk])
                self._count_forward(len(chunk) * length)
                last = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
                got.update(zip(chunk, last))
            self.reprefills += len(keys)
            self.reprefill_tokens += len(keys) * length
        return [torch.stack([got[(b, i)] for i in range(len(rows))]) if rows else None
                for b, rows in enumerate(per_plan)]

    def _finish(self, sess: TargetSession, req, plan: _Plan, logits: torch.Tensor, kv) -> P.Message:
        """Turn one job's logits (``[len(plan.scores), V]``) into the reply and commit the
        session: the window + what was committed, the main row's cache cropped to it (none
        without a main row), then evict what the tuple does not let it keep."""
        base = plan.window
        if isinstance(req, P.Verify):
            draft = list(req.draft)
            if sess.temperature > 0:
                q = [sparse_q(req.q_ids[i], req.q_probs[i]) for i in range(len(draft))]
                p = target_probs(logits, sess.temperature, sess.top_k)
                n, token = verify_sampled(p, draft, q, sess.gen)
            else:
                n, token = verify_greedy(torch.argmax(logits, dim=-1).tolist(), draft)
            keep = base + n  # window[:-1], the re-fed last token and the n kept drafts
            added = draft[:n] + [token]
            reply = P.Verified(req.req, n, token)
        else:
            added = list(req.committed)
            logp = torch.log_softmax(logits[-1].double(), dim=-1)
            vals, ids = torch.topk(logp, req.k)
            mass = float(torch.exp(vals).sum())
            tail = math.log(max(1.0 - mass, 1e-30))
            top = float(np.float16(vals[0]))
            scale = float(np.float16(max(top - float(vals[-1]), 1e-3) / 255.0))
            q = torch.clamp(torch.round((top - vals) / scale), 0, 255).to(torch.uint8).numpy()
            keep = base + len(added)  # every token: the next FUSE feeds only what is new
            reply = P.TopK(req.req, ids.numpy().astype(np.int64), q, top, scale, tail)
        tokens = plan.seq[:base] + added
        cached = 0 if kv is None else plan.past + len(plan.ids)
        # the main row's KV is exact for tokens[:keep] only if it reached that far; otherwise
        # (the window slid past it) nothing is kept and the next request re-prefills
        sess.cache = (cache_from_layers([(k[:, :, :keep], v[:, :, :keep]) for k, v in kv])
                      if cached >= keep else None)
        sess.tokens = tokens
        sess.evicted -= plan.context
        self._evict(sess)
        return reply
