"""Speculative decoding math, shared by the device (draft) and the cloud (verify).

Follows Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (Algorithm 1), and Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling": greedy verification keeps the longest prefix of the draft that
equals the target's argmax; sampled verification accepts draft token x with probability
min(1, p(x)/q(x)) and on rejection samples from norm(max(0, p − q)), so the output
distribution equals the target's p whatever the draft distribution q is.

The draft distribution crosses the link sparse (its top-kq, float16), so both ends must use
exactly the same q: :func:`sparse_q` turns the sent values into q on both sides, and the
device samples its drafts from that q, not from its own full softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0) -> torch.Tensor:
    """Next-token probabilities ``float64[..., V]`` from ``logits[..., V]``.

    ``temperature`` > 0 scales the logits; ``top_k`` > 0 keeps the k largest (ties kept).
    Raises ``ValueError`` for temperature <= 0 (greedy decoding uses argmax, not this)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    x = logits.double() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.softmax(x, dim=-1)


def draft_q(logits: torch.Tensor, temperature: float, kq: int) -> tuple[np.ndarray, np.ndarray]:
    """The sparse draft distribution the device sends: ``(ids int64[kq], probs float16[kq])``,
    the top-``kq`` of ``softmax(logits / temperature)`` rounded to float16 (what goes on the
    wire). Sample from ``sparse_q(ids, probs)``, never from the full softmax.
    ``logits``: float[V] over the vocabulary (or over the draft's kept ids, then map ids)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    vals, ids = torch.topk(p, min(kq, p.shape[-1]))
    probs = vals.numpy().astype(np.float16)
    keep = probs > 0  # float16 underflow: drop zero entries
    if not keep.any():
        keep[0] = True
        probs[0] = np.float16(1.0)
    return ids.numpy()[keep].astype(np.int64), probs[keep]


def sparse_q(ids, probs) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise sent draft values: ``(ids LongTensor[k], q float64[k])`` with q summing to 1.

    Raises ``ValueError`` for mismatched lengths, duplicate ids, negative or all-zero values."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    vals = torch.as_tensor(np.asarray(probs, dtype=np.float64))
    if ids.shape != vals.shape or ids.ndim != 1:
        raise ValueError(f"q ids {tuple(ids.shape)} and probs {tuple(vals.shape)} must be equal 1-D")
    if len(torch.unique(ids)) != len(ids):
        raise ValueError("q ids contain duplicates")
    if (vals < 0).any() or not torch.isfinite(vals).all() or float(vals.sum()) <= 0:
        raise ValueError("q probs must be finite, >= 0 and not all zero")
    return ids, vals / vals.sum()


def sample_sparse(ids: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> int:
    """One token id drawn from the sparse distribution ``q`` over ``ids``."""
    return int(ids[torch.multinomial(q.float(), 1, generator=gen)])


def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, int]:
    """Greedy verification. ``target_argmax``: the target's argmax at each of the γ+1
    positions (after the committed context, after draft[0], …). Returns ``(n, token)``: the
    number of draft tokens kept (longest matching prefix) and the target's token after them."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"need γ+1 = {len(draft) + 1} target positions, got {len(target_argmax)}")
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, int(target_argmax[n])


def verify_sampled(p: torch.Tensor, draft: list[int], q: list[tuple[torch.Tensor, torch.Tensor]],
                   gen: torch.Generator) -> tuple[int, int]:
    """Rejection-sampling verification (Leviathan et al. 2023, Algorithm 1).

    Args:
        p: float64[γ+1, V], the target's probabilities at each position.
        draft: the γ drafted ids; ``draft[i]`` was sampled from ``q[i]``.
        q: per drafted position ``(ids, probs)`` from :func:`sparse_q`.
        gen: the session's generator (uniforms and samples).
    Returns ``(n, token)``: tokens kept and the next token, drawn from norm(max(0, p−q)) at
    the first rejection or from p[γ] when all are kept."""
    if p.shape[0] != len(draft) + 1 or len(q) != len(draft):
        raise ValueError(f"p has {p.shape[0]} rows and q {len(q)} for γ = {len(draft)}")
    for i, x in enumerate(draft):
        ids, qv = q[i]
        hit = (ids == x).nonzero()
        if len(hit) == 0:
            raise ValueError(f"drafted token {x} at position {i} is not in its sent q")
        qx = float(qv[hit[0, 0]])
        px = float(p[i, x])
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u * qx < px:  # u < p/q without dividing
            continue
        residual = p[i].clone()
        residual[ids] = (residual[ids] - qv).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0:  # p ≤ q everywhere only if p == q: then rejection has probability 0
            residual = p[i]
            total = float(residual.sum())
        token = int(torch.multinomial((residual / total).float(), 1, generator=gen))
        return i, token
    return len(draft), int(torch.multinomial(p[len(draft)].float(), 1, generator=gen))


def expected_tokens_per_block(alpha: float, gamma: int) -> float:
    """Expected tokens per verify round trip with per-token acceptance ``alpha`` and ``gamma``
    drafted tokens: (1 − α^(γ+1)) / (1 − α) (Leviathan et al. 2023, eq. 1)."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def pipelined_rate(alpha: float, hit: float, restart_gamma: int, restart_ms: float,
                   ahead_gamma: int, ahead_ms: float) -> float:
    """Long-run tokens per ms of ``spec_async`` when every restart drafts ``restart_gamma``
    tokens before it is sent.

    ``spec_async`` sends two kinds of block: a *restart* (after a rejection, or the first
    block: the device drafts ``restart_gamma`` tokens on the critical path, then the round
    trip; ``restart_ms`` is both, in ms) and a *pre-drafted* block (``ahead_gamma`` tokens
    drafted in the previous round trip's shadow on a guess of the cloud's token, sent the
    moment the guess proves right; ``ahead_ms`` its round trip). A block of g drafts
    is followed by a pre-drafted one with probability α^g · ``hit`` (all accepted, the guess
    right; ``hit`` the guesses' hit rate), else by a restart. With that two-state renewal
    chain (stationary shares π_R, π_A) the rate is
    (π_R·E(α, γ_R) + π_A·E(α, γ_A)) / (π_R·T_R + π_A·T_A), E from
    :func:`expected_tokens_per_block`. A restart of γ = 0 drafts nothing on the critical
    path: the cloud's step goes out at once and drafting moves into its shadow, so the
    loop never waits for a draft that is likely to be rejected.

    Raises ``ValueError`` for a cost that is not positive."""
    if restart_ms <= 0 or ahead_ms <= 0:
        raise ValueError(f"block costs must be > 0 ms, got {restart_ms}, {ahead_ms}")
    a, h = min(max(alpha, 0.0), 0.99), min(max(hit, 0.0), 0.99)
    p_r = a ** restart_gamma * h  # a restart is followed by a pre-drafted block
    p_a = a ** ahead_gamma * h  # and a pre-drafted block by another
    pi_a = p_r / (1.0 - p_a + p_r)
    pi_r = 1.0 - pi_a
    tokens = pi_r * expected_tokens_per_block(a, restart_gamma) + pi_a * expected_tokens_per_block(a, ahead_gamma)
    return tokens / (pi_r * restart_ms + pi_a * ahead_ms)


@dataclass
class GammaController:
    """Chooses γ per block from the observed acceptance rate and round-trip time.

    Acceptance α is an exponential moving average (weight ``ema``) of accepted/drafted per
    block, starting at ``alpha0``. :meth:`choose` picks the γ in [gamma_min, gamma_max] that
    maximises tokens per second, E(α, γ) / cost(γ), with the cloud's verify time
    verify_ms(γ) = verify_ms · (1 + verify_growth·γ) and cost = γ·draft_ms + rtt_ms +
    verify_ms(γ) for the synchronous loop, max(γ·draft_ms, rtt_ms + verify_ms(γ)) when
    drafting overlaps the round trip (``overlap``). A long RTT favours long blocks, a low α
    short ones. ``verify_growth`` 0.2 is the smooth model's slope (one CPU core once measured
    a block of 4 tokens at 1.8× one token, of 8 at 2.1×; on a GPU it is close to 0); where
    the decoder has measured a γ's round trip, :meth:`choose` uses that instead, since real
    costs come in steps (``bench/bench_rows.py``). ``fixed`` pins γ (no adaptation).

    **Never losing to the cloud alone** (``zero``): γ = 0 (remote autoregressive steps, one
    target token per round trip) is a candidate too, and where a γ's *achieved* cost per
    committed token (wall time from one answer to the next, drafting, rejections and stalls
    included) has been measured, that replaces the model, whose α and timings can be
    optimistic (a poor draft's rejections cost re-feeds the model does not count). When
    γ = 0 is best, every ``probe_every``-th block drafts anyway, the best γ ≥ 1 (not always
    1: on a CPU a block of 1 draft can cost more per token than one of 3, the rows being
    padded), so a draft that starts paying again (the text turns predictable) is noticed."""
    gamma_min: int = 1
    gamma_max: int = 8
    alpha0: float = 0.7
    ema: float = 0.3
    fixed: int | None = None
    verify_growth: float = 0.2
    zero: bool = False
    probe_every: int = 6

    def __post_init__(self):
        if not 0 <= self.gamma_min <= self.gamma_max:
            raise ValueError(f"need 0 <= gamma_min <= gamma_max, got {self.gamma_min}, {self.gamma_max}")
        self.alpha = float(self.alpha0)
        self.hit = float(self.alpha0)  # spec_async's guesses of the cloud's token: hit rate
        self._since_draft = 0  # blocks in a row chosen at γ = 0

    def update(self, accepted: int, drafted: int) -> None:
        """Record one verified block (``accepted`` of ``drafted`` tokens kept)."""
        if drafted > 0:
            self.alpha = (1 - self.ema) * self.alpha + self.ema * (accepted / drafted)

    def update_guess(self, hit: bool) -> None:
        """Record one tested guess of ``spec_async`` (the block was all accepted)."""
        self.hit = (1 - self.ema) * self.hit + self.ema * float(hit)

    def _remote(self, g: int, rtt_ms: float, verify_ms: float, measured: dict[int, float] | None) -> float:
        """A block of ``g`` drafts' round trip (ms): measured, else the smooth model."""
        remote = rtt_ms + verify_ms * (1 + self.verify_growth * g)
        if measured and g in measured:
            return measured[g]
        if measured and g == 0:  # no more rows than any measured block
            return min(remote, min(measured.values()))
        return remote

    def choose_restart(self, draft_ms: float, rtt_ms: float, verify_ms: float, ahead: int,
                       measured: dict[int, float] | None = None,
                       restart_ms: dict[int, float] | None = None, settled=None) -> int:
        """``spec_async``'s γ for a restart (the first block, or the one after a rejection):
        the γ with the highest :func:`pipelined_rate`, γ = 0 included with ``zero``. Times in
        ms. ``ahead``: the look-ahead length of pre-drafted blocks; ``measured``: round trips
        per γ (as :meth:`choose`); ``restart_ms``: γ -> measured drafting time on the
        critical path before a restart's send (re-alignment included; unmeasured:
        γ · ``draft_ms``). A low α or a slow draft gives γ = 0: the cloud's step goes out at
        once and drafts ride along only when the shadow produced a right guess, so a poor
        draft costs the cloud's extra rows at most, never a wait. A best γ ≥ 1 next to an
        unsettled one returns that first, as :meth:`choose` does."""
        if self.fixed is not None:
            return int(self.fixed)
        alpha, restart_ms = min(max(self.alpha, 0.0), 0.99), restart_ms or {}
        ahead_ms = self._remote(ahead, rtt_ms, verify_ms, measured)
        best, best_rate = self.gamma_min, -math.inf
        for g in range(0 if self.zero else self.gamma_min, self.gamma_max + 1):
            serial = restart_ms.get(g, g * draft_ms) if g else 0.0
            cost = max(serial + self._remote(g, rtt_ms, verify_ms, measured), 1e-9)
            rate = pipelined_rate(alpha, self.hit, g, cost, ahead, max(ahead_ms, 1e-9))
            if rate > best_rate + 1e-12:
                best, best_rate = g, rate
        if best >= 1 and measured is not None:
            known = measured if settled is None else settled
            for g in (best - 1, best + 1):
                if max(self.gamma_min, 1) <= g <= self.gamma_max and g not in known:
                    return g
        return best

    def verify_base_ms(self, measured_ms: float, gamma: int) -> float:
        """The one-token verify time implied by a block of ``gamma`` that took ``measured_ms``."""
        return measured_ms / (1 + self.verify_growth * gamma)

    def choose(self, draft_ms: float, rtt_ms: float, verify_ms: float, overlap: bool = False,
               measured: dict[int, float] | None = None, settled=None,
               achieved: dict[int, float] | None = None, probe: bool = True) -> int:
        """The γ with the highest modelled tokens/s (ties: the smaller γ). Times in ms;
        ``verify_ms`` is the one-token verify time.

        ``measured``: round trips (ms, RTT included) measured for blocks of each γ. A
        measured γ's remote cost is its measurement, not the model's: a CPU's matrix kernels
        are not smooth in the rows (on one core of this machine the 1.5B target's forward
        costs about the same for 1 to 3 rows and twice that for 4 to 6). With ``measured``
        given, a γ next to the best that is not ``settled`` (default: not measured) is returned
        first (a deterministic local search), so the table learns the costs around the best
        and one slow measurement does not bar a γ for good.

        ``achieved``: γ -> measured ms per committed token (see the class docstring); with
        ``zero`` the result may be 0. ``probe``: this choice counts towards the γ = 0 probe
        (False for a bound asked on the side, as ``spec_async``'s look-ahead length)."""
        if self.fixed is not None:
            return int(self.fixed)
        alpha = min(max(self.alpha, 0.0), 0.99)
        best, best_rate = self.gamma_min, -math.inf
        drafting, drafting_rate = max(self.gamma_min, 1), -math.inf  # the best γ >= 1 (a probe's)
        for g in range(0 if self.zero else self.gamma_min, self.gamma_max + 1):
            remote = self._remote(g, rtt_ms, verify_ms, measured)
            cost = max(g * draft_ms, remote) if overlap else g * draft_ms + remote
            rate = expected_tokens_per_block(alpha, g) / max(cost, 1e-9)
            if achieved and g in achieved:
                rate = 1.0 / max(achieved[g], 1e-9)
            if rate > best_rate + 1e-12:
                best, best_rate = g, rate
            if g >= 1 and rate > drafting_rate + 1e-12:
                drafting, drafting_rate = g, rate
        if not probe:
            return best
        if best == 0:
            self._since_draft += 1
            if self._since_draft >= self.probe_every:  # does drafting pay again? (its best block)
                self._since_draft = 0
                return drafting
            return 0
        self._since_draft = 0
        if measured is not None:
            known = measured if settled is None else settled
            for g in (best - 1, best + 1):
                if self.gamma_min <= g <= self.gamma_max and g not in known:
                    return g
        return best
