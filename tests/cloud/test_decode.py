"""Collaborative decoding on tiny random models: losslessness, fusion, deadlines, fallback.

The link here is in-process (``DirectLink``: the real protocol encoding and the real
``Target``, no socket), so these tests isolate the decoding logic; tests/test_cloud_service.py
covers the socket, the crypto and the batching service.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import edgefuse.cloud.protocol as P
from edgefuse.cloud.decoding.decoder import DecodeConfig, DecodeError, Decoder, EdgeLM, MODES
from edgefuse.cloud.fusion import FusionConfig, cloud_logprobs, fuse
from edgefuse.cloud.speculative import (GammaController, expected_tokens_per_block, sparse_q,
                               verify_greedy, verify_sampled)
from edgefuse.cloud.target import SessionError, Target, tokenizer_fingerprint
from edgefuse.models import tiny_model


class DirectLink:
    """The device end of the protocol without a socket: messages are encoded and decoded
    exactly as on the wire and answered by a real :class:`Target` (one session)."""

    def __init__(self, target: Target, fail_after: int | None = None, lag: bool = False):
        self.target, self.session = target, None
        self.inbox: collections.deque = collections.deque()
        self.bytes_up = self.bytes_down = self.round_trips = 0
        self.fail_after, self.sent = fail_after, 0
        self.lag = lag  # a slow cloud: each TOPK shows up only after the next request
        self.held = None

    def _deliver(self, msg):
        data = P.encode(msg)
        self.bytes_up += len(data)
        self.sent += 1
        if self.fail_after is not None and self.sent > self.fail_after:
            raise ConnectionError("cloud went away")
        msg = P.decode(data)
        if isinstance(msg, P.Close):
            self.target.close(self.session)
            return
        if isinstance(msg, P.Open):
            try:
                self.session = self.target.open(msg)
                reply = P.Opened(self.target.name, self.target.fingerprint, self.target.context_len)
            except SessionError as exc:
                reply = P.Error(exc.code, str(exc))
        else:
            (reply,) = self.target.step([(self.session, msg)])
        out = P.encode(reply)
        self.bytes_down += len(out)
        if self.held is not None:
            self.inbox.append(self.held)
            self.held = None
        if self.lag and isinstance(reply, P.TopK):
            self.held = P.decode(out)
        else:
            self.inbox.append(P.decode(out))

    def send(self, msg):
        self._deliver(msg)

    def count_round_trip(self):
        self.round_trips += 1

    def recv(self, timeout_s=None):
        if not self.inbox:
            raise TimeoutError("no reply yet")
        msg = self.inbox.popleft()
        if isinstance(msg, P.Error):
            raise P.RemoteError(msg.code, msg.message)
        return msg

    def request(self, msg, timeout_s=None):
        self.round_trips += 1
        self.send(msg)
        return self.recv(timeout_s)

    def open(self, prompt, fingerprint, temperature=0.0, top_k=0, seed=0, max_new=256):
        self.send(P.Open(prompt, fingerprint, temperature, top_k, seed, max_new))
        return self.recv()


@pytest.fixture(scope="module")
def pair():
    draft, tok = tiny_model("qwen2", seed=0)
    target, tok2 = tiny_model("qwen2", seed=1)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok2)
    return draft, target, tok


def _target_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 100, 7, 100, 7, 100, 7]]


@pytest.mark.parametrize("mode", ["cloud", "spec_sync", "spec_async"])
@pytest.mark.parametrize("gamma", [None, 1, 3])
def test_greedy_speculative_equals_target(pair, mode, gamma):
    draft, target, tok = pair
    T = Target(target, tok, "tiny-target")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()  # random models: generate the full length
    cfg = DecodeConfig(max_new_tokens=12, gamma=gamma)
    for prompt in PROMPTS:
        link = DirectLink(T)
        res = Decoder(edge, link, T.fingerprint).generate(mode, prompt, cfg)
        assert res.tokens == _target_greedy(target, prompt, 12)
        assert res.fallback is None
        if mode == "cloud":
            assert res.round_trips == 12 and res.drafted == 0
        else:
            assert res.round_trips == res.blocks and res.drafted >= res.accepted


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
    assert res.tokens == _target_greedy(target, PROMPTS[0], 16)


def test_async_hides_drafting_behind_the_round_trip(pair):
    """With draft = target the look-ahead guess is always right: async needs no fresh drafting
    after the first block, and the output still equals the target's."""
    _, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(target, tok)
    edge.eos_ids = set()
    res = Decoder(edge, DirectLink(T), T.fingerprint).generate(
        "spec_async", PROMPTS[1], DecodeConfig(max_new_tokens=20, gamma=4))
    assert res.tokens == _target_greedy(target, PROMPTS[1], 20)
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


def test_sampled_speculative_matches_target_distribution(pair):
    """End to end at temperature 1 through the protocol: the first generated token's
    empirical distribution equals the target's softmax (total variation < 0.06)."""
    draft, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    prompt = PROMPTS[0]
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
    top = torch.topk(p, 8).indices.tolist()
    counts = collections.Counter()
    n = 1500
    for seed in range(n):
        res = Decoder(edge, DirectLink(T), T.fingerprint).generate(
            "spec_sync", prompt, DecodeConfig(max_new_tokens=2, temperature=1.0, seed=seed, gamma=2,
                                              draft_topk=32))
        counts[res.tokens[0]] += 1
    emp = np.array([counts[t] / n for t in top])
    tv = 0.5 * (np.abs(emp - p[top].numpy()).sum() + abs((1 - emp.sum()) - (1 - float(p[top].sum()))))
    assert tv < 0.06


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
    assert res0.tokens == _target_greedy(target, PROMPTS[0], 8)  # cloud top-1 wins at w = 0
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


@pytest.mark.parametrize("mode", ["spec_sync", "spec_async", "fusion_static", "cloud"])
def test_cloud_gone_mid_generation_falls_back_to_edge(pair, mode):
    draft, target, tok = pair
    T = Target(target, tok, "t")
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    res = Decoder(edge, DirectLink(T, fail_after=3), T.fingerprint).generate(
        mode, PROMPTS[0], DecodeConfig(max_new_tokens=10, gamma=2))
    assert len(res.tokens) == 10
    assert res.fallback and "edge only" in res.fallback


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


def test_draft_batcher_runs_simulated_devices_together_with_unchanged_outputs(pair):
    """Three devices sharing one model: their steps run batched (fewer forwards than steps),
    and each device's greedy output equals what it generates alone."""
    import threading

    from edgefuse.cloud.decoding.decoder import DraftBatcher

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
