"""Collaborative decoding on tiny random models: losslessness for every drafter, fusion,
deadlines, fallback, the drafter's selection by config.

The link here is in-process (``DirectLink``: the real protocol encoding and the real
``Target``, no socket), so these tests isolate the decoding logic; tests/cloud/test_cloud_service.py
covers the socket, the crypto and the batching service.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import edgefuse.cloud.protocol as P
from edgefuse.cloud.decoding import (DRAFTERS, MODES, DecodeConfig, DecodeError, Decoder, DraftBatcher,
                                     DraftHead, DrafterSpec, EdgeLM, FullHeadDrafter, PrunedHeadDrafter,
                                     ShallowDrafter, check_config, drafter_factory, drafter_spec)
from edgefuse.cloud.fusion import FusionConfig, cloud_logprobs, fuse
from edgefuse.cloud.speculative import (GammaController, draft_q, expected_tokens_per_block, pipelined_rate,
                                        sparse_q, verify_greedy, verify_sampled)
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.config import ConfigError, compose
from edgefuse.models import tiny_model
from tests.cloud.conftest import DirectLink, perturbed_copy, target_greedy


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def pair():
    draft, tok = tiny_model("qwen2", seed=0)
    target, tok2 = tiny_model("qwen2", seed=1)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok2)
    return draft, target, tok


@pytest.fixture(scope="module")
def perturbed(pair):
    """(target, a perturbed copy of it as the edge model, tokenizer): the edge's greedy
    tokens agree with the target's often, not always."""
    _, target, tok = pair
    return target, perturbed_copy(target, 0.1), tok


PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 100, 7, 100, 7, 100, 7]]


@pytest.mark.parametrize("mode, gamma", [("cloud", None), ("spec_sync", None), ("spec_sync", 1),
                                         ("spec_sync", 3), ("spec_async", None), ("spec_async", 1),
                                         ("spec_async", 3)])
def test_greedy_speculative_equals_target(perturbed, mode, gamma):
    """A draft that agrees with the target often but not always (a perturbed copy): the
    output equals the target's greedy ``generate`` token for token, and some but not all
    drafts are accepted, so both the accept and the reject-and-rollback paths ran."""
    target, edge_model, tok = perturbed
    T = Target(target, tok, "tiny-target")
    edge = EdgeLM(edge_model, tok)
    edge.eos_ids = set()  # random models: generate the full length
    cfg = DecodeConfig(max_new_tokens=12, gamma=gamma)
    accepted = drafted = 0
    for prompt in PROMPTS:
        link = DirectLink(T)
        res = Decoder(edge, link, T.fingerprint).generate(mode, prompt, cfg)
        assert res.tokens == target_greedy(target, prompt, 12)
        assert res.fallback is None
        if mode == "cloud":
            assert res.round_trips == 12 and res.drafted == 0
        else:
            assert res.round_trips == res.blocks and res.drafted >= res.accepted
        accepted, drafted = accepted + res.accepted, drafted + res.drafted
    if mode != "cloud":
        assert 0 < accepted < drafted, (accepted, drafted)


def test_self_draft_accepts_everything(pair):
    """Draft = target: every drafted token is accepted and each round trip yields γ+1 tokens."""
    _, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(target, tok)
    edge.eos_ids = set()
    res = Decoder(edge, DirectLink(T), T.fingerprint).generate(
        "spec_sync", PROMPTS[0], DecodeConfig(max_new_tokens=16, gamma=3))
    assert res.acceptance_rate == 1.0
    assert res.round_trips == 4  # 16 tokens / (3 drafted + 1 bonus)
    assert res.tokens == target_greedy(target, PROMPTS[0], 16)


def test_async_hides_drafting_behind_the_round_trip(pair):
    """With draft = target the look-ahead guess is always right: async needs no fresh drafting
    after the first block, and the output still equals the target's."""
    _, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(target, tok)
    edge.eos_ids = set()
    res = Decoder(edge, DirectLink(T), T.fingerprint).generate(
        "spec_async", PROMPTS[1], DecodeConfig(max_new_tokens=20, gamma=4))
    assert res.tokens == target_greedy(target, PROMPTS[1], 20)
    assert res.acceptance_rate == 1.0


def test_verify_greedy_by_hand():
    assert verify_greedy([3, 4, 5, 6], [3, 4, 5]) == (3, 6)
    assert verify_greedy([3, 9, 5, 6], [3, 4, 5]) == (1, 9)
    assert verify_greedy([7], []) == (0, 7)
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_rejection_sampling_preserves_the_target_distribution():
    """Draft from q, verify against p: the first output token is distributed as p."""
    p_row = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0], dtype=torch.float64)
    p = torch.stack([p_row, torch.full((5,), 0.2, dtype=torch.float64)])
    q_ids, q = sparse_q([0, 1, 3, 4], np.array([0.1, 0.3, 0.3, 0.3], np.float16))
    gen = torch.Generator().manual_seed(0)
    counts = np.zeros(5)
    n = 20000
    for _ in range(n):
        x = int(q_ids[torch.multinomial(q.float(), 1, generator=gen)])
        kept, token = verify_sampled(p, [x], [(q_ids, q)], gen)
        counts[x if kept else token] += 1
    freq = counts / n
    assert np.abs(freq - p_row.numpy()).max() < 0.015  # 3 standard errors at n = 20000
    assert counts[4] == 0  # p(4) = 0: never emitted although q drafts it


SHARP_T = 0.02  # sampling temperature that makes the tiny models' near-flat softmax peaked


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    """Total variation between two distributions over the whole vocabulary."""
    return 0.5 * float(np.abs(a - b).sum())


def test_sampled_speculative_matches_target_distribution(pair):
    """End to end through the protocol at temperature 0.02, where the target's p is peaked
    (top ids ≈ 0.63, 0.13, 0.11, 0.06) and the draft's q (a perturbed copy: ≈ 0.93 on p's top
    id) clearly differs from it. Over 1000 seeds the first token's empirical distribution,
    over the whole vocabulary, is within TV 0.06 of p and farther than 0.25 from q; it would
    follow q had the cloud kept every draft, and norm(max(0, p − q)) (TV 0.64 from p) had it
    rejected every one."""
    _, target, tok = pair
    draft = perturbed_copy(target, 0.3)
    T = Target(target, tok, "t")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    prompt = PROMPTS[1]
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / SHARP_T, -1).numpy()
        d_logits = draft(torch.tensor([prompt])).logits[0, -1]
    q_ids, q_sparse = sparse_q(*draft_q(d_logits, SHARP_T, 32))  # what the device drafts from
    q = np.zeros_like(p)
    q[q_ids.numpy()] = q_sparse.double().numpy()
    residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
    assert _tv(p, q) > 0.3 and _tv(p, residual) > 0.6
    counts = np.zeros_like(p)
    n = 1000
    for seed in range(n):
        res = Decoder(edge, DirectLink(T), T.fingerprint).generate(
            "spec_sync", prompt, DecodeConfig(max_new_tokens=2, temperature=SHARP_T, seed=seed, gamma=1,
                                              draft_topk=32))
        assert res.drafted >= 1  # the first token was a draft the cloud verified
        counts[res.tokens[0]] += 1
    emp = counts / n
    assert _tv(emp, p) < 0.06, _tv(emp, p)
    assert _tv(emp, q) > 0.25, _tv(emp, q)


def test_fusion_weights():
    reply = P.TopK(0, np.array([2, 0]), np.array([0, 255], np.uint8), top=-0.1, scale=0.02,
                   tail=float(np.log(1 - np.exp(-0.1) - np.exp(-0.1 - 255 * 0.02))))
    full = cloud_logprobs(reply, 4)
    assert full[2] == pytest.approx(-0.1, abs=1e-3)
    assert torch.exp(full).sum() == pytest.approx(1.0, abs=1e-3)
    edge = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    fused, w = fuse(edge, reply, FusionConfig(weight=1.0))
    assert w == 1.0 and torch.allclose(torch.exp(fused), torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=1e-6)
    fused, w = fuse(edge, reply, FusionConfig(weight=0.0))
    assert torch.allclose(fused, full - torch.logsumexp(full, 0))
    # adaptive: the confident cloud (entropy ≈ 0.4 nats) outweighs the flat edge (1.28 nats)
    _, w = fuse(edge, reply, FusionConfig(adaptive=True, confidence="entropy"))
    assert w < 0.5
    _, w = fuse(torch.tensor([20.0, 0, 0, 0]), reply, FusionConfig(adaptive=True, confidence="margin"))
    assert w > 0.5


def test_fusion_decodes_and_weight_one_is_edge_only(pair):
    draft, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    alone = Decoder(edge).generate("edge", PROMPTS[0], DecodeConfig(max_new_tokens=8))
    res = Decoder(edge, DirectLink(T), T.fingerprint).generate(
        "fusion_static", PROMPTS[0], DecodeConfig(max_new_tokens=8, fusion=FusionConfig(weight=1.0)))
    assert res.tokens == alone.tokens and res.round_trips == 8
    res0 = Decoder(edge, DirectLink(T), T.fingerprint).generate(
        "fusion_static", PROMPTS[0], DecodeConfig(max_new_tokens=8, fusion=FusionConfig(weight=0.0)))
    assert res0.tokens == target_greedy(target, PROMPTS[0], 8)  # cloud top-1 wins at w = 0
    assert res0.bytes_down_per_token < 200


def test_fusion_deadline_emits_edge_tokens_and_stays_in_sync(pair):
    draft, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    alone = Decoder(edge).generate("edge", PROMPTS[0], DecodeConfig(max_new_tokens=6))
    link = DirectLink(T, lag=True)  # every answer arrives after its deadline
    res = Decoder(edge, link, T.fingerprint).generate(
        "fusion_static", PROMPTS[0], DecodeConfig(max_new_tokens=6, deadline_ms=1,
                                                  fusion=FusionConfig(weight=0.0)))
    assert res.deadline_misses == 6 and res.tokens == alone.tokens
    assert res.fallback is None
    # in sync: the cloud holds the prompt + 5 of the 6 tokens (the last one was never sent)
    assert len(link.session.tokens) == len(PROMPTS[0]) + 5 and link.session.closed


def edge_greedy(model, tok, ids: list[int], n: int) -> list[int]:
    """The ``n`` tokens a fresh edge-only decoder continues ``ids`` with (no EOS stop)."""
    edge = EdgeLM(model, tok)
    edge.eos_ids = set()
    return Decoder(edge).generate("edge", ids, DecodeConfig(max_new_tokens=n)).tokens


@pytest.mark.parametrize("mode", ["spec_sync", "spec_async", "fusion_static", "cloud"])
def test_cloud_gone_mid_generation_falls_back_to_edge(pair, mode):
    """The link answers OPEN and two requests, then fails: the tokens those two answers
    committed are the target's greedy ones, the rest is the edge's own greedy continuation
    of the prompt and that prefix (fusion at w = 0, so the cloud's top-1 is each fused token)."""
    draft, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    prompt = PROMPTS[0]
    res = Decoder(edge, DirectLink(T, fail_after=3), T.fingerprint).generate(
        mode, prompt, DecodeConfig(max_new_tokens=10, gamma=2, fusion=FusionConfig(weight=0.0)))
    if mode.startswith("spec"):
        assert res.blocks == 2
        k = res.accepted + res.blocks  # each answered block: its kept drafts and one token
    else:
        k = 2  # one token per answered request
    assert len(res.tokens) == 10
    assert res.fallback == (f"cloud unavailable after {k} tokens (ConnectionError: cloud went away); "
                            "the rest is edge only")
    assert res.tokens[:k] == target_greedy(target, prompt, k)
    assert res.tokens[:k] != edge_greedy(draft, tok, prompt, k)  # the prefix is the cloud's
    assert res.tokens[k:] == edge_greedy(draft, tok, prompt + res.tokens[:k], 10 - k)


def test_fingerprint_mismatch_is_refused(pair):
    draft, target, tok = pair
    T = Target(target, tok, "t")
    with pytest.raises(P.RemoteError, match="fingerprint"):
        DirectLink(T).open(PROMPTS[0], "0123456789abcdef")


def test_config_errors():
    with pytest.raises(DecodeError):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(DecodeError):
        DecodeConfig(gamma_min=3, gamma_max=2)
    with pytest.raises(ValueError):
        FusionConfig(confidence="vibes")
    edge = EdgeLM(*tiny_model("qwen2"))
    with pytest.raises(DecodeError, match="unknown decoding mode"):
        Decoder(edge).generate("telepathy", [1, 2], DecodeConfig())
    with pytest.raises(DecodeError, match="needs a cloud link"):
        Decoder(edge).generate("spec_sync", [1, 2], DecodeConfig())
    assert set(MODES) >= {"edge", "cloud", "spec_sync", "spec_async", "fusion_static", "fusion_adaptive"}


def test_gamma_controller():
    assert expected_tokens_per_block(0.0, 4) == 1.0
    assert expected_tokens_per_block(1.0, 4) == 5.0
    assert expected_tokens_per_block(0.5, 2) == pytest.approx(1.75)
    c = GammaController(1, 8, alpha0=0.9)
    long_rtt = c.choose(draft_ms=10, rtt_ms=200, verify_ms=50)
    short_rtt = c.choose(draft_ms=10, rtt_ms=1, verify_ms=5)
    assert long_rtt > short_rtt
    for _ in range(20):
        c.update(0, 4)
    assert c.alpha < 0.01 and c.choose(10, 80, 50) == 1
    assert GammaController(fixed=5).choose(1, 1, 1) == 5
    # drafting that overlaps the round trip affords longer blocks than the synchronous loop
    c = GammaController(1, 8, alpha0=0.84)
    assert c.choose(86, 80, 290, overlap=True) > c.choose(86, 80, 290) == 3
    assert c.verify_base_ms(580.0, 5) == pytest.approx(290.0)


def test_gamma_controller_uses_measured_block_costs_and_explores_their_neighbours():
    """A kernel whose cost jumps at 4 rows (γ = 3): with the measured round trips the
    controller leaves the smooth model's γ = 3 for γ = 2, which costs about one token; an
    unmeasured γ next to the best is tried once first, so the table learns the step.
    (Rates by hand, α = 0.84, 86 ms per draft: γ = 2 gives 2.55 tokens for 702 ms, 3.63/s;
    γ = 3 3.14 tokens for 1258 ms, 2.50/s.)"""
    c = GammaController(1, 8, alpha0=0.84)
    assert c.choose(86, 80, 290) == 3  # the smooth model alone
    # 1-3 rows cost one verify, 4-6 rows twice that, 7-8 three times
    step = {1: 510, 2: 530, 3: 1000, 4: 1010, 5: 1030, 6: 1400, 7: 1450, 8: 1500}
    assert c.choose(86, 80, 290, measured=step) == 2
    # a local search from γ = 3: the model's best among the rest is 2, whose neighbour 1 is
    # unmeasured; then the model's 4 looks best, its neighbour 5 is tried; measured, 2 wins
    seen = {3: 1000}
    assert c.choose(86, 80, 290, measured=seen) == 1
    seen.update({1: 510, 2: 530})
    assert c.choose(86, 80, 290, measured=seen) == 5
    seen.update({4: 1010, 5: 1030})
    assert c.choose(86, 80, 290, measured=seen) == 2
    assert GammaController(fixed=4).choose(86, 80, 290, measured={}) == 4
    # one slow first block of γ = 2 (a stall) makes γ = 1 the best (3.09/s); 2 is measured but
    # not settled, so as the best's neighbour it is tried again instead of barred for good
    spike = {**step, 2: 3000}
    assert c.choose(86, 80, 290, measured=spike, settled=set(step) - {2}) == 2
    assert c.choose(86, 80, 290, measured=spike, settled=set(step)) == 1


def test_the_decoder_learns_a_round_trip_per_mode_and_gamma(perturbed):
    """One decoder over several generations: each speculative mode keeps its own table of
    measured round trips per γ (the controller's costs), filled from its blocks, with more
    than one γ tried (the controller explores the best's neighbours); ``cloud`` (γ = 0)
    records none; the output stays the target's."""
    target, edge_model, tok = perturbed
    T = Target(target, tok, "tiny-target")
    edge = EdgeLM(edge_model, tok)
    edge.eos_ids = set()
    dec = Decoder(edge, DirectLink(T), T.fingerprint, rtt_ms=1.0)
    for mode in ("cloud", "spec_sync", "spec_async"):
        for prompt in PROMPTS:
            res = dec.generate(mode, prompt, DecodeConfig(max_new_tokens=12, gamma_max=4,
                                                          gamma0_fallback=False))
            assert res.tokens == target_greedy(target, prompt, 12)
    assert dec.round_trip_ms["cloud"] == {}
    for mode in ("spec_sync", "spec_async"):
        table = dec.round_trip_ms[mode]
        assert len(table) >= 2 and set(table) <= {1, 2, 3, 4}, (mode, table)
        assert all(v > 0 for v in table.values())
    assert dec.round_trip_ms["spec_sync"] is not dec.round_trip_ms["spec_async"]
    # a γ's cost is the median of its last three round trips: one stall does not set it
    samples = dec._samples["spec_sync"]
    g = next(iter(samples))
    samples[g].clear()
    for ms in (9000.0, 10.0, 12.0):
        dec._mode_samples, dec._measured = samples, dec.round_trip_ms["spec_sync"]
        dec._time_round_trip(ms, GammaController(), g)
    assert dec.round_trip_ms["spec_sync"][g] == 12.0


def test_gamma_controller_falls_back_to_remote_steps_and_probes_its_way_back():
    """With ``zero``, measured costs per committed token decide: drafting that costs more
    than remote autoregressive steps gives γ = 0, with a one-token probe every
    ``probe_every``-th block; once a drafted γ is measured cheaper, it is chosen again.
    Without ``zero`` γ never drops below gamma_min."""
    ctl = GammaController(1, 3, zero=True, probe_every=3)
    poor = {0: 100.0, 1: 150.0, 2: 130.0, 3: 200.0}  # ms per committed token
    picks = [ctl.choose(50, 80, 100, achieved=poor) for _ in range(7)]
    assert picks == [0, 0, 2, 0, 0, 2, 0]  # the probe is the best drafting block, γ = 2
    # the text turns predictable: the probe's block got 2 tokens in 120 ms
    assert ctl.choose(50, 80, 100, achieved={**poor, 1: 60.0}) >= 1
    assert GammaController(1, 8).choose(50, 80, 100, achieved=poor) >= 1
    # unmeasured, the model decides: a low acceptance with a slow draft prefers γ = 0
    ctl = GammaController(1, 8, zero=True, alpha0=0.05)
    assert ctl.choose(draft_ms=200, rtt_ms=80, verify_ms=100) == 0
    assert GammaController(1, 8, zero=True, alpha0=0.9).choose(draft_ms=5, rtt_ms=80, verify_ms=100) > 1


def test_pipelined_rate_by_hand():
    """The two-state chain of ``spec_async``'s blocks, by hand: α = h = 0.5, restarts of
    γ = 0 (500 ms) and pre-drafted blocks of γ = 2 (550 ms). p_R = 0.5, p_A = 0.125,
    π_A = 0.5 / 1.375 = 4/11, π_R = 7/11; tokens (7/11)·1 + (4/11)·1.75 = 14/11; time
    (7/11)·500 + (4/11)·550 = 5700/11 ms; 14/5700 tokens per ms."""
    assert pipelined_rate(0.5, 0.5, 0, 500.0, 2, 550.0) == pytest.approx(14 / 5700)
    # guesses never right: every block is a restart; with γ = 0 that is the cloud alone
    assert pipelined_rate(0.9, 0.0, 0, 500.0, 4, 900.0) == pytest.approx(1 / 500)
    assert pipelined_rate(0.5, 0.0, 2, 700.0, 2, 550.0) == pytest.approx(1.75 / 700)
    with pytest.raises(ValueError):
        pipelined_rate(0.5, 0.5, 0, 0.0, 2, 550.0)


def test_restarts_draft_on_the_critical_path_only_when_it_pays():
    """``choose_restart``: a poor draft (α 0.1) restarts with γ = 0, so the cloud's step goes
    out at once and drafting moves into the shadow; a good, cheap draft drafts first; a
    slow one (measured 800 ms per restart) does not. Without ``zero`` γ never drops below
    gamma_min; ``fixed`` pins it."""
    rows = {1: 530.0, 2: 578.0, 3: 568.0, 4: 980.0}  # one core's step costs (bench_rows), RTT 80 ms
    poor = GammaController(1, 4, zero=True, alpha0=0.1)
    assert poor.choose_restart(60, 80, 450, ahead=2, measured=rows) == 0
    good = GammaController(1, 4, zero=True, alpha0=0.85)
    g = good.choose_restart(60, 80, 450, ahead=2, measured=rows, settled=set(rows))
    assert g in (2, 3)
    slow = {g: 800.0 for g in rows}  # measured: re-alignment and drafting before each send
    assert good.choose_restart(60, 80, 450, ahead=2, measured=rows, settled=set(rows), restart_ms=slow) == 0
    assert GammaController(1, 4, zero=False, alpha0=0.1).choose_restart(60, 80, 450, 2, rows) == 1
    assert GammaController(1, 4, fixed=3).choose_restart(60, 80, 450, 2, rows) == 3
    # the guesses' hit rate moves with what they meet
    c = GammaController(alpha0=0.5)
    for _ in range(10):
        c.update_guess(False)
    assert c.hit < 0.05


def test_the_device_prefills_and_drafts_its_first_block_while_the_cloud_prefills(pair):
    """The OPEN goes out first; the device's own prefill and first draft run before its
    answer is read, so the first block's drafting is off the critical path."""
    draft, target, tok = pair
    T = Target(target, tok, "tiny-target")
    events = []

    class Recording(DirectLink):
        def send(self, msg):
            events.append(type(msg).__name__)
            super().send(msg)

        def recv(self, timeout_s=None):
            msg = super().recv(timeout_s)
            events.append("read " + type(msg).__name__)
            return msg

    class CountingDrafter(FullHeadDrafter):
        def propose(self, gamma, temperature=0.0, kq=16, gen=None):
            events.append(f"propose {gamma}")
            return super().propose(gamma, temperature, kq, gen)

    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    for mode in ("spec_sync", "spec_async"):
        events.clear()
        dec = Decoder(edge, Recording(T), T.fingerprint, rtt_ms=80.0, drafter=CountingDrafter(edge))
        res = dec.generate(mode, PROMPTS[0], DecodeConfig(max_new_tokens=8, gamma_max=4, gamma0_fallback=False))
        assert res.tokens == target_greedy(target, PROMPTS[0], 8)
        first = next(i for i, e in enumerate(events) if e.startswith("propose"))
        assert events.index("Open") < first < events.index("read Opened"), (mode, events[:6])
        assert events[first] != "propose 0"


def test_a_useless_draft_falls_back_to_remote_steps_and_stays_lossless(pair):
    """An unrelated random draft (almost nothing accepted): the measured cost per token of
    its blocks exceeds that of γ = 0, so most blocks send no draft (probes aside) and the
    output is still the target's; with the fallback off, every block drafts."""
    draft, target, tok = pair
    T = Target(target, tok, "tiny-target")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    n = 40
    on = Decoder(edge, DirectLink(T), T.fingerprint, rtt_ms=1.0).generate(
        "spec_sync", PROMPTS[0], DecodeConfig(max_new_tokens=n, gamma_max=4))
    off = Decoder(edge, DirectLink(T), T.fingerprint, rtt_ms=1.0).generate(
        "spec_sync", PROMPTS[0], DecodeConfig(max_new_tokens=n, gamma_max=4, gamma0_fallback=False))
    assert on.tokens == off.tokens == target_greedy(target, PROMPTS[0], n)
    assert off.drafted >= off.blocks  # every block drafted at least one token
    assert on.drafted < on.blocks / 2, (on.drafted, on.blocks)
    # spec_async: restarts go out with γ = 0; drafts ride only on a right guess, which a
    # random draft rarely makes, so few blocks carry any
    dec = Decoder(edge, DirectLink(T), T.fingerprint, rtt_ms=80.0)
    for _ in range(2):  # the second generation starts from the first one's acceptance
        res = dec.generate("spec_async", PROMPTS[0], DecodeConfig(max_new_tokens=n, gamma_max=4))
        assert res.tokens == target_greedy(target, PROMPTS[0], n)
    assert res.drafted < res.blocks / 2, (res.drafted, res.blocks)
    assert dec._prior["spec_async"] < 0.4


def test_draft_batcher_runs_simulated_devices_together_with_unchanged_outputs(pair):
    """Three devices sharing one model: their steps run batched (fewer forwards than steps),
    and each device's greedy output equals what it generates alone."""
    import threading

    draft, _, tok = pair
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 100, 7, 100]]
    alone = []
    for p in prompts:
        e = EdgeLM(draft, tok)
        e.eos_ids = set()
        alone.append(Decoder(e).generate("edge", p, DecodeConfig(max_new_tokens=10)).tokens)
    batcher = DraftBatcher(draft, pad_id=0, max_wait_ms=20)
    got = [None] * 3

    def work(i):
        e = EdgeLM(draft, tok, batcher=batcher)
        e.eos_ids = set()
        got[i] = Decoder(e).generate("edge", prompts[i], DecodeConfig(max_new_tokens=10)).tokens

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    assert batcher.rows == 3 * (1 + 10) and batcher.batches < batcher.rows  # prefill + 10 steps each


def test_cloud_sampler_is_independent_of_the_device_seed():
    """The device draws drafts from Generator(seed); the cloud's acceptance draws must come
    from another stream, or draft and acceptance correlate and bias the output."""
    from edgefuse.cloud.target import TargetSession

    sess = TargetSession([1, 2], temperature=1.0, top_k=0, seed=7, max_new=4)
    device = torch.Generator().manual_seed(7)
    assert torch.rand(8, generator=sess.gen).tolist() != torch.rand(8, generator=device).tolist()


def test_a_bad_job_does_not_cost_the_batch(pair):
    """A VERIFY whose q names an id outside the vocabulary is refused; the other session in
    the same batch gets its answer and moves on normally."""
    draft, target, tok = pair
    T = Target(target, tok, "t")
    good = T.open(P.Open([5, 6, 7], T.fingerprint))
    bad = T.open(P.Open([5, 6, 7], T.fingerprint, temperature=1.0))
    q_ids = np.array([[10**7, 1]])
    r_good, r_bad = T.step([(good, P.Verify(1, 3, [])),
                            (bad, P.Verify(2, 3, [4], q_ids, np.array([[0.5, 0.5]])))])
    assert isinstance(r_good, P.Verified) and len(good.tokens) == 4
    assert isinstance(r_bad, P.Error) and r_bad.code == "protocol" and len(bad.tokens) == 3


# ------------------------------------------------------------------ every drafter through the loop

DRAFT_TOKENS = 24  # long enough for the target's output to repeat, so prompt lookup hits


def _drafter(name: str, edge: EdgeLM):
    """The ``name`` drafter over ``edge`` as the main job builds it (a head of every other id,
    one shallow layer of the tiny model's two, prompt lookup of 3- to 1-grams)."""
    spec = DrafterSpec(name, shallow_layers=1, ngram_n=3, ngram_min_n=1)
    head = DraftHead(edge.model, torch.arange(0, edge.vocab_size, 2)) if spec.head_size else None
    return drafter_factory(spec, head)(edge)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_drafter_is_lossless_greedy_with_partial_acceptance(perturbed, name):
    """For each drafter, sync (adaptive and fixed γ) and async speculative output equals the
    target's greedy continuation, and some but not all drafts are accepted (so both the
    accept and the reject-and-rollback paths ran)."""
    target, edge_model, tok = perturbed
    T = Target(target, tok, "t")
    edge = EdgeLM(edge_model, tok)
    edge.eos_ids = set()
    drafter = _drafter(name, edge)
    assert type(drafter) is DRAFTERS[name] and drafter.name == name
    dec = Decoder(edge, None, T.fingerprint, drafter=drafter)
    accepted = drafted = 0
    for prompt in PROMPTS:
        want = target_greedy(target, prompt, DRAFT_TOKENS)
        for mode, gamma in (("spec_sync", None), ("spec_sync", 3), ("spec_async", 3)):
            dec.link = DirectLink(T)
            res = dec.generate(mode, prompt, DecodeConfig(max_new_tokens=DRAFT_TOKENS, gamma=gamma))
            assert res.tokens == want, (mode, gamma)
            assert res.fallback is None and res.drafter == name
            assert res.round_trips == res.blocks < DRAFT_TOKENS or res.accepted == 0
            accepted, drafted = accepted + res.accepted, drafted + res.drafted
    assert 0 < accepted < drafted, (accepted, drafted)


SAMPLED_T = 0.03  # peaked target: p's top tokens hold ~0.4, 0.14, 0.13, ...
SAMPLED_PROMPT = {"ngram": [100, 7, 100, 7, 100]}  # prompt lookup proposes 7 here; others [40, 41, 42]


def _tv_on_top(counts: collections.Counter, n: int, p: torch.Tensor, k: int = 8) -> float:
    """Total variation between the empirical distribution (``counts`` of ``n`` draws) and
    ``p``, on ``p``'s top ``k`` ids and the rest lumped together."""
    top = torch.topk(p, k).indices.tolist()
    emp = np.array([counts[t] / n for t in top])
    ref = p[top].numpy()
    return 0.5 * (np.abs(emp - ref).sum() + abs((1 - emp.sum()) - (1 - ref.sum())))


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_drafter_keeps_the_target_distribution_when_sampling(perturbed, name):
    """At temperature 0.03, over 300 seeds, the first committed token is distributed as the
    target's p (total variation < 0.12), although the drafter's own q is far from p (> 0.2:
    had the cloud accepted every draft, the test would fail)."""
    target, edge_model, tok = perturbed
    prompt = SAMPLED_PROMPT.get(name, [40, 41, 42])
    T = Target(target, tok, "t")
    edge = EdgeLM(edge_model, tok)
    edge.eos_ids = set()
    drafter = _drafter(name, edge)
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double() / SAMPLED_T, -1)
    drafter.start(prompt)
    d = drafter.propose(1, SAMPLED_T, 32, torch.Generator().manual_seed(0))
    q_ids, q = sparse_q(*d.q[0])
    q_full = torch.zeros_like(p)
    q_full[q_ids] = q
    assert 0.5 * float((p - q_full).abs().sum()) > 0.2
    dec = Decoder(edge, None, T.fingerprint, drafter=drafter)
    counts, n, drafted = collections.Counter(), 300, 0
    for seed in range(n):
        dec.link = DirectLink(T)
        res = dec.generate("spec_sync", prompt, DecodeConfig(max_new_tokens=2, temperature=SAMPLED_T,
                                                             seed=seed, gamma=1, draft_topk=32))
        counts[res.tokens[0]] += 1
        drafted += res.drafted
    assert drafted >= n  # every generation verified a draft at its first position
    assert _tv_on_top(counts, n, p) < 0.12


def test_a_drafter_keeps_its_own_state_and_the_edge_takes_over_on_fallback(perturbed):
    """A shallow drafter has its own cache: the edge model is not run while it drafts, and
    when the cloud goes away the edge carries on from the committed ids, as it would alone."""
    target, edge_model, tok = perturbed
    T = Target(target, tok, "t")
    edge = EdgeLM(edge_model, tok)
    edge.eos_ids = set()
    drafter = ShallowDrafter.of(edge_model, tok, 1)
    prompt = PROMPTS[0]
    res = Decoder(edge, DirectLink(T), T.fingerprint, drafter=drafter).generate(
        "spec_sync", prompt, DecodeConfig(max_new_tokens=8, gamma=2))
    assert res.tokens == target_greedy(target, prompt, 8) and edge.tokens == []  # never started
    res = Decoder(edge, DirectLink(T, fail_after=3), T.fingerprint, drafter=drafter).generate(
        "spec_sync", prompt, DecodeConfig(max_new_tokens=10, gamma=2))  # OPEN, 2 VERIFY, gone
    assert len(res.tokens) == 10 and res.fallback and "edge only" in res.fallback
    k = res.accepted + res.blocks  # tokens the two answered blocks committed
    assert res.blocks == 2 and res.tokens[:k] == target_greedy(target, prompt, k)
    alone = EdgeLM(edge_model, tok)
    alone.eos_ids = set()
    rest = Decoder(alone).generate("edge", prompt + res.tokens[:k], DecodeConfig(max_new_tokens=10 - k))
    assert res.tokens[k:] == rest.tokens and edge.tokens == prompt + res.tokens
    assert drafter.tokens[:len(prompt) + k] == prompt + res.tokens[:k]


def test_the_default_drafter_follows_the_edge_head(pair):
    draft, _, tok = pair
    assert isinstance(Decoder(EdgeLM(draft, tok)).drafter, FullHeadDrafter)
    head = DraftHead(draft, torch.arange(10))
    d = Decoder(EdgeLM(draft, tok, head=head)).drafter
    assert isinstance(d, PrunedHeadDrafter) and d.head is head


def test_drafter_selected_by_config_and_bad_settings_refused():
    cfg = compose("tiny", ["cloud.decode.drafter=shallow", "cloud.decode.shallow_layers=1"])
    check_config(cfg)
    assert drafter_spec(cfg.cloud) == DrafterSpec("shallow", 32768, 1, 3, 1)
    assert drafter_spec(compose("tiny").cloud).name == "pruned_head"  # the default
    spec = drafter_spec(compose("tiny", ["cloud.decode.drafter=ngram", "cloud.decode.ngram_n=4",
                                         "cloud.decode.ngram_min_n=2"]).cloud)
    assert (spec.name, spec.ngram_n, spec.ngram_min_n, spec.head_size) == ("ngram", 4, 2, 0)
    assert DrafterSpec("pruned_head", draft_head=512).head_size == 512
    with pytest.raises(ConfigError, match="cloud.decode.drafter 'telepathy' is unknown: choose from") as e:
        check_config(compose("tiny", ["cloud.decode.drafter=telepathy"]))
    assert set(DRAFTERS) == {"pruned_head", "full_head", "shallow", "ngram"}
    assert all(n in str(e.value) for n in DRAFTERS)
    for bad, match in ((["cloud.decode.shallow_layers=0"], "shallow_layers"),
                       (["cloud.decode.ngram_n=1", "cloud.decode.ngram_min_n=2"], "ngram_min_n"),
                       (["cloud.decode.draft_head=0"], "full_head"),
                       (["cloud.decode.ngram_n=2.5"], "integer")):
        with pytest.raises(ConfigError, match=match):
            check_config(compose("tiny", bad))
    with pytest.raises(DecodeError, match="unknown"):
        drafter_spec(compose("tiny", ["cloud.decode.drafter=medusa"]).cloud)
    with pytest.raises(ValueError, match="needs its DraftHead"):
        drafter_factory(DrafterSpec("pruned_head"))(EdgeLM(*tiny_model("qwen2")))


def test_decode_result_comes_back_from_its_record():
    """A decoding record (summary + tokens, as the device replies) gives the result back:
    counters and drafter kept, derived figures recomputed, unknown keys ignored."""
    from edgefuse.cloud.decoding import DecodeResult

    res = DecodeResult("spec_sync", [4, 5, 6, 7], text="abcd", decode_s=2.0, round_trips=2, drafted=6,
                       accepted=3, blocks=2, bytes_up=90, drafter="ngram")
    back = DecodeResult.from_dict({**res.summary(), "tokens": [4, 5, 6, 7], "qid": "dolly/1"})
    assert back == res
    assert back.acceptance_rate == 0.5 and back.tokens_per_s == 2.0 and back.bytes_up_per_token == 22.5
    assert DecodeResult.from_dict({"mode": "edge", "tokens": [1]}).drafter is None  # an older record


@pytest.mark.parametrize("mode", ["spec_sync", "spec_async"])
def test_an_onnx_draft_stays_lossless(perturbed, tmp_path_factory, mode):
    """The edge profile: the perturbed draft exported to ONNX (int8) and run by ONNX Runtime
    drafts; the cloud verifies, so the output still equals the target's greedy output, and
    the int8 draft is accepted sometimes, not always."""
    pytest.importorskip("onnxruntime_genai")
    from edgefuse.cloud.decoding import OnnxEdgeLM
    from edgefuse.export import export_onnx
    from edgefuse.runtime import OnnxDecoder

    target, edge_model, tok = perturbed
    root = tmp_path_factory.getbasetemp() / "onnx-draft"
    ex = export_onnx("tiny-qwen2", "int8", model=edge_model, tok=tok, root=root)
    assert ex.adapter.startswith("weights-")  # keyed by its own weights, not the base model's
    T = Target(target, tok, "tiny-target")
    edge = OnnxEdgeLM(OnnxDecoder(ex.folder), tok)
    edge.eos_ids = set()
    accepted = drafted = 0
    for prompt in PROMPTS:
        res = Decoder(edge, DirectLink(T), T.fingerprint).generate(mode, prompt, DecodeConfig(max_new_tokens=12))
        assert res.tokens == target_greedy(target, prompt, 12)
        accepted, drafted = accepted + res.accepted, drafted + res.drafted
    assert 0 < accepted < drafted
