"""The device end of split inference: the target's first and last layers run here, the
cloud runs only the middle ones (:mod:`edgefuse.cloud.split`, the wire in
:mod:`edgefuse.cloud.protocol`, the cloud side in :mod:`edgefuse.cloud.split_target`).

A :class:`SplitSession` holds one session's :class:`~edgefuse.cloud.split.DeviceSplit` and
the device's copy of the row ledger (:class:`~edgefuse.cloud.protocol.SplitLedger`, the same
arithmetic as the cloud's). :meth:`SplitSession.score` is one round trip (two with a split
head): the front over the last committed token and the drafts, one MID, the back, the head
(local, or HEAD → LOGITS fused over the vocabulary mask); the device verifies the block
itself because it holds the final logits. The decoder's ``split`` mode is this with γ = 0
(one round trip per token: the naive split), ``split_spec`` drafts a block first
(speculative decoding through the split, Leviathan et al. 2023).

The cloud sees the activations after layer ``k`` (int8 with per-row scales, or float16),
and with a split head the last ``D - head_split`` columns of the final hidden state; never
token ids or text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from edgefuse.cloud import protocol as P
from edgefuse.cloud import split as S
from edgefuse.cloud import vocab as V
from edgefuse.cloud.speculative import sparse_q, target_probs, verify_greedy, verify_sampled

FILLS = V.FILLS
CORPUS_MASK = "corpus"  # an explicit mask of the public corpus's most frequent tokens (MASK)
MASKS = V.MASK_NAMES + (CORPUS_MASK,)


@dataclass(frozen=True)
class SplitSettings:
    """What a device asks of a split session (config ``cloud.split``).

    ``k`` / ``m``: decoder layers the device runs first / last; ``head_split``: None = the
    device holds the whole LM head, ``s`` = it holds columns ``[:s]`` and the cloud the rest
    (then ``mask`` names the vocabulary the cloud scores: a name of
    :data:`edgefuse.cloud.vocab.MASK_NAMES`, default ``full``, or ``corpus``: the
    ``mask_size`` most frequent tokens of the public draft corpus, sent as an explicit
    MASK bitmap once per session); ``act``: activations on the
    link, ``int8`` (per-row scales) or ``float16``; ``head_topk``: 0 = the cloud returns the
    whole mask 8-bit, k = its top-k within the mask; ``fill``: what a mask token outside the
    top-k gets (:func:`edgefuse.cloud.vocab.fuse_split_head`); ``stream_block``: prompt rows
    per MID of a pipelined prefill (0 = the whole prompt in one MID); ``adapter``: a PEFT
    LoRA folder merged into the device's own layers (:func:`edgefuse.lora.merge_local_adapter`;
    it never leaves the device, the cloud's middle stays the base model's).

    Raises ``ValueError`` for out-of-range values (the model's own bounds are checked by
    :meth:`spec` against its config)."""
    k: int = 2
    m: int = 2
    head_split: int | None = None
    act: str = "int8"
    mask: str | None = None
    mask_size: int = 32768
    head_topk: int = 0
    fill: str = "drop"
    stream_block: int = 0
    adapter: str | None = None

    def __post_init__(self):
        S.SplitSpec(self.k, self.m, self.head_split, self.act)  # types and ranges
        if self.mask is not None and self.mask not in MASKS:
            raise ValueError(f"split mask {self.mask!r:.40} is unknown: choose from {', '.join(MASKS)}")
        if isinstance(self.mask_size, bool) or not isinstance(self.mask_size, int) \
                or not 1 <= self.mask_size <= V.MAX_VOCAB:
            raise ValueError(f"split mask_size must be in 1..{V.MAX_VOCAB}, got {self.mask_size!r:.40}")
        if self.mask is not None and self.head_split is None:
            raise ValueError("a vocabulary mask needs a split head (head_split): with the whole "
                             "head on the device nothing is masked at the cloud")
        if isinstance(self.head_topk, bool) or not isinstance(self.head_topk, int) \
                or not 0 <= self.head_topk <= P.MAX_TOPK:
            raise ValueError(f"split head_topk must be in 0..{P.MAX_TOPK}, got {self.head_topk!r}")
        if isinstance(self.stream_block, bool) or not isinstance(self.stream_block, int) \
                or self.stream_block < 0:
            raise ValueError(f"split stream_block must be an int >= 0, got {self.stream_block!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"split adapter must be a folder path or null, got {self.adapter!r:.60}")
        if self.fill not in FILLS:
            raise ValueError(f"split fill must be one of {', '.join(FILLS)}, got {self.fill!r}")

    def spec(self, n_layers: int, hidden_size: int) -> S.SplitSpec:
        """The :class:`~edgefuse.cloud.split.SplitSpec`, checked against a model of
        ``n_layers`` decoder layers and hidden size ``hidden_size``."""
        return S.SplitSpec(self.k, self.m, self.head_split, self.act).check(n_layers, hidden_size)

    def request(self) -> P.SplitRequest:
        """The OPEN's ``split`` field."""
        mask = None if self.head_split is None else (self.mask or "full")
        return P.SplitRequest(self.k, self.m, self.head_split, self.act,
                              V.EXPLICIT if mask == CORPUS_MASK else mask)

    def label(self) -> str:
        """A short name for result rows: ``k2 m2 int8`` (``+ head 768 english top16``)."""
        out = f"k{self.k} m{self.m} {self.act}"
        if self.head_split is not None:
            mask = f"corpus{self.mask_size}" if self.mask == CORPUS_MASK else (self.mask or "full")
            out += f" + head {self.head_split} {mask}"
            out += f" top{self.head_topk}" if self.head_topk else ""
        return out + (" + device LoRA" if self.adapter else "")

    def to_dict(self) -> dict:
        return {"k": self.k, "m": self.m, "head_split": self.head_split, "act": self.act,
                "mask": self.mask, "mask_size": self.mask_size, "head_topk": self.head_topk, "fill": self.fill,
                "stream_block": self.stream_block, "adapter": self.adapter}


def settings_from_config(node) -> SplitSettings:
    """:class:`SplitSettings` of a ``cloud.split`` config group (a key it lacks takes the
    default). Raises ``ValueError`` naming a bad value."""
    base = SplitSettings()
    get = node.get if hasattr(node, "get") else (lambda key, d=None: getattr(node, key, d))
    values = {}
    for key in ("k", "m", "head_split", "act", "mask", "mask_size", "head_topk", "fill", "stream_block",
                "adapter"):
        v = get(key, getattr(base, key))
        values[key] = v if v is None or isinstance(v, (bool, int, str)) else \
            (int(v) if float(v).is_integer() else v)
    return SplitSettings(**values)


class SplitSession:
    """One split session on a :class:`edgefuse.cloud.link.CloudLink`.

    Args:
        link: a connected link (one session at a time, like every mode).
        parts: the device's :class:`~edgefuse.cloud.split.SplitParts` (front, back, head;
            shared by the sessions of one device process).
        settings: :class:`SplitSettings`.
        fingerprint: the target tokenizer's fingerprint.
        tok: the target's tokenizer (its vocabulary masks).
        mask_ids: the ids of a ``corpus`` mask (:func:`edgefuse.cloud.devices.corpus_mask_ids`).
        auth: the cache tuple (flagCache, LCache) every MID carries.
        timeout_s: a request unanswered this long means the cloud is gone.
        seed: the seed of the device's verification sampler (temperature > 0).

    Counters: ``mids`` / ``heads`` (requests sent), ``rows_sent`` (front rows sent, re-sent
    window rows included), ``resent_rows``, ``ahead_blocks`` (blocks sent with the front
    rows :meth:`prefront` ran while the block before was in flight).
    """

    def __init__(self, link, parts: S.SplitParts, settings: SplitSettings, fingerprint: str, tok,
                 auth: P.CloudAuth, timeout_s: float = 60.0, seed: int = 0, mask_ids=None):
        self.link, self.parts, self.settings = link, parts, settings
        self.spec = settings.spec(parts.n_layers, parts.hidden_size)
        self.fingerprint, self.auth, self.timeout_s = fingerprint, auth, float(timeout_s)
        self.mask = session_mask(settings, tok, parts.vocab_size, mask_ids)
        self.device = S.DeviceSplit(parts, self.spec)
        self.ledger = P.SplitLedger()
        digest = hashlib.sha256(b"edgefuse/split-verify/" + str(int(seed)).encode()).digest()
        self.gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
        self._req = 0
        self._ids: list[int] = []  # the token id of each row the front holds
        self.mids = self.heads = self.rows_sent = self.resent_rows = self.ahead_blocks = 0

    def _next_req(self) -> int:
        self._req = (self._req + 1) % 2**32
        return self._req

    def open(self, prompt: list[int]) -> None:
        """OPEN the split session (no ids sent) and prefill ``prompt[:-1]`` through the split
        (one MID), so the first :meth:`score` feeds the prompt's last token. Raises
        :class:`edgefuse.cloud.protocol.RemoteError` (``split``: a split this cloud does not
        serve), ``TimeoutError``, ``ConnectionError``."""
        if not prompt:
            raise ValueError("split: empty prompt")
        self.link.open_split(self.settings.request(), self.fingerprint, auth=self.auth,
                             timeout_s=self.timeout_s)
        if self.settings.head_split is not None and self.settings.mask == CORPUS_MASK:
            reply = self.link.request(P.Mask(V.mask_to_bitmap(self.mask, self.parts.vocab_size)),
                                      timeout_s=self.timeout_s)
            if not isinstance(reply, P.Masked) or reply.count != int(self.mask.size):
                raise P.ProtocolError(f"expected MASKED with {self.mask.size} ids, got {reply!r:.120}")
        if len(prompt) > 1:
            self._prefill(list(prompt[:-1]))

    def _prefill(self, ids: list[int]) -> None:
        """Prompt rows through the split. With ``settings.stream_block`` = B the rows go in
        blocks of B, pipelined: the front of block j+1 runs while block j is in flight and the
        back of block j while block j+1 is (each MID commits the block before it, which the
        cloud answers in order); without it, one MID."""
        block = self.settings.stream_block or len(ids)
        pending = None  # the MID in flight
        for start in range(0, len(ids), block):
            sent = self._send_mid(start, self._front(ids[start:start + block]))
            if pending is not None:
                self.device.back(self._take_mid(*pending))  # while the next block is in flight
            pending = sent
        self.device.back(self._take_mid(*pending))

    def _send_mid(self, base_len: int, new: torch.Tensor) -> tuple[P.Mid, int]:
        """Send one MID: commit ``base_len`` rows, re-send what the window needs, then ``new``
        (``[n, D]``, positions base_len ..). The ledger commits at once (the cloud answers in
        order; an ERROR ends the session). Returns ``(msg, n)`` for :meth:`_take_mid`."""
        led, auth = self.ledger, self.auth
        led.apply(auth)
        led.check(base_len)
        c = led.resend(auth, base_len)
        start = base_len - auth.window(base_len)
        rows = torch.cat([self.device.front_rows(start, start + c).float(), new.float()])
        n = int(new.shape[0])
        msg = P.Mid(self._next_req(), base_len, c, n, S.encode_acts(rows, self.spec.act), auth=auth)
        self.link.send(msg)
        self.link.count_round_trip()
        led.commit(auth, base_len, n)
        self.mids += 1
        self.rows_sent += c + n
        self.resent_rows += c
        return msg, n

    def _take_mid(self, msg: P.Mid, n: int) -> torch.Tensor:
        """The MIDOUT answering ``msg``: the middle's output ``[n, D]``."""
        reply = self.link.recv(timeout_s=self.timeout_s)
        if not isinstance(reply, P.MidOut) or reply.req != msg.req or reply.n != n:
            raise P.ProtocolError(f"expected MIDOUT for request {msg.req} with {n} rows, got {reply!r:.120}")
        return S.decode_acts(reply.acts, n, self.parts.hidden_size, self.spec.act)

    def _mid(self, base_len: int, new: torch.Tensor) -> torch.Tensor:
        """One MID round trip (see :meth:`_send_mid`); returns the middle's output ``[n, D]``."""
        return self._take_mid(*self._send_mid(base_len, new))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """``float32 [n, V]`` logits of final hidden rows ``h [n, D]``: the whole head here,
        or z_end here + the cloud's masked part (HEAD → LOGITS), -inf outside the mask."""
        if self.spec.head_split is None:
            return self.device.logits(h)
        z_end, tail = self.device.head_part(h)
        k, n = self.settings.head_topk, int(h.shape[0])
        msg = P.Head(self._next_req(), n, k, S.encode_acts(tail.float(), self.spec.act))
        reply = self.link.request(msg, timeout_s=self.timeout_s)
        if not isinstance(reply, P.Logits) or reply.req != msg.req:
            raise P.ProtocolError(f"expected LOGITS for request {msg.req}, got {reply!r:.120}")
        self.heads += 1
        z = V.decode_masked(reply.payload, n, int(self.mask.size), k)
        return V.fuse_split_head(z_end, z, self.mask, softcap=self.parts.softcap, fill=self.settings.fill)

    def _front(self, ids: list[int]) -> torch.Tensor:
        """The front over ``ids`` at the end of what it holds (their ids remembered)."""
        out = self.device.front(ids)
        self._ids.extend(int(t) for t in ids)
        return out

    def _crop(self, n: int) -> None:
        self.device.crop(n)
        del self._ids[n:]

    @torch.no_grad()
    def prefront(self, ids: list[int]) -> None:
        """Run the front over ``ids`` ahead of time, at the positions after every row it
        holds (the look-ahead of a block in flight: the cloud's guessed token and the drafts
        on top of it). :meth:`send_block` uses the rows if its block turns out to be exactly
        these ids, and rolls them back otherwise."""
        if ids:
            self._front(list(ids))

    @torch.no_grad()
    def send_block(self, committed: list[int], draft: list[int]) -> tuple[P.Mid, int]:
        """Send the block of the last committed token and ``draft`` (γ ids) as one MID:
        both halves roll back to ``len(committed) - 1`` rows first (the rejected drafts of
        the previous block), and the front runs over the block unless :meth:`prefront`
        already ran it over exactly these ids. Returns the pending request for
        :meth:`take_block`."""
        base = len(committed) - 1
        want = list(committed) + [int(t) for t in draft]
        if self.device.length >= len(want) and self._ids[base:len(want)] == want[base:] \
                and self._ids[:base] == want[:base]:
            self._crop(len(want))  # the look-ahead was right: its front rows are the block's
            x = self.device.front_rows(base, len(want))
            self.ahead_blocks += 1
        else:
            self._crop(base)
            x = self._front(want[base:])
        return self._send_mid(base, x)

    @torch.no_grad()
    def take_block(self, pending: tuple[P.Mid, int], committed: list[int], draft: list[int],
                   temperature: float, top_k: int, q=None, reply=None) -> tuple[int, int]:
        """Finish the block :meth:`send_block` sent: its MIDOUT (``reply`` if already
        received, else the next message), the back and the head (a HEAD round trip with a
        split head), then verify ``draft`` on the device: ``(accepted, next token)``, greedy
        (temperature 0) or by exact rejection sampling against the drafts' sparse ``q``
        (lossless either way). Raises :class:`edgefuse.cloud.protocol.ProtocolError` for
        any other answer."""
        msg, n = pending
        if reply is None:
            reply = self.link.recv(timeout_s=self.timeout_s)
        if not isinstance(reply, P.MidOut) or reply.req != msg.req or reply.n != n:
            raise P.ProtocolError(f"expected MIDOUT for request {msg.req} with {n} rows, got {reply!r:.120}")
        h = S.decode_acts(reply.acts, n, self.parts.hidden_size, self.spec.act)
        logits = self._logits(self.device.back(h))
        if temperature == 0:
            return verify_greedy(torch.argmax(logits, dim=-1).tolist(), list(draft))
        p = target_probs(logits, temperature, top_k)
        return verify_sampled(p, list(draft), [sparse_q(a, b) for a, b in q], self.gen)

    @torch.no_grad()
    def score(self, committed: list[int], draft: list[int]) -> torch.Tensor:
        """The target's logits ``float32 [γ + 1, V]`` after ``committed`` and each prefix of
        ``draft`` (γ ids): rolls both halves back to ``len(committed) - 1`` rows first (the
        rejected drafts of the previous block), then one MID of the last committed token and
        the drafts."""
        base = len(committed) - 1
        self._crop(base)
        x = self._front([committed[-1]] + list(draft))
        return self._logits(self.device.back(self._mid(base, x)))

    def verify(self, committed: list[int], draft, temperature: float, top_k: int) -> tuple[int, int]:
        """Verify a :class:`~edgefuse.cloud.decoding.drafters.Draft` on top of ``committed``
        in one synchronous round trip: ``(accepted, next token)`` (see :meth:`take_block`)."""
        return self.take_block(self.send_block(committed, draft.ids), committed, draft.ids,
                               temperature, top_k, q=draft.q)

    def close(self) -> None:
        """CLOSE the session (the cloud frees its middle cache); the link stays open."""
        self.link.send(P.Close())


def session_mask(settings: SplitSettings, tok, vocab_size: int, mask_ids=None):
    """The vocabulary mask a split session's head decodes over (``int64`` sorted ids; None
    without a split head): the named mask of ``tok``, or for ``corpus`` the explicit set
    ``mask_ids`` (special ids added). Raises ``ValueError`` for a corpus mask without ids."""
    if settings.head_split is None:
        return None
    if settings.mask == CORPUS_MASK:
        if mask_ids is None:
            raise ValueError("a corpus mask needs its ids (edgefuse.cloud.devices.with_corpus_mask)")
        return V.vocab_mask(tok, V.EXPLICIT, vocab_size=vocab_size, ids=mask_ids)
    return V.vocab_mask(tok, settings.mask or "full", vocab_size=vocab_size)


@dataclass
class SplitDevice:
    """What a device holds for split inference: the target's device parts (shared by its
    sessions), the settings, the target's tokenizer and its fingerprint. :meth:`session`
    starts one :class:`SplitSession` on a link."""
    parts: S.SplitParts
    settings: SplitSettings
    tok: object
    fingerprint: str
    mask_ids: object = None  # a corpus mask's ids (edgefuse.cloud.devices.with_corpus_mask)

    def session(self, link, auth: P.CloudAuth, timeout_s: float, seed: int = 0) -> SplitSession:
        return SplitSession(link, self.parts, self.settings, self.fingerprint, self.tok, auth,
                            timeout_s=timeout_s, seed=seed, mask_ids=self.mask_ids)


def load_split_device(name: str, settings: SplitSettings, root=None, device: str = "cpu") -> SplitDevice:
    """Load the target ``name`` (the cloud's model, from the local model cache) with only
    the layers the device runs (the first ``k``, the last ``m``, the embeddings, the final
    norm and the head: the middle layers' weights are never read), merge the device's own
    LoRA into them (``settings.adapter``) and cut it at ``settings`` (a ``corpus`` mask's ids
    are :func:`edgefuse.cloud.devices.with_corpus_mask`'s). Raises ``ValueError`` for a
    split the model cannot take or an adapter it cannot merge (named)."""
    from transformers import AutoConfig

    from edgefuse.cloud.target import tokenizer_fingerprint
    from edgefuse.models import get_spec, load_model, resolve_path

    spec = get_spec(name)
    if spec.tiny:
        from edgefuse.models import tiny_model

        n_layers = int(tiny_model(spec.arch, tokenizer=spec.tokenizer)[0].config.num_hidden_layers)
    else:
        n_layers = int(AutoConfig.from_pretrained(resolve_path(spec, root)).num_hidden_layers)
    if settings.k + settings.m > n_layers - 1:
        raise ValueError(f"cloud.split k={settings.k}, m={settings.m} leaves no middle layer of "
                         f"{name}'s {n_layers}")
    keep = list(range(settings.k)) + list(range(n_layers - settings.m, n_layers))
    model, tok = load_model(name, root=root, device=device, layers=keep)
    if settings.adapter:
        from edgefuse.lora import merge_local_adapter

        model = merge_local_adapter(model, settings.adapter, keep)
    model.requires_grad_(False)
    cfg = model.config
    settings.spec(int(cfg.num_hidden_layers), int(cfg.hidden_size))
    parts = S.free_unused(S.split_model(model, settings.k, settings.m, middle=False), "device")
    return SplitDevice(parts, settings, tok, tokenizer_fingerprint(tok))
