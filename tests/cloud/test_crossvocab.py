"""Decoding with a cloud of another tokenizer (edgefuse.cloud.crossvocab, CrossDrafter):
byte tables, byte-exact re-alignment, lossless cross-tokenizer speculative decoding, fusion
across vocabularies, the fallback, and sessions of three tokenizers batched by one service.

Tiny random models of three tokenizers stand in for the device and the cloud: the cloud a
byte-level BPE (``bpe``, as Qwen2.5), the devices a SentencePiece-style BPE with byte fallback
(``spm``, as Gemma 3) and another byte-level BPE (``bpe_small``, as SmolLM2). Their
tokenizations of one text differ at most boundaries, and a random model emits bytes that are
not whole characters (half of a UTF-8 character, stray continuation bytes) often, so the
boundary handling runs on every prompt.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

import edgefuse.cloud.protocol as P
from edgefuse.cloud.crossvocab import (ByteFollower, CrossVocab, VocabError, candidates, encode_bytes,
                                       fuse_candidates, token_bytes, utf8_boundary)
from edgefuse.cloud.decoding import DecodeConfig, Decoder, Draft, Drafter, EdgeLM
from edgefuse.cloud.decoding.cross import CrossDrafter
from edgefuse.cloud.fusion import FusionConfig
from edgefuse.cloud.link import CloudLink
from edgefuse.cloud.target import Target
from edgefuse.models import tiny_model, tiny_tokenizer
from tests.cloud.conftest import DirectLink, device_keys, target_greedy


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def cloud():
    model, tok = tiny_model("qwen2", seed=1)
    return model, tok, Target(model, tok, "tiny-target")


DEVICES = {"spm": ("llama", "spm"), "bpe_small": ("gemma3_text", "bpe_small")}


@pytest.fixture(scope="module")
def devices(cloud):
    """name -> (device model, its tokenizer, CrossVocab with the cloud's)."""
    out = {}
    for name, (arch, kind) in DEVICES.items():
        m, t = tiny_model(arch, seed=0, tokenizer=kind)
        out[name] = (m, t, CrossVocab(t, cloud[1]))
    return out


CHARS = list("abcdefghij klmnop qrstuvwxyz  THE,.!?0123\n") + ["é", "ï", "数", "学", "🙂", "—"]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(CHARS) for _ in range(rng.randint(4, 24))) for _ in range(n)]


class OracleDrafter(Drafter):
    """A device drafter (device ids) that knows the target's continuation ``reference``
    (bytes) and drafts the device's tokenization of it, each token wrong (a random id) with
    probability ``err``: drafts are accepted often, not always, and the device's token
    boundaries fall where the cloud's do not."""

    name = "oracle"

    def __init__(self, tok, reference: bytes, err: float, seed: int):
        super().__init__()
        self.tok, self.vocab, self.ref, self.err = tok, token_bytes(tok), reference, err
        self.rng = random.Random(seed)
        self._tokens: list[int] = []
        self.plen = 0

    @property
    def tokens(self):
        return self._tokens

    def _start(self, prompt):
        self._tokens, self.plen = list(prompt), len(prompt)

    def _rollback(self, length):
        del self._tokens[length:]

    def push(self, token):
        self._tokens.append(int(token))

    def _right(self) -> int | None:
        done = self.vocab.join(self._tokens[self.plen:])
        if not self.ref.startswith(done):
            return None
        rest = self.ref[len(done):]
        for cut in range(min(len(rest), 12), 0, -1):
            try:
                ids = encode_bytes(self.tok, self.vocab, rest[:cut])
            except VocabError:
                continue
            if ids:
                return ids[0]
        return None

    def propose(self, gamma, temperature=0.0, kq=16, gen=None):
        out = Draft()
        for _ in range(int(gamma)):
            t = self._right()
            if t is None or self.rng.random() < self.err:
                t = self.rng.randrange(7, self.vocab.size)  # not a special token
            self.push(t)
            out.ids.append(t)
        return out

    @classmethod
    def build(cls, spec, edge, head, shared):
        raise TypeError


# ------------------------------------------------------------------------ byte tables

def test_byte_tables_spell_every_kind_of_tokenizer():
    """Each tiny kind's table spells texts with accents, CJK, emoji, tabs and a leading space
    back byte for byte; a special token is b"" and an end id is among ``ends``."""
    for kind in ("bpe", "bpe_small", "spm"):
        tok = tiny_tokenizer(kind=kind)
        v = token_bytes(tok)
        for text in ("naïve café 数学 🙂", " lead\ttab\n", "x"):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert v.join(ids) == text.encode(), kind
        assert v.table[tok.pad_token_id] == b"" and tok.eos_token_id in v.ends
    assert token_bytes(tok) is v  # built once per tokenizer object


def test_utf8_boundary_by_hand():
    e = "é".encode()  # c3 a9
    assert utf8_boundary(b"ab" + e) == 4
    assert utf8_boundary(b"ab" + e[:1]) == 2  # ends inside a character
    assert utf8_boundary("🙂".encode()[:3]) == 0
    assert utf8_boundary(b"a\x80") == 2  # a stray continuation byte counts as whole


def test_exact_encoding_keeps_bytes_that_are_not_utf8(devices):
    """Bytes a model emitted that are not UTF-8 still map to tokens that spell them (the
    byte-level token, or ``<0xNN>``), so the two sides never disagree on the text."""
    _, _, cv = devices["spm"]
    data = "ok é".encode() + b"\x80\xff!"
    assert cv.cloud.join(cv.cloud_ids(data)) == data
    assert cv.device.join(cv.device_ids(data)) == data


# --------------------------------------------------------------------- re-alignment by hand

class Holder:
    def __init__(self, tokens):
        self.tokens, self.fed = list(tokens), 0

    def rollback(self, n):
        del self.tokens[n:]

    def push(self, t):
        self.tokens.append(int(t))
        self.fed += 1


def test_follower_keeps_the_matching_prefix_and_reencodes_the_rest():
    tok = tiny_tokenizer(kind="spm")
    v = token_bytes(tok)
    ids = tok("The quick brown", add_special_tokens=False)["input_ids"]
    h = Holder([1] + ids)  # a one-id prompt
    f = ByteFollower(h, tok, v, 1)
    assert f.sync(b"The quick brown") == 0 and h.fed == 0  # already spelled: nothing fed
    # the cloud committed another word after "The quick": the shared ids stay, the rest is new
    f.sync(b"The quick fox")
    assert v.join(h.tokens[1:]) == b"The quick fox"
    assert h.tokens[:1 + len(tok("The quick", add_special_tokens=False)["input_ids"])] == \
        [1] + tok("The quick", add_special_tokens=False)["input_ids"]
    # half of a character: what is whole is fed, the rest waits as unfed
    e = "é".encode()
    f.sync(b"The quick fox " + e[:1])
    assert v.join(h.tokens[1:]) == b"The quick fox " and f.unfed == e[:1]
    f.sync(b"The quick fox " + e)
    assert v.join(h.tokens[1:]) == "The quick fox é".encode() and f.unfed == b""
    # an end token the device drafted is dropped when the text goes on
    h.push(tok.eos_token_id)
    f.sync("The quick fox é!".encode())
    assert tok.eos_token_id not in h.tokens and v.join(h.tokens[1:]) == "The quick fox é!".encode()


def test_cross_drafter_holds_back_the_piece_that_may_grow(devices, cloud):
    """The device drafts " quick" one token at a time; the cloud's re-encoding of what was
    drafted so far ends with a piece that could still grow, so that last cloud id is not
    proposed until text follows it; what is proposed spells a prefix of the drafted bytes."""
    _, ctok, _ = cloud
    _, dtok, cv = devices["spm"]
    ref = " quick brown fox jumps".encode()
    inner = OracleDrafter(dtok, ref, err=0.0, seed=0)
    d = CrossDrafter(inner, cv, dtok("The", add_special_tokens=False)["input_ids"])
    d.start(ctok("The", add_special_tokens=False)["input_ids"])
    draft = d.propose(3)
    assert 1 <= len(draft.ids) <= 3
    proposed = cv.cloud.join(draft.ids)
    drafted = cv.device.join(inner.tokens[inner.plen:])
    assert ref.startswith(drafted) and drafted.startswith(proposed) and len(drafted) > len(proposed)
    # the cloud accepts everything and adds its own token: the device keeps its tokens that
    # still spell the committed text and follows the rest
    x = ctok("X", add_special_tokens=False)["input_ids"][0]
    d.observe(len(draft.ids), x)
    assert cv.device.join(inner.tokens[inner.plen:]) == proposed + cv.cloud.table[x]
    assert d.text == proposed + cv.cloud.table[x]


# ------------------------------------------------------------- lossless speculative decoding

def _reference(target, ctok, text, n):
    cp = ctok(text)["input_ids"]
    ref = target_greedy(target, cp, n)
    return cp, ref


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("mode", ["spec_sync", "spec_async"])
def test_cross_tokenizer_greedy_speculation_equals_the_cloud(cloud, devices, device, mode):
    """Random prompts (accents, CJK, emoji); the device drafts in its own tokenizer (an
    oracle of the target's text with 30 % wrong tokens); the output equals the target's own
    greedy ids token for token, and drafts were both accepted and rejected."""
    target, ctok, T = cloud
    dmodel, dtok, cv = devices[device]
    n = 14
    accepted = drafted = 0
    for i, text in enumerate(random_texts(6, seed=hash(device) % 1000)):
        cp, ref = _reference(target, ctok, text, n)
        long_ref = cv.cloud.join(target_greedy(target, cp, n + 10))
        edge = EdgeLM(dmodel, dtok)
        inner = OracleDrafter(dtok, long_ref, err=0.3, seed=i)
        dec = Decoder(edge, DirectLink(T), T.fingerprint, drafter=inner, cross=cv)
        res = dec.generate(mode, dtok(text)["input_ids"], DecodeConfig(max_new_tokens=n), cloud_prompt=cp)
        assert res.tokens == ref, (text, res.tokens, ref)
        assert res.tokenizer == "cross" and res.fallback is None
        assert res.text == ctok.decode(ref, skip_special_tokens=True)
        accepted, drafted = accepted + res.accepted, drafted + res.drafted
    assert 0 < accepted < drafted, (accepted, drafted)


def test_cross_cloud_mode_and_a_real_draft_equal_the_cloud(cloud, devices):
    """The device's own model as the draft (random weights: almost nothing accepted) and the
    ``cloud`` mode (γ = 0): both give the target's greedy ids."""
    target, ctok, T = cloud
    dmodel, dtok, cv = devices["spm"]
    for text in random_texts(3, seed=7):
        cp, ref = _reference(target, ctok, text, 10)
        for mode in ("cloud", "spec_sync", "spec_async"):
            edge = EdgeLM(dmodel, dtok)
            edge.eos_ids = set()
            res = Decoder(edge, DirectLink(T), T.fingerprint, cross=cv).generate(
                mode, dtok(text)["input_ids"], DecodeConfig(max_new_tokens=10), cloud_prompt=cp)
            assert res.tokens == ref, (mode, text)
            if mode == "cloud":
                assert res.round_trips == 10 and res.drafted == 0


def test_cross_sampling_sends_point_masses_and_keeps_the_target_distribution(cloud, devices):
    """At temperature 0.02 the first token's empirical distribution over 600 seeds follows
    the target's p (TV < 0.08), though every first token was a cross-tokenizer draft the
    cloud verified against its one-hot q."""
    target, ctok, T = cloud
    dmodel, dtok, cv = devices["spm"]
    text = "The quick brown"
    cp = ctok(text)["input_ids"]
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([cp])).logits[0, -1].double() / 0.02, -1).numpy()
    long_ref = cv.cloud.join(target_greedy(target, cp, 12))
    counts = np.zeros_like(p)
    n = 600
    for seed in range(n):
        inner = OracleDrafter(dtok, long_ref, err=0.5, seed=seed)
        dec = Decoder(EdgeLM(dmodel, dtok), DirectLink(T), T.fingerprint, drafter=inner, cross=cv)
        res = dec.generate("spec_sync", dtok(text)["input_ids"],
                           DecodeConfig(max_new_tokens=2, temperature=0.02, seed=seed, gamma=2),
                           cloud_prompt=cp)
        counts[res.tokens[0]] += 1
    tv = 0.5 * np.abs(counts / n - p).sum()
    assert tv < 0.08, tv


def test_a_point_mass_draft_is_sent_one_hot(cloud, devices):
    _, ctok, _ = cloud
    _, dtok, cv = devices["spm"]
    inner = OracleDrafter(dtok, b" quick brown fox", err=0.0, seed=0)
    d = CrossDrafter(inner, cv, dtok("The")["input_ids"])
    d.start(ctok("The")["input_ids"])
    draft = d.propose(2, temperature=0.7)
    assert draft.ids and len(draft.q) == len(draft.ids)
    for t, (ids, probs) in zip(draft.ids, draft.q):
        assert ids.tolist() == [t] and probs.tolist() == [1.0]


# ------------------------------------------------------------------------- fusion

@pytest.mark.parametrize("device", sorted(DEVICES))
def test_fusion_weight_one_is_the_edge_and_zero_the_cloud_across_vocabularies(cloud, devices, device):
    """w = 1: the text of the device alone (its own greedy tokens); w = 0: the cloud's greedy
    ids, on random prompts."""
    target, ctok, T = cloud
    dmodel, dtok, cv = devices[device]
    for text in random_texts(3, seed=11):
        cp, ref = _reference(target, ctok, text, 10)
        ref = ref[:min([i for i, t in enumerate(ref) if t in cv.cloud.ends], default=len(ref))]
        dp = dtok(text)["input_ids"]
        edge = EdgeLM(dmodel, dtok)  # both stop at an end token
        alone = Decoder(edge, None).generate("edge", dp, DecodeConfig(max_new_tokens=10))
        cfg1 = DecodeConfig(max_new_tokens=10, fusion=FusionConfig(weight=1.0))
        one = Decoder(edge, DirectLink(T), T.fingerprint, cross=cv).generate("fusion_static", dp, cfg1,
                                                                              cloud_prompt=cp)
        assert cv.cloud.join(one.tokens) == cv.device.join(alone.tokens), text
        cfg0 = DecodeConfig(max_new_tokens=10, fusion=FusionConfig(weight=0.0))
        zero = Decoder(edge, DirectLink(T), T.fingerprint, cross=cv).generate("fusion_static", dp, cfg0,
                                                                               cloud_prompt=cp)
        assert zero.tokens == ref, text
        half = Decoder(edge, DirectLink(T), T.fingerprint, cross=cv).generate(
            "fusion_adaptive", dp, DecodeConfig(max_new_tokens=10), cloud_prompt=cp)
        assert half.edge_weight_mean is not None and half.tokens


def test_candidates_by_hand(devices):
    """The cloud's top-2 and the device's top-2 as byte strings: a cloud entry spelled by one
    device token gets that token's score; a device-only token gets the cloud's spread tail;
    fusion at 0.5 ranks by the mean; w = 1 / 0 pick the device's / the cloud's best."""
    _, dtok, cv = devices["spm"]
    c_the = cv.cloud_ids(b" the")
    d_the, d_fox = cv.device_ids(b" the"), cv.device_ids(b"x")
    assert len(c_the) == 1 and len(d_the) == 1 and len(d_fox) == 1
    c_q = cv.cloud_ids(b"q")[0]
    reply = P.TopK(1, np.asarray([c_the[0], c_q], np.int32), np.asarray([0, 40], np.uint8),
                   top=-0.5, scale=0.05, tail=-2.0)  # log-probs -0.5, -2.5
    logits = torch.full((cv.device.size,), -20.0)
    logits[d_fox[0]], logits[d_the[0]] = 5.0, 3.0
    cands = candidates(logits, reply, cv, k=2)
    by = {c.data: c for c in cands}
    edge = torch.log_softmax(logits.double(), -1)
    assert by[b" the"].cloud_id == c_the[0] and by[b" the"].device_id == d_the[0]
    assert by[b" the"].edge == pytest.approx(float(edge[d_the[0]]))
    assert by[b"x"].cloud_id is None and by[b"x"].cloud == pytest.approx(-2.0 - np.log(cv.cloud.size - 2))
    assert cands[fuse_candidates(cands, 1.0)[1]].data == b"x"
    assert cands[fuse_candidates(cands, 0.0)[1]].data == b" the"
    assert cands[fuse_candidates(cands, 0.5)[1]].data == b" the"  # (3-ish + -0.5) beats (5-ish + -12)


# ------------------------------------------------------------------------- fallback

@pytest.mark.parametrize("mode", ["spec_sync", "fusion_static"])
def test_a_cloud_gone_mid_generation_leaves_a_whole_answer_in_the_clouds_ids(cloud, devices, mode):
    target, ctok, T = cloud
    dmodel, dtok, cv = devices["spm"]
    text = "The quick brown"
    cp = ctok(text)["input_ids"]
    edge = EdgeLM(dmodel, dtok)
    edge.eos_ids = set()
    cfg = DecodeConfig(max_new_tokens=12, gamma=1)
    whole = Decoder(edge, DirectLink(T), T.fingerprint, cross=cv).generate(
        mode, dtok(text)["input_ids"], cfg, cloud_prompt=cp)
    res = Decoder(edge, DirectLink(T, fail_after=4), T.fingerprint, cross=cv).generate(
        mode, dtok(text)["input_ids"], cfg, cloud_prompt=cp)
    assert whole.fallback is None and res.fallback and "edge only" in res.fallback
    assert res.tokenizer == "cross" and len(res.tokens) >= 12 - 1
    assert res.tokens[:2] == whole.tokens[:2]  # what the cloud committed before it went away
    assert res.text == ctok.decode(res.tokens, skip_special_tokens=True)


# --------------------------------------------------------- three tokenizers, one service

def test_sessions_of_three_tokenizers_batch_together_and_equal_their_solo_answers(cloud, devices,
                                                                                  start_service):
    """One real service (sockets, SIGMA-I, AES-GCM); a device of the cloud's own tokenizer
    and two of others decode at once in spec_sync: each output equals its answer alone, and
    the service ran some forward passes with more than one session in them."""
    target, ctok, _ = cloud
    svc = start_service(target, ctok, max_wait_ms=50)
    same_model, _ = tiny_model("llama", seed=3, tokenizer="bpe")  # the cloud's own tokenizer
    runs = {"bpe": (same_model, ctok, None), **{k: v for k, v in devices.items()}}
    text = "The quick brown fox"
    cp = ctok(text)["input_ids"]
    ref = target_greedy(target, cp, 12)
    cfg = DecodeConfig(max_new_tokens=12, gamma=2)
    results, errors = {}, []

    def run(name):
        try:
            model, tok, cv = runs[name]
            edge = EdgeLM(model, tok)
            edge.eos_ids = set()
            with CloudLink.connect("127.0.0.1", svc.port, **device_keys(0)) as link:
                dec = Decoder(edge, link, svc.target.fingerprint, cross=cv)
                results[name] = dec.generate("spec_sync", tok(text)["input_ids"], cfg,
                                             cloud_prompt=cp if cv else None)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for name, res in results.items():
        assert res.tokens == ref, name
        assert res.tokenizer == ("same" if name == "bpe" else "cross")
    stats = svc.stats()
    assert stats["max_batch_size"] >= 2, stats


# --------------------------------------------------------------------- a lying cloud

class LyingLink(DirectLink):
    """A cloud that answers its second VERIFIED (or every TOPK) with values out of range."""

    def __init__(self, target, how):
        super().__init__(target)
        self.how, self.seen = how, 0

    def recv(self, timeout_s=None):
        m = super().recv(timeout_s)
        if isinstance(m, P.Verified):
            self.seen += 1
            if self.seen == 2:
                m = {"token": P.Verified(m.req, m.accepted, 10**6), "negative": P.Verified(m.req, m.accepted, -5),
                     "accepted": P.Verified(m.req, 200, m.token)}.get(self.how, m)
        if isinstance(m, P.TopK) and self.how == "topk":
            m = P.TopK(m.req, m.ids * 0 + 10**6, m.q, m.top, m.scale, m.tail)
        return m


@pytest.mark.parametrize("how, mode", [("token", "spec_sync"), ("negative", "spec_async"),
                                       ("accepted", "spec_sync"), ("topk", "fusion_static")])
def test_a_lying_cloud_is_a_protocol_error_not_a_crash(cloud, devices, how, mode):
    """Answers out of range (a token outside the vocabulary, more accepted than drafted, top-k
    ids outside the vocabulary) are refused by name, for a device of either tokenizer."""
    target, ctok, T = cloud
    dmodel, dtok, cv = devices["spm"]
    text = "The quick brown fox"
    for cross in (cv, None):
        edge = EdgeLM(dmodel if cross else target, dtok if cross else ctok)
        edge.eos_ids = set()
        dec = Decoder(edge, LyingLink(T, how), T.fingerprint, cross=cross)
        with pytest.raises(P.ProtocolError, match="lying cloud|outside the vocabulary"):
            dec.generate(mode, (dtok if cross else ctok)(text)["input_ids"], DecodeConfig(max_new_tokens=8, gamma=2),
                         cloud_prompt=ctok(text)["input_ids"] if cross else None)


def test_the_fallback_starts_the_edge_on_its_own_prompt_whatever_drafted(cloud, devices):
    """A prompt-lookup drafter (no model) and an edge that decoded another prompt before: when
    the cloud goes away, the edge goes on from the device's prompt and the committed text."""
    from edgefuse.cloud.decoding import NgramDrafter

    target, ctok, T = cloud
    dmodel, dtok, cv = devices["spm"]
    edge = EdgeLM(dmodel, dtok)
    edge.eos_ids = set()
    Decoder(edge, None).generate("edge", dtok("Zebra zebra zebra")["input_ids"], DecodeConfig(max_new_tokens=3))
    text = "The quick brown fox"
    dp = dtok(text)["input_ids"]
    res = Decoder(edge, DirectLink(T, fail_after=4), T.fingerprint, drafter=NgramDrafter(), cross=cv).generate(
        "spec_sync", dp, DecodeConfig(max_new_tokens=12, gamma=1), cloud_prompt=ctok(text)["input_ids"])
    assert res.fallback and edge.tokens[:len(dp)] == dp and len(res.tokens) == 12
