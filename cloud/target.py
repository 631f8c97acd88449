"""The cloud's target LLM: per-session KV caches and batched verify / top-k steps.

A :class:`TargetSession` holds one device's committed tokens and the target's KV cache of
all of them but the last (the last one is fed with the next VERIFY, so one forward pass
both extends the cache and scores the first drafted token; after a FUSE the cache holds
every token, so the next FUSE feeds only the device's new token: one row, not two). :meth:`Target.step` runs
the requests of several sessions in ONE forward pass: the sessions' caches are left-padded
to a common length, the new tokens right-padded, and a 2-D attention mask hides both pads;
afterwards each session gets back exactly its own rows, cropped to what it committed
(rollback of rejected draft tokens). Sessions never share tensors, so one session cannot
read another's cache.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from transformers import DynamicCache

from . import protocol as P
from .speculative import sparse_q, target_probs, verify_greedy, verify_sampled


def tokenizer_fingerprint(tok) -> str:
    """sha256 (hex, first 16 chars) of the tokenizer's vocabulary (id → piece): equal
    fingerprints mean token ids denote the same strings on both ends."""
    h = hashlib.sha256()
    for piece, idx in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{piece}\n".encode())
    return h.hexdigest()[:16]


class SessionError(ValueError):
    """A request the target refuses; ``code`` is the protocol ERROR code (``fingerprint``,
    ``context``, ``sync``, ``protocol``)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class TargetSession:
    """One device's state at the cloud.

    ``tokens``: committed ids (prompt + generated); ``cache``: the target's KV cache of
    ``tokens[:-1]`` (of all ``tokens`` after a FUSE); ``temperature`` / ``top_k``: the target's sampling settings (0 = greedy);
    ``gen``: the session's random generator (seeded by the device's ``seed``)."""

    def __init__(self, prompt: list[int], temperature: float, top_k: int, seed: int, max_new: int):
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
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
        """Tokens in the KV cache (``len(tokens) - 1``, or ``len(tokens)`` after a FUSE)."""
        return 0 if self.cache is None else self.cache.get_seq_length()


def cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` holding ``[(keys, values)]`` per layer (tensors shared, not copied)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def _kv(cache: DynamicCache | None, n_layers: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The first ``length`` positions of every layer of ``cache`` (views), None if empty."""
    if cache is None or length == 0:
        return None
    return [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in cache.layers[:n_layers]]


def cache_layers(out) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(keys, values)`` of every layer of a forward output's cache."""
    return [(layer.keys, layer.values) for layer in out.cache.layers]


@torch.no_grad()
def batched_forward(model, per: list, pasts: list[int], inputs: list[list[int]], pad_id: int,
                    min_rows: int = 1, output: str = "logits"):
    """One forward pass over several independent sequences, each with its own KV cache.

    Row b continues ``per[b]`` (``[(k, v)]`` per layer, ``(1, kv_heads, pasts[b], d)``, or
    None when ``pasts[b] == 0``) with ``inputs[b]`` (``m_b`` ids). The caches are
    left-padded to the longest, the inputs right-padded, and a 2-D attention mask hides
    both pads; positions continue each row's own length. When the batch holds 2 to
    ``min_rows - 1`` token rows in all, the inputs are padded to ``min_rows`` rows (pad
    rows are never returned). A single sequence gets no batch padding or mask (only that
    row padding), so it computes exactly as alone.

    Args:
        model: a causal LM (``output="logits"``) or its decoder body
            (``output="last_hidden_state"``).
    Returns:
        ``(outs, kvs)``: per row ``[m_b, V]`` logits (or ``[m_b, H]`` hidden states) and its
        new cache ``[(k, v)]`` of ``pasts[b] + m_b`` positions, plus pad positions at the
        end for a single padded row (callers crop to what they keep).
    """
    def rows(total: int) -> int:
        return min_rows if 1 < total < min_rows else total

    if len(inputs) == 1:
        ids, past = inputs[0], pasts[0]
        real = len(ids)
        cache = cache_from_layers(per[0]) if past else DynamicCache()
        ids = ids + [pad_id] * (rows(len(ids)) - len(ids))
        pos = torch.arange(past, past + len(ids)).unsqueeze(0)
        out = model(input_ids=torch.tensor([ids]), position_ids=pos, cache=cache, use_cache=True)
        return [getattr(out, output)[0, :real]], [cache_layers(out)]
    lens, news, bsz = list(pasts), [len(x) for x in inputs], len(inputs)
    lmax = max(lens)
    mmax = -(-rows(bsz * max(news)) // bsz)
    ids = torch.full((bsz, mmax), pad_id, dtype=torch.long)
    mask = torch.zeros((bsz, lmax + mmax), dtype=torch.long)
    pos = torch.zeros((bsz, mmax), dtype=torch.long)
    for b, (x, L) in enumerate(zip(inputs, lens)):
        ids[b, :len(x)] = torch.tensor(x)
        mask[b, lmax - L:lmax + len(x)] = 1
        pos[b] = torch.arange(L, L + mmax)
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
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    layers = cache_layers(out)
    outs, kvs = [], []
    for b, (L, m) in enumerate(zip(lens, news)):
        outs.append(getattr(out, output)[b, :m])
        idx = torch.tensor(list(range(lmax - L, lmax)) + list(range(lmax, lmax + m)))
        kvs.append([(k[b:b + 1, :, idx], v[b:b + 1, :, idx]) for k, v in layers])
    return outs, kvs


class Target:
    """Runs the target model for many sessions. Not thread-safe: call from one thread.

    Args:
        model: a causal LM (e.g. Qwen2.5-Coder-1.5B), eval mode.
        tok: its tokenizer (for the fingerprint and the pad id).
        name: the model's name, reported to devices.
        max_context: the most tokens (prompt + generated) a session may hold.
        min_block_rows: a forward of 2..min_block_rows-1 new-token rows in all (batch ×
            tokens) is padded to this many (pads are ignored and never cached). On this CPU
            (1 thread, 1.5B) 1 / 2 / 3 / 4 / 8 / 32 rows took 290 / 595 / 870 / 510 / 625 /
            1320 ms: PyTorch's matrix kernels for 2-3 rows are slower than for 4.
    """

    def __init__(self, model, tok, name: str, max_context: int = 2048, min_block_rows: int = 4):
        self.model = model.eval()
        self.name = name
        self.fingerprint = tokenizer_fingerprint(tok)
        self.context_len = int(max_context)
        self.vocab_size = int(model.config.vocab_size)
        self.n_layers = int(model.config.num_hidden_layers)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad or 0)
        self.min_block_rows = int(min_block_rows)
        self.batches = 0
        self.jobs = 0

    # -- sessions -----------------------------------------------------------------------

    @torch.no_grad()
    def open(self, msg: P.Open) -> TargetSession:
        """Prefill ``msg.prompt[:-1]`` into a new session.

        Raises :class:`SessionError`: ``fingerprint`` (tokenizers differ: refuse rather than
        decode garbage), ``context`` (prompt + max_new > max_context), ``protocol`` (bad
        ids or settings)."""
        if msg.fingerprint != self.fingerprint:
            raise SessionError("fingerprint", f"tokenizer fingerprint {msg.fingerprint} does not "
                               f"match the target {self.name} ({self.fingerprint}): the pair "
                               "does not share a vocabulary")
        if not msg.prompt:
            raise SessionError("protocol", "empty prompt")
        if len(msg.prompt) + max(msg.max_new, 0) > self.context_len:
            raise SessionError("context", f"prompt {len(msg.prompt)} + max_new {msg.max_new} tokens "
                               f"exceeds the context of {self.context_len}")
        self._check_ids(msg.prompt)
        if not (math.isfinite(msg.temperature) and msg.temperature >= 0) or msg.top_k < 0:
            raise SessionError("protocol", f"bad sampling settings: temperature {msg.temperature}, "
                               f"top_k {msg.top_k}")
        sess = TargetSession(msg.prompt, msg.temperature, msg.top_k, msg.seed, msg.max_new)
        if len(msg.prompt) > 1:
            x = torch.tensor([msg.prompt[:-1]], dtype=torch.long)
            sess.cache = self.model(input_ids=x, use_cache=True).cache
        return sess

    def close(self, sess: TargetSession) -> None:
        """Free the session's KV cache."""
        sess.cache = None
        sess.closed = True

    def _check_ids(self, ids) -> None:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise SessionError("protocol", f"token id {bad[0]} outside the vocabulary "
                               f"(0..{self.vocab_size - 1})")

    # -- batched steps ------------------------------------------------------------------

    def _prepare(self, sess: TargetSession, req) -> tuple[list[int], int]:
        """Validate ``req`` against ``sess``; returns the ids to feed and how many cached
        positions they follow. A FUSE after a FUSE feeds only the newly committed ids (the
        cache already holds every token); otherwise the last committed token is fed again
        first, so its logits score the first drafted token."""
        if sess.closed:
            raise SessionError("protocol", "session is closed")
        if req.base_len != len(sess.tokens):
            raise SessionError("sync", f"request assumes {req.base_len} committed tokens, the "
                               f"cloud has {len(sess.tokens)}")
        if isinstance(req, P.Verify):
            new = list(req.draft)
            if sess.temperature > 0 and new and np.shape(req.q_ids)[-1:] in ((0,), ()):
                raise SessionError("protocol", "sampling session sent a draft without its q")
            if np.size(req.q_ids):
                self._check_ids(np.asarray(req.q_ids).reshape(-1).tolist())
        else:
            new = list(req.committed)
            if not 1 <= req.k <= min(P.MAX_TOPK, self.vocab_size):
                raise SessionError("protocol", f"top-k {req.k} out of range")
        self._check_ids(new)
        if len(sess.tokens) + len(new) + 1 > self.context_len:
            raise SessionError("context", f"session would exceed the context of {self.context_len}")
        if isinstance(req, P.Fuse) and new and sess.cached == len(sess.tokens):
            return new, sess.cached
        return [sess.tokens[-1]] + new, len(sess.tokens) - 1

    @torch.no_grad()
    def step(self, jobs: list[tuple[TargetSession, P.Verify | P.Fuse]]) -> list[P.Message]:
        """Answer VERIFY / FUSE requests of several sessions with one forward pass.

        Returns one message per job, in order: ``Verified``, ``TopK`` or ``Error``. A refused
        job leaves its session unchanged; the others proceed. At most one job per session."""
        if len({id(s) for s, _ in jobs}) != len(jobs):
            raise ValueError("at most one job per session in a batch")
        replies: list[P.Message | None] = [None] * len(jobs)
        live, inputs, pasts = [], [], []
        for j, (sess, req) in enumerate(jobs):
            try:
                ids, past = self._prepare(sess, req)
                inputs.append(ids)
                pasts.append(past)
                live.append(j)
            except SessionError as exc:
                replies[j] = P.Error(exc.code, str(exc))
        if live:
            logits, caches = self._forward([jobs[j][0] for j in live], inputs, pasts)
            for b, j in enumerate(live):
                sess, req = jobs[j]
                try:  # one bad job never costs the others their answers
                    replies[j] = self._finish(sess, req, logits[b], caches[b])
                except Exception as exc:  # noqa: BLE001 - the session is left unchanged
                    code = getattr(exc, "code", "protocol" if isinstance(exc, ValueError) else "internal")
                    replies[j] = P.Error(code, f"{type(exc).__name__}: {exc}")
            self.batches += 1
            self.jobs += len(live)
        return replies  # type: ignore[return-value]

    def _forward(self, sessions: list[TargetSession], inputs: list[list[int]], pasts: list[int]):
        """Logits ``[m_b, V]`` and the new KV layers per row (see :func:`batched_forward`)."""
        per = [_kv(s.cache, self.n_layers, L) for s, L in zip(sessions, pasts)]
        return batched_forward(self.model, per, pasts, inputs, self.pad_id, self.min_block_rows)

    def _finish(self, sess: TargetSession, req, logits: torch.Tensor, kv) -> P.Message:
        """Turn one row's logits into the reply and commit the session (cache cropped)."""
        base = len(sess.tokens)
        if isinstance(req, P.Verify):
            draft = list(req.draft)
            if sess.temperature > 0:
                q = [sparse_q(req.q_ids[i], req.q_probs[i]) for i in range(len(draft))]
                p = target_probs(logits, sess.temperature, sess.top_k)
                n, token = verify_sampled(p, draft, q, sess.gen)
            else:
                n, token = verify_greedy(torch.argmax(logits, dim=-1).tolist(), draft)
            keep = base + n  # tokens[:-1], the re-fed last token and the n kept drafts
            sess.cache = cache_from_layers([(k[:, :, :keep], v[:, :, :keep]) for k, v in kv])
            sess.tokens = sess.tokens + draft[:n] + [token]
            return P.Verified(req.req, n, token)
        committed = list(req.committed)
        logp = torch.log_softmax(logits[-1].double(), dim=-1)
        vals, ids = torch.topk(logp, req.k)
        mass = float(torch.exp(vals).sum())
        tail = math.log(max(1.0 - mass, 1e-30))
        top = float(np.float16(vals[0]))
        scale = float(np.float16(max(top - float(vals[-1]), 1e-3) / 255.0))
        q = torch.clamp(torch.round((top - vals) / scale), 0, 255).to(torch.uint8).numpy()
        sess.tokens = sess.tokens + committed
        keep = len(sess.tokens)  # every token: the next FUSE feeds only what is new
        sess.cache = cache_from_layers([(k[:, :, :keep], v[:, :, :keep]) for k, v in kv])
        return P.TopK(req.req, ids.numpy().astype(np.int64), q, top, scale, tail)
