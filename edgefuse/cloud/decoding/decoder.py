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
  After a rejection the device drafts before sending only where that pays
  (:meth:`GammaController.choose_restart`); else the cloud's step goes out at once (γ = 0)
  and the drafts for the block after it are made in its shadow.
- ``fusion_static`` / ``fusion_adaptive``: per token the device fuses its log-probabilities
  with the cloud's top-k (:mod:`edgefuse.cloud.fusion`); a per-token deadline makes the device emit
  its own token when the cloud is late (the cloud stays in sync because every request
  carries the tokens the device committed).
- ``split`` / ``split_spec``: split inference (:mod:`.split`). The device runs the target's
  embeddings, first ``k`` and last ``m`` layers and its head; the cloud only the middle
  layers, seeing activations, never ids. ``split`` is one round trip per token (the naive
  split, γ = 0); ``split_spec`` drafts a block and verifies it through the split in one
  round trip, verifying on the device (it holds the final logits), pipelined as
  ``spec_async`` (``DecodeConfig.split_pipeline``): while a block's MID is in flight the
  device drafts the next block on its guess of the target's token and runs the front over
  it, so a right guess sends the next MID at once. Greedy output equals
  the unsplit target's up to the int8 activation error (identical with float16 rows in
  the tests).

Every link mode but the split ones sends the OPEN first and prefills the device (and drafts
the first block) while the cloud prefills; each generation's controller starts from the
acceptance rate the device's earlier generations of that mode achieved.

The speculative modes draft with a :class:`~edgefuse.cloud.decoding.drafters.Drafter`
(full head, pruned head, shallow layers or prompt lookup, ``cloud.decode.drafter``); the
loop holds one and never asks which. The edge's own tokens (``edge``, fusion, the
fallback) always come from the :class:`~edgefuse.cloud.decoding.edge.EdgeLM` with its full
head.

**A device of another tokenizer** (``cross``, :mod:`edgefuse.cloud.crossvocab`): the loop
works in the cloud's ids on the cloud's rendering of the prompt, the device's drafter is
wrapped in a :class:`~edgefuse.cloud.decoding.cross.CrossDrafter`, fusion runs over byte-string
candidates (:meth:`Decoder._fusion_cross`), and the device's model follows the committed text
byte for byte. The result's ``tokens`` are then the cloud's ids (``tokenizer = "cross"``).

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

import collections
import itertools
import math
import time
from dataclasses import asdict, replace

import numpy as np
import torch

from edgefuse.cloud import protocol as P
from edgefuse.cloud.crossvocab import ByteFollower, CrossVocab, candidates, fuse_candidates, utf8_boundary
from edgefuse.cloud.decoding.config import MODES, SPLIT_MODES, DecodeConfig, DecodeError
from edgefuse.cloud.decoding.cross import CrossDrafter
from edgefuse.cloud.decoding.drafters import Draft, Drafter, FullHeadDrafter, drafter_for
from edgefuse.cloud.decoding.edge import EdgeLM
from edgefuse.cloud.decoding.result import DecodeResult
from edgefuse.cloud.fusion import FusionConfig, cloud_logprobs, edge_weight, fuse
from edgefuse.cloud.speculative import GammaController

SPEC_MODES = ("spec_sync", "spec_async", "split_spec")  # the modes that draft with the decoder's drafter
ROUND_TRIP_SAMPLES = 3  # round trips per γ whose median is its cost (fewer: tried again)
ACHIEVED_BLOCKS = 4  # blocks per γ whose achieved cost per token the controller compares


def _medians(samples: dict) -> dict[int, float]:
    """γ -> the median of its round-trip samples (ms)."""
    return {g: float(np.median(d)) for g, d in samples.items()}


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
        edge: the device's :class:`EdgeLM` (the ``edge`` and fusion modes, the fallback).
        link: a connected :class:`edgefuse.cloud.link.CloudLink` (None: only ``edge`` works).
        fingerprint: the edge tokenizer's fingerprint (:func:`edgefuse.cloud.target.tokenizer_fingerprint`).
        rtt_ms: the link's RTT the γ controller assumes (ms; e.g. the WAN preset's).
        drafter: what proposes the drafts of the speculative modes (None:
            :func:`~edgefuse.cloud.decoding.drafters.drafter_for` ``edge``, its pruned head
            if it has one, else its full head).
        split: the target's device parts for ``split`` / ``split_spec``
            (:class:`~edgefuse.cloud.decoding.split.SplitDevice`; None: those modes raise).
        cross: the device's and the cloud's vocabularies when they differ
            (:class:`~edgefuse.cloud.crossvocab.CrossVocab`; ``fingerprint`` is then the
            cloud tokenizer's, and every link mode needs the cloud's ids of the prompt).
    """

    def __init__(self, edge: EdgeLM, link=None, fingerprint: str = "", rtt_ms: float = 20.0,
                 drafter: Drafter | None = None, split=None, cross: CrossVocab | None = None):
        self.edge, self.link, self.fingerprint = edge, link, fingerprint
        self.cross = cross
        self._ends = edge.eos_ids  # the end ids of the generation in progress (its vocabulary)
        self._vocab = edge.vocab_size  # and the size of that vocabulary
        self._device_prompt: list[int] = []
        self.split = split
        self._session = None  # the split session of the generation in progress
        self.drafter = drafter if drafter is not None else drafter_for(edge)
        self.rtt_ms = rtt_ms
        self.draft_ms = 50.0
        self.verify_ms = 100.0
        # per mode, γ -> the last ROUND_TRIP_SAMPLES round trips (ms) of blocks of γ drafts:
        # the γ controller's cost table (round_trip_ms), kept across generations
        self._samples: dict[str, dict[int, collections.deque]] = {}
        self._mode_samples: dict[int, collections.deque] = {}
        # per mode, γ -> the last drafting times (ms) on a restart's critical path (spec_async)
        self._restarts: dict[str, dict[int, collections.deque]] = {}
        self._mode_restarts: dict[int, collections.deque] = {}
        # per mode, the acceptance rate a generation starts from: the device's own record
        self._prior: dict[str, float] = {}
        self._req = 0
        self._held = 0  # mirror: committed tokens the cloud holds after the last request
        # this generation's γ -> the last blocks' (committed tokens, ms from the previous answer)
        self._achieved: dict[int, collections.deque] = {}
        self._last_answer = 0.0

    # -- public ----------------------------------------------------------------------

    def generate(self, mode: str, prompt: list[int], cfg: DecodeConfig,
                 cloud_prompt: list[int] | None = None) -> DecodeResult:
        """Generate up to ``cfg.max_new_tokens`` after ``prompt`` (the device's ids) in ``mode``;
        with ``cross``, a link mode decodes after ``cloud_prompt`` (the cloud's ids of the same
        prompt, in its own template) and the device follows on ``prompt``.

        Raises :class:`DecodeError` for an unknown mode, a link mode without a link or (with
        ``cross``) without ``cloud_prompt``, and
        :class:`edgefuse.cloud.protocol.RemoteError` when the cloud refuses the session (``fingerprint``:
        another tokenizer; ``context``: too long). The cloud sees only what ``cfg.auth``
        lets it keep and attend to. A cloud that is unreachable, busy, or fails
        mid-way does not raise: the rest is edge-only (``fallback`` says so)."""
        if mode not in MODES:
            raise DecodeError(f"unknown decoding mode {mode!r}; choose from {', '.join(MODES)}")
        if mode != "edge" and self.link is None:
            raise DecodeError(f"mode {mode!r} needs a cloud link")
        if mode in SPLIT_MODES and self.split is None:
            raise DecodeError(f"mode {mode!r} needs the target's device layers (cloud.split)")
        cross = self.cross if mode != "edge" else None
        if cross is not None and cloud_prompt is None:
            raise DecodeError(f"mode {mode!r} of a device of another tokenizer needs the cloud's "
                              "ids of the prompt (cloud_prompt)")
        res = DecodeResult(mode=mode, tokens=[], tokenizer="cross" if cross else
                           "own" if mode == "edge" else "same")
        self._achieved = {}
        self._device_prompt = list(prompt)
        self._ends = cross.cloud.ends if cross is not None else self.edge.eos_ids
        self._vocab = cross.cloud.size if cross is not None else self.edge.vocab_size  # of the loop's ids
        if cross is not None:
            prompt = list(cloud_prompt)
        table = mode + ("/sync" if mode == "split_spec" and not cfg.split_pipeline else "")
        self._mode_samples = self._samples.setdefault(table, {})
        self._mode_restarts = self._restarts.setdefault(table, {})
        pipelined = mode == "spec_async" or (mode == "split_spec" and cfg.split_pipeline)
        gen = torch.Generator().manual_seed(cfg.seed)
        t0 = time.perf_counter()
        c0 = self._counters()
        # cloud (γ = 0), edge and fusion draft nothing: the edge itself follows the output
        drafter = self.drafter if mode in SPEC_MODES else FullHeadDrafter(self.edge)
        if cross is not None:  # the loop sees the cloud's ids; the device follows on bytes
            drafter = CrossDrafter(drafter, cross, self._device_prompt)
        res.drafter = drafter.name if mode in SPEC_MODES else None
        ctl = GammaController(cfg.gamma_min, cfg.gamma_max,
                              fixed=0 if mode in ("cloud", "split") else cfg.gamma,
                              zero=cfg.gamma0_fallback, alpha0=self._prior.get(table, 0.7))
        first: list[Draft] = []  # the first block, drafted while the cloud prefills

        def prefill_on_device():
            drafter.start(prompt)
            if mode in ("spec_sync", "spec_async"):
                g = self._restart_gamma(ctl) if pipelined else self._choose(ctl)
                first.append(self._draft(drafter, min(g, max(cfg.max_new_tokens - 1, 0)), cfg, gen))

        if mode == "edge" or mode in SPLIT_MODES:
            drafter.start(prompt)
        if mode != "edge":
            try:
                if mode in SPLIT_MODES:
                    self._session = self.split.session(self.link, cfg.auth, cfg.timeout_s, cfg.seed)
                    res.split = self.split.settings.label()
                    self._session.open(prompt)
                else:  # the device prefills (and drafts) while the cloud does
                    self._open(prompt, cfg, meanwhile=prefill_on_device)
            except BaseException as exc:
                self._session = None  # a split that did not open serves no later mode
                if not isinstance(exc, (ConnectionError, OSError)):
                    try:  # the cloud may hold a session it opened late or we refused: end it
                        self.link.send(P.Close())
                    except (ConnectionError, OSError):
                        pass
                if not isinstance(exc, (ConnectionError, TimeoutError, OSError, P.RemoteError)) \
                        or (isinstance(exc, P.RemoteError) and exc.code != "busy"):
                    raise  # a refused pair (fingerprint, context), a lying cloud: an error, not an outage
                res.fallback = f"cloud unavailable at the start ({exc}); edge only"
                mode, res.drafter, cross = "edge", None, None
                res.tokenizer, self._ends = "own", self.edge.eos_ids
                self.edge.sync(self._device_prompt)
        t1 = time.perf_counter()
        res.prefill_s = t1 - t0
        self._last_answer = t1
        c1 = self._counters()
        res.prefill_bytes_up, res.prefill_bytes_down = c1[0] - c0[0], c1[1] - c0[1]
        try:
            if mode == "edge":
                self._edge_only(cfg, gen, res)
            elif mode in ("cloud", "spec_sync", "split") or (mode == "split_spec" and not cfg.split_pipeline):
                self._speculative(prompt, cfg, gen, res, drafter, ctl, first[0] if first else None)
            elif pipelined:
                self._speculative_async(prompt, cfg, gen, res, drafter, ctl, first[0] if first else None)
            elif cross is not None:
                self._fusion_cross(prompt, cfg, self._fusion_config(mode, cfg), gen, res)
            else:
                self._fusion(prompt, cfg, self._fusion_config(mode, cfg), gen, res)
        finally:
            res.decode_s = time.perf_counter() - t1
            if res.drafted:  # the next generation starts from the device's record, not a guess
                self._prior[table] = 0.5 * self._prior.get(table, ctl.alpha0) + 0.5 * res.accepted / res.drafted
            if mode != "edge" and res.fallback is None:
                self.link.send(P.Close())  # frees the cloud's cache; the connection stays
            self._session = None
            c2 = self._counters()
            res.bytes_up, res.bytes_down, res.round_trips = (c2[i] - c1[i] for i in range(3))
        tok = self.cross.cloud_tok if res.tokenizer == "cross" else self.edge.tok
        res.text = tok.decode(res.tokens, skip_special_tokens=True)
        return res

    @staticmethod
    def _fusion_config(mode: str, cfg: DecodeConfig) -> FusionConfig:
        fcfg = cfg.fusion
        if (mode == "fusion_adaptive") != fcfg.adaptive:
            fcfg = FusionConfig(**{**asdict(fcfg), "adaptive": mode == "fusion_adaptive"})
        return fcfg

    def _open(self, prompt: list[int], cfg: DecodeConfig, meanwhile=None) -> None:
        """Start a session on the link, sending only the prompt ids the cloud may keep
        (``cfg.auth.held``; the others count as ``offset``); answers to the previous session
        still in flight (a late fusion top-k) are skipped. ``meanwhile()`` runs once the
        OPEN is sent, before its answer is awaited (the device's own prefill and first
        draft, overlapping the cloud's prefill). Raises ``RemoteError`` if the cloud
        refuses."""
        keep = cfg.auth.held(len(prompt))
        self.link.send(P.Open(list(prompt[len(prompt) - keep:]), self.fingerprint, cfg.temperature,
                              cfg.top_k, cfg.seed, cfg.max_new_tokens + cfg.gamma_max + 1,
                              auth=cfg.auth, offset=len(prompt) - keep))
        self._held = keep
        if meanwhile is not None:
            meanwhile()
        deadline = time.perf_counter() + cfg.timeout_s
        while True:
            msg = self.link.recv(timeout_s=max(deadline - time.perf_counter(), 0.0))
            if isinstance(msg, P.Opened):
                return

    def _counters(self) -> tuple[int, int, int]:
        link = self.link
        return (link.bytes_up, link.bytes_down, link.round_trips) if link is not None else (0, 0, 0)

    # -- modes -----------------------------------------------------------------------

    def _edge_only(self, cfg, gen, res) -> None:
        """Edge decoding from the edge's current tokens until done."""
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
        if res.tokenizer != "cross":
            self.edge.sync(committed)  # the edge may have drafted, or not followed the drafter
            self._edge_only(cfg, gen, res)
            return
        # another tokenizer: the device follows the committed text, goes on in its own ids, and
        # its text joins the result in the cloud's ids
        cv = self.cross
        dp = self._device_prompt
        if self.edge.tokens[:len(dp)] != dp:  # the drafter ran on another model: the edge starts anew
            self.edge.sync(dp)
        follow = ByteFollower(self.edge, cv.device_tok, cv.device, len(dp))
        follow.sync(cv.cloud.join(res.tokens))
        mark = len(self.edge.tokens)
        own = DecodeResult(mode=res.mode, tokens=[])
        self._edge_only(replace(cfg, max_new_tokens=max(cfg.max_new_tokens - len(res.tokens), 0)), gen, own)
        data = cv.device.join(self.edge.tokens[mark:])
        res.tokens.extend(cv.cloud_ids(data[:utf8_boundary(data)]))

    def _next_req(self) -> int:
        self._req = (self._req + 1) % 2**32
        return self._req

    def _draft(self, drafter: Drafter, n: int, cfg, gen) -> Draft:
        """Up to ``n`` drafts from ``drafter`` (held by it until verified); keeps the
        per-token drafting time (ms) for the γ controller."""
        t0 = time.perf_counter()
        draft = drafter.propose(n, cfg.temperature, cfg.draft_topk, gen)
        if draft.ids:
            ms = 1000 * (time.perf_counter() - t0) / len(draft.ids)
            self.draft_ms = 0.7 * self.draft_ms + 0.3 * ms
        return draft

    def _context(self, committed: list[int], base_len: int, cfg) -> list[int]:
        """The ids a request on top of ``committed[:base_len]`` re-sends: what its window
        (``cfg.auth.window``) needs beyond the ``self._held`` the cloud holds (the device's
        mirror of the cloud's rule, :class:`edgefuse.cloud.protocol.CloudAuth`)."""
        need = cfg.auth.window(base_len)
        return list(committed[base_len - need:base_len - self._held]) if need > self._held else []

    def _verify_msg(self, committed: list[int], draft: Draft, cfg) -> P.Verify:
        """The VERIFY of ``draft`` on top of ``committed``: with each token's sparse q at
        temperature > 0, the rows padded to one width with zero-probability ids.

        Raises:
            DecodeError: a sampled draft without a q for every token (a drafter's bug).
        """
        base_len = len(committed)
        ctx = dict(auth=cfg.auth, context=self._context(committed, base_len, cfg))
        if cfg.temperature == 0 or not draft.ids:
            return P.Verify(self._next_req(), base_len, draft.ids, **ctx)
        if len(draft.q) != len(draft.ids):
            raise DecodeError(f"the drafter drafted {len(draft.ids)} tokens with "
                              f"{len(draft.q)} q rows at temperature {cfg.temperature}")
        k = max(len(a) for a, _ in draft.q)
        qi = np.zeros((len(draft.ids), k), np.int64)
        qp = np.zeros((len(draft.ids), k), np.float16)
        for i, (a, b) in enumerate(draft.q):
            used = set(a.tolist())
            pad = list(itertools.islice((j for j in range(self.edge.vocab_size) if j not in used),
                                        k - len(a)))
            qi[i] = np.concatenate([a, np.asarray(pad, np.int64)])  # zero-probability padding
            qp[i, :len(b)] = b
        return P.Verify(self._next_req(), base_len, draft.ids, qi, qp, **ctx)

    def _commit(self, drafter: Drafter, res, committed, draft: Draft, n, token, cfg) -> tuple[bool, int]:
        """Apply a VERIFIED answer (``n`` of ``draft`` kept, then ``token``): ``drafter``
        observes it. Returns ``(done, drafts the drafter still holds beyond the committed
        ids)``: only ``spec_async``'s look-ahead can survive."""
        res.drafted += len(draft.ids)
        res.accepted += n
        res.blocks += 1
        new = list(draft.ids[:n]) + [int(token)]
        ahead = drafter.observe(n, int(token))
        committed.extend(new)
        self._held = cfg.auth.held(len(committed))
        kept, done = _stop(res.tokens + new, self._ends, cfg.max_new_tokens)
        res.tokens[:] = kept
        return done, ahead

    def _speculative(self, prompt, cfg, gen, res, drafter: Drafter, ctl: GammaController,
                     first: Draft | None = None) -> None:
        """``cloud``, ``split`` (``ctl`` fixed at γ = 0), ``spec_sync`` and ``split_spec``
        unpipelined: draft a block, verify it, commit; ``first``: the first block, if drafted."""
        committed = list(prompt)
        while True:
            left = cfg.max_new_tokens - len(res.tokens)
            if first is not None:
                draft, first = first, None
            else:
                g = min(self._choose(ctl), max(left - 1, 0))
                draft = self._draft(drafter, g, cfg, gen)
            t0 = time.perf_counter()
            try:
                n, token = self._verify(committed, draft, cfg)
            except (ConnectionError, TimeoutError, OSError, P.RemoteError) as exc:
                return self._fallback(res, exc, cfg, gen, committed)
            self._time_round_trip(1000 * (time.perf_counter() - t0), ctl, len(draft.ids))
            ctl.update(n, len(draft.ids))
            self._count_block(len(draft.ids), n + 1)
            done, ahead = self._commit(drafter, res, committed, draft, n, token, cfg)
            if done:
                return
            if ahead:  # nothing was drafted on top of this block's answer: start afresh
                drafter.rollback(len(committed))

    def _verify(self, committed: list[int], draft: Draft, cfg) -> tuple[int, int]:
        """``(accepted, next token)`` for ``draft`` on top of ``committed`` in one synchronous
        round trip: a VERIFY, or through the split session (the device verifies; one MID,
        plus a HEAD with a split head)."""
        pending = self._send_block(committed, draft, cfg)
        return self._take_block(pending, self.link.recv(timeout_s=cfg.timeout_s), committed, draft, cfg)

    @property
    def round_trip_ms(self) -> dict[str, dict[int, float]]:
        """Per mode (``split_spec/sync`` apart), γ -> the median of its last round trips (ms)."""
        return {mode: _medians(s) for mode, s in self._samples.items()}

    def _choose(self, ctl: GammaController, overlap: bool = False, probe: bool = True) -> int:
        """The controller's γ from the decoder's timings and this mode's measured round trips."""
        settled = self._settled()
        achieved = {g: sum(ms for _, ms in d) / max(sum(n for n, _ in d), 1)
                    for g, d in self._achieved.items() if len(d) >= 2}
        return ctl.choose(self.draft_ms, self.rtt_ms, self.verify_ms, overlap=overlap,
                          measured=_medians(self._mode_samples), settled=settled, achieved=achieved,
                          probe=probe)

    def _settled(self) -> set[int]:
        """The γs of this mode whose round-trip cost has its full sample."""
        return {g for g, d in self._mode_samples.items() if len(d) == ROUND_TRIP_SAMPLES}

    def _ahead(self, ctl: GammaController) -> int:
        """``spec_async``'s look-ahead bound: the γ that best fills a round trip when drafting
        overlaps it, at least 1 (drafting in the shadow costs no wait)."""
        return max(self._choose(ctl, overlap=True, probe=False), 1)

    def _restart_gamma(self, ctl: GammaController) -> int:
        """The γ of a ``spec_async`` restart (:meth:`GammaController.choose_restart`) from this
        mode's measured round trips and restart drafting times."""
        settled = self._settled()
        return ctl.choose_restart(self.draft_ms, self.rtt_ms, self.verify_ms, self._ahead(ctl),
                                  measured=_medians(self._mode_samples),
                                  restart_ms=_medians(self._mode_restarts), settled=settled)

    def _restart(self, drafter: Drafter, ctl: GammaController, cfg, gen, left: int,
                 rollback: int | None = None) -> Draft:
        """A restart's block, drafted on the critical path after rolling ``drafter`` back to
        ``rollback`` tokens (None: no rollback); keeps that time (ms) per γ."""
        t0 = time.perf_counter()
        if rollback is not None:
            drafter.rollback(rollback)
        g = min(self._restart_gamma(ctl), max(left - 1, 0))
        draft = self._draft(drafter, g, cfg, gen)
        if draft.ids:
            self._mode_restarts.setdefault(len(draft.ids), collections.deque(maxlen=ROUND_TRIP_SAMPLES)).append(
                1000 * (time.perf_counter() - t0))
        return draft

    def _count_block(self, gamma: int, tokens: int) -> None:
        """Keep what a block of ``gamma`` drafts achieved: ``tokens`` committed in the time
        since the previous answer (drafting, re-feeds and the round trip included)."""
        now = time.perf_counter()
        self._achieved.setdefault(gamma, collections.deque(maxlen=ACHIEVED_BLOCKS)).append(
            (tokens, 1000 * (now - self._last_answer)))
        self._last_answer = now

    def _time_round_trip(self, rt_ms: float, ctl: GammaController, gamma: int) -> None:
        """Split a measured round trip (ms) into the assumed RTT and the cloud's verify time,
        normalised to one token, for the γ controller; and keep it as this mode's measured
        cost of a block of ``gamma`` drafts."""
        base = ctl.verify_base_ms(max(rt_ms - self.rtt_ms, 1.0), gamma)
        self.verify_ms = 0.7 * self.verify_ms + 0.3 * base
        if gamma > 0:  # its cost is the median: one slow block (a stall) does not set it
            self._mode_samples.setdefault(gamma, collections.deque(maxlen=ROUND_TRIP_SAMPLES)).append(rt_ms)

    def _send_block(self, committed: list[int], draft: Draft, cfg):
        """Send the block ``draft`` on top of ``committed``: a VERIFY, or through the split
        session a MID (its front rows already computed if the look-ahead ran them). Returns
        what :meth:`_take_block` needs."""
        if self._session is not None:
            return self._session.send_block(committed, draft.ids)
        msg = self._verify_msg(committed, draft, cfg)
        self.link.send(msg)
        self.link.count_round_trip()
        return msg

    def _take_block(self, pending, reply, committed: list[int], draft: Draft, cfg) -> tuple[int, int]:
        """``(accepted, next token)`` of the block :meth:`_send_block` sent, from ``reply``
        (the message that answered it): the cloud's VERIFIED, or through the split session
        the MIDOUT, the device's back and head, and its own verification."""
        if self._session is not None:
            return self._session.take_block(pending, committed, draft.ids, cfg.temperature,
                                            cfg.top_k, q=draft.q, reply=reply)
        if not isinstance(reply, P.Verified) or reply.req != pending.req:
            raise P.ProtocolError(f"expected VERIFIED for request {pending.req}, got {reply!r}")
        vocab = self._vocab
        if not 0 <= reply.accepted <= len(draft.ids) or not 0 <= reply.token < vocab:
            raise P.ProtocolError(f"VERIFIED {pending.req} accepts {reply.accepted} of {len(draft.ids)} "
                                  f"drafts with token {reply.token} (vocabulary {vocab}): a lying cloud")
        return reply.accepted, reply.token

    def _speculative_async(self, prompt, cfg, gen, res, drafter: Drafter, ctl: GammaController,
                           first: Draft | None = None) -> None:
        """``spec_async``, and ``split_spec`` pipelined: while block k is in flight the device
        guesses the target's next token, drafts block k+1 on top of it and (split) runs the
        front over it; a right guess sends block k+1 at once. A restart (the first block,
        or after a rejection) drafts on the critical path only what
        :meth:`GammaController.choose_restart` finds pays: often γ = 0, drafting in the
        round trip's shadow instead. ``first``: the first block, if drafted."""
        committed = list(prompt)
        link, split = self.link, self._session
        draft = first if first is not None else self._restart(drafter, ctl, cfg, gen, cfg.max_new_tokens)
        try:
            while True:
                pending = self._send_block(committed, draft, cfg)
                sent = time.perf_counter()
                # draft ahead on the guess that the whole block is accepted
                guess, ahead, reply, fronted = None, Draft(), None, False
                left = cfg.max_new_tokens - len(res.tokens) - len(draft.ids)
                drafting = left > 0  # until the drafter has nothing more to propose
                # look ahead at most the γ that best fills a round trip when drafting overlaps it
                gmax = self._ahead(ctl)
                while reply is None:
                    if drafting and guess is None:
                        d = self._draft(drafter, 1, cfg, gen)
                        guess, drafting = (d.ids[0], True) if d.ids else (None, False)
                    elif drafting and len(ahead.ids) < min(gmax, max(left - 2, 0)):
                        d = self._draft(drafter, 1, cfg, gen)
                        ahead.extend(d)
                        drafting = bool(d.ids)
                    elif split is not None and guess is not None and not fronted:
                        split.prefront([guess] + list(ahead.ids))  # block k+1's front, ready to send
                        fronted = True
                    else:
                        reply = link.recv(timeout_s=cfg.timeout_s)
                        break
                    reply = _poll(link)
                n, token = self._take_block(pending, reply, committed, draft, cfg)
                self._time_round_trip(1000 * (time.perf_counter() - sent), ctl, len(draft.ids))
                ctl.update(n, len(draft.ids))
                self._count_block(len(draft.ids), n + 1)
                tested = n == len(draft.ids) and guess is not None  # the guess met the answer
                hit = tested and token == guess
                if tested:
                    ctl.update_guess(hit)
                done, _ = self._commit(drafter, res, committed, draft, n, token, cfg)
                if done:
                    return
                if hit and ahead.ids:
                    # the guess was right: the drafter already holds committed + the look-ahead
                    draft = ahead
                else:
                    # rejected (or nothing drafted ahead): discard the look-ahead, restart
                    draft = self._restart(drafter, ctl, cfg, gen, cfg.max_new_tokens - len(res.tokens),
                                          rollback=len(committed))
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

    def _fusion_cross(self, prompt, cfg, fcfg: FusionConfig, gen, res) -> None:
        """Fusion with a cloud of another tokenizer: per token the cloud's top-k (its ids, as
        in :meth:`_fusion`) and the device's own top-k meet as byte strings
        (:func:`~edgefuse.cloud.crossvocab.candidates`); the pick is committed to the cloud in
        its ids (a top-k entry by id, a device token re-encoded) and the device follows on
        bytes. ``prompt``: the cloud's ids. A late answer makes the device emit its own
        token, unless an unfinished character is pending (only the cloud can finish it, so
        the device waits for the answer)."""
        link, e, cv = self.link, self.edge, self.cross
        follow = ByteFollower(e, cv.device_tok, cv.device, len(self._device_prompt))
        committed = list(prompt)
        sent_len, unsent = len(prompt), []
        text = bytearray()
        weights = []
        last_answer = time.perf_counter()
        steps = 0  # a step may commit no cloud id (a special token of no bytes): bounded anyway
        try:
            while len(res.tokens) < cfg.max_new_tokens and steps < 4 * cfg.max_new_tokens:
                steps += 1
                if time.perf_counter() - last_answer > cfg.timeout_s:
                    raise TimeoutError(f"no answer from the cloud for {cfg.timeout_s:g} s")
                msg = P.Fuse(self._next_req(), sent_len, unsent, cfg.fuse_topk, auth=cfg.auth,
                             context=self._context(committed, sent_len, cfg))
                link.send(msg)
                link.count_round_trip()
                sent_len += len(unsent)
                unsent = []
                self._held = cfg.auth.held(sent_len)
                logits = e.logits() if not follow.unfed else None  # while the request is in flight
                wait = cfg.deadline_ms / 1000 if logits is not None else cfg.timeout_s
                reply = self._await_topk(msg.req, wait)
                if reply is not None:
                    last_answer = time.perf_counter()
                if reply is None:
                    res.deadline_misses += 1
                    if logits is None:
                        raise TimeoutError(f"no answer from the cloud for {cfg.timeout_s:g} s")
                    scores = torch.log_softmax(logits.double(), -1)
                    scores[cv.device.blank] = -math.inf  # a special token that is no text or end
                    j = self._pick(scores, cfg, gen)
                    if j in e.eos_ids:
                        break
                    data, ids, dev = cv.device.table[j], None, j
                else:
                    cands = candidates(logits, reply, cv, cfg.fuse_topk)
                    if not cands:
                        raise P.ProtocolError(f"TOPK {reply.req} leaves nothing to choose from")
                    w = fcfg.weight
                    if fcfg.adaptive and logits is not None:
                        w = edge_weight(torch.log_softmax(logits.double(), -1),
                                        cloud_logprobs(reply, cv.cloud.size), fcfg)
                    weights.append(w)
                    fused, best = fuse_candidates(cands, w)
                    c = cands[best if cfg.temperature == 0 else self._pick(fused, cfg, gen)]
                    if c.ends:
                        break
                    data, dev = c.data, c.device_id
                    ids = [c.cloud_id] if c.cloud_id is not None else None
                if ids is None:
                    ids = cv.cloud_ids(data)
                text += data
                if dev is not None and not follow.unfed:
                    e.push(dev)  # the device's own token: its ids stay its own
                else:
                    follow.sync(bytes(text))
                committed.extend(ids)
                unsent.extend(ids)
                res.tokens.extend(ids)
        except (ConnectionError, OSError, TimeoutError, P.RemoteError) as exc:
            self._fallback(res, exc, cfg, gen, committed)
        finally:
            res.edge_weight_mean = float(np.mean(weights)) if weights else None
        del res.tokens[cfg.max_new_tokens:]

    def _await_topk(self, req: int, wait_s: float):
        """The TOPK answering ``req`` if it comes within ``wait_s`` seconds, else None (older,
        late answers are dropped)."""
        deadline = time.perf_counter() + wait_s
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                return None
            try:
                got = self.link.recv(timeout_s=left)
            except TimeoutError:
                return None
            if isinstance(got, P.TopK) and got.req == req:
                return got

    @staticmethod
    def _pick(scores: torch.Tensor, cfg, gen) -> int:
        """The argmax of ``scores`` (log-probabilities) at temperature 0, else a draw."""
        if cfg.temperature == 0:
            return int(torch.argmax(scores))
        return int(torch.multinomial(torch.softmax(scores / cfg.temperature, -1).float(), 1, generator=gen))
