"""Device side of a C2C exchange (edgefuse.c2c.peer): payload codec, frames, sealed sessions,
and the share / refine / answer roles end to end in one process.

Tiny random-weight models: receiver tiny-llama (3 layers), sharer tiny-qwen2 (2 layers); both
use the tiny tokenizer with its chat template, so the prompts align one to one.
"""

import struct

import numpy as np
import pytest
import torch

from edgefuse.models import load_tokenizer, tiny_model
from edgefuse.transport import crypto
from edgefuse.c2c import peer
from edgefuse.c2c.exchange import decode_kv_cache
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.peer import (
    MAGIC,
    PeerPayloadError,
    answer_queries,
    decode_payload,
    encode_payload,
    open_payloads,
    pack_frames,
    pair_example,
    refine_prefill,
    share_answers,
    share_prefill,
    unpack_frames,
)
from edgefuse.eval.queries import (HINT_HEADER, Query, answer_text, greedy_decode, prefill, prompt_split,
                            t2t_hint)
from edgefuse.c2c.registry import ModelVersion

MAX_PROMPT = 256
MAX_NEW = 4
RECV_V = ModelVersion("tiny-llama", "aaaaaaaaaaaaaaaa")
SHARE_V = ModelVersion("tiny-qwen2", "base")

MMLU = Query(qid="mmlu/test/demo/0", kind="mmlu",
             instruction="What jumps over the lazy dog?\nA. The fox\nB. The dog\nC. A model\nD. None\n"
                         "Answer with the letter of the correct choice.",
             context="", choices=["The fox", "The dog", "A model", "None"], answer=0, reference=None,
             category="demo")
DOLLY = Query(qid="dolly/1", kind="dolly", instruction="What trains a model?",
              context="Federated learning trains a model across devices.", choices=None, answer=None,
              reference="Federated learning.", category="closed_qa")
QUERIES = [MMLU, DOLLY]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def models():
    receiver, _ = tiny_model("llama", seed=0)
    sharer, _ = tiny_model("qwen2", seed=1)
    receiver.requires_grad_(False)
    sharer.requires_grad_(False)
    return {"r": receiver, "rt": load_tokenizer("tiny-llama"),
            "s": sharer, "st": load_tokenizer("tiny-qwen2")}


def sessions():
    """(initiator session, responder session) of one fresh X25519 exchange."""
    a, b = crypto.generate_keypair(), crypto.generate_keypair()
    sid = crypto.new_session_id()
    return (crypto.derive_session(a, b.public_bytes(), sid, initiator=True),
            crypto.derive_session(b, a.public_bytes(), sid, initiator=False))


def make_fuser(recv, share, gate_init, randomize, seed=0):
    fuser = C2CFuser(kv_spec_from_config(recv.config), kv_spec_from_config(share.config),
                     FuserConfig(bottleneck=8, gate_init=gate_init))
    if randomize:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in fuser.layers.values():
                for branch in (layer.key, layer.value):
                    branch.up.weight.copy_(torch.randn(branch.up.weight.shape, generator=g) * 0.5)
                    branch.up.bias.copy_(torch.randn(branch.up.bias.shape, generator=g) * 0.5)
    return fuser.eval()


@pytest.fixture
def record_scores(monkeypatch):
    """Record the log-probabilities every score_choices call inside edgefuse.c2c.peer returns."""
    seen = []
    real = peer.score_choices

    def wrapper(*args, **kw):
        pred, logp = real(*args, **kw)
        seen.append(logp)
        return pred, logp

    monkeypatch.setattr(peer, "score_choices", wrapper)
    return seen


# ---------------------------------------------------------------- payload codec


def test_payload_round_trip_and_layout():
    body = b"\x00\x01 body bytes \xff"
    data = encode_payload("kv", "q/1", SHARE_V, body)
    assert data[:4] == MAGIC
    (n,) = struct.unpack("<I", data[4:8])
    assert data[8 + n:] == body
    p = decode_payload(data)
    assert (p.kind, p.qid, p.sender, p.body) == ("kv", "q/1", SHARE_V, body)
    t = decode_payload(encode_payload("text", "q/2", RECV_V, "héllo".encode()))
    assert (t.kind, t.qid, t.sender, t.body.decode()) == ("text", "q/2", RECV_V, "héllo")


def test_payload_rejects_malformed():
    good = encode_payload("kv", "q", SHARE_V, b"xyz")
    with pytest.raises(PeerPayloadError, match="magic"):
        decode_payload(b"EFP2" + good[4:])
    with pytest.raises(PeerPayloadError, match="magic"):
        decode_payload(MAGIC + b"\x01")
    with pytest.raises(PeerPayloadError, match="header length"):
        decode_payload(MAGIC + struct.pack("<I", 1000) + b"{}")
    with pytest.raises(PeerPayloadError, match="header length"):
        decode_payload(MAGIC + struct.pack("<I", peer.MAX_HEADER_BYTES + 1) + b"x" * 5000)
    not_json = b"not json"
    with pytest.raises(PeerPayloadError, match="malformed"):
        decode_payload(MAGIC + struct.pack("<I", len(not_json)) + not_json)
    missing = b'{"kind": "kv", "qid": "q"}'
    with pytest.raises(PeerPayloadError, match="malformed"):
        decode_payload(MAGIC + struct.pack("<I", len(missing)) + missing)
    with pytest.raises(PeerPayloadError, match="unknown peer payload kind 'image'"):
        decode_payload(encode_payload("image", "q", SHARE_V, b""))


def test_pack_unpack_frames():
    frames = [b"abc", b"", b"\x00\xff" * 5]
    flat, lengths = pack_frames(frames)
    assert flat.dtype == np.uint8 and flat.ndim == 1 and flat.size == 13
    assert lengths == [3, 0, 10]
    assert unpack_frames(flat, lengths) == frames
    empty, no_lengths = pack_frames([])
    assert empty.size == 0 and no_lengths == [] and unpack_frames(empty, []) == []
    with pytest.raises(PeerPayloadError, match="add up"):
        unpack_frames(flat, [3, 0, 9])
    with pytest.raises(PeerPayloadError, match="add up"):
        unpack_frames(flat, [3, 0, 11])
    with pytest.raises(PeerPayloadError, match="add up"):
        unpack_frames(flat, [14, -1])
    with pytest.raises(PeerPayloadError, match="uint8"):
        unpack_frames(flat.astype(np.int16), lengths)


# ---------------------------------------------------------------- sealed payloads


def _sealed(session, items):
    return [session.seal(encode_payload(kind, qid, who, body)) for kind, qid, who, body in items]


def test_open_payloads_right_queries():
    send, recv = sessions()
    frames = _sealed(send, [("kv", MMLU.qid, SHARE_V, b"one"), ("kv", DOLLY.qid, SHARE_V, b"two")])
    got = open_payloads(recv, frames, QUERIES, "kv", expect=SHARE_V)
    assert [(p.qid, p.body, p.sender) for p in got] == [(MMLU.qid, b"one", SHARE_V),
                                                        (DOLLY.qid, b"two", SHARE_V)]
    # the responder's answers open on the initiator's side (the other direction)
    back = _sealed(recv, [("text", MMLU.qid, RECV_V, b"B")])
    assert open_payloads(send, back, [MMLU], "text")[0].body == b"B"


def test_open_payloads_refusals():
    send, recv = sessions()
    with pytest.raises(PeerPayloadError, match="1 payloads for 2 queries"):
        open_payloads(recv, _sealed(send, [("kv", MMLU.qid, SHARE_V, b"")]), QUERIES, "kv")

    send, recv = sessions()
    with pytest.raises(PeerPayloadError, match="for query 'other'"):
        open_payloads(recv, _sealed(send, [("kv", "other", SHARE_V, b"")]), [MMLU], "kv")

    send, recv = sessions()
    with pytest.raises(PeerPayloadError, match="expected a 'kv'"):
        open_payloads(recv, _sealed(send, [("text", MMLU.qid, SHARE_V, b"")]), [MMLU], "kv")

    send, recv = sessions()
    impostor = ModelVersion("tiny-qwen2", "0123456789abcdef")
    with pytest.raises(PeerPayloadError, match="refusing"):
        open_payloads(recv, _sealed(send, [("kv", MMLU.qid, impostor, b"")]), [MMLU], "kv",
                      expect=SHARE_V)


def test_open_payloads_tampered_and_reordered_frames():
    send, recv = sessions()
    frames = _sealed(send, [("kv", MMLU.qid, SHARE_V, b"one"), ("kv", DOLLY.qid, SHARE_V, b"two")])
    flipped = bytearray(frames[0])
    flipped[crypto.HEADER_BYTES + 2] ^= 0x01  # a ciphertext byte
    with pytest.raises(crypto.TamperedFrameError):
        open_payloads(recv, [bytes(flipped), frames[1]], QUERIES, "kv")
    with pytest.raises(crypto.ReorderError):  # seq 1 arrives first: a gap in the stream
        open_payloads(recv, [frames[1], frames[0]], QUERIES, "kv")
    assert issubclass(crypto.ReorderError, crypto.FrameError)
    # rejected frames leave the session as it was: the genuine order still opens
    assert [p.body for p in open_payloads(recv, frames, QUERIES, "kv")] == [b"one", b"two"]


# ---------------------------------------------------------------- end to end


def _kv_payloads(models, queries=QUERIES):
    """The sharer's sealed prefill caches, opened by the receiver."""
    send, recv = sessions()
    frames, ms = share_prefill(send, models["s"], models["st"], SHARE_V, queries, models["rt"], MAX_PROMPT)
    assert len(frames) == len(ms) == len(queries) and all(t >= 0 for t in ms)
    return open_payloads(recv, frames, queries, "kv", expect=SHARE_V)


def test_share_prefill_payload_is_the_sharers_cache(models):
    payloads = _kv_payloads(models)
    for q, p in zip(QUERIES, payloads):
        ids = pair_example(q, models["rt"], models["st"], MAX_PROMPT).sharer_prompt_ids
        exact = prefill(models["s"], ids)
        got = decode_kv_cache(p.body)
        assert len(got.layers) == len(exact.layers) == 2
        for a, b in zip(got.layers, exact.layers):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert x.shape == y.shape and x.shape[2] == len(ids)
                bound = y.abs().amax(dim=-1, keepdim=True) / 127 * 0.5 * (1 + 2**-9) + 1e-6
                assert bool(((x - y).abs() <= bound).all())


def test_closed_gate_changes_nothing_through_the_exchange(models, record_scores):
    payloads = _kv_payloads(models)
    alone = answer_queries(models["r"], models["rt"], QUERIES, max_prompt_tokens=MAX_PROMPT,
                           max_new_tokens=MAX_NEW)
    alone_logp = record_scores[:]
    closed = make_fuser(models["r"], models["s"], gate_init=-10.0, randomize=True)
    fused = answer_queries(models["r"], models["rt"], QUERIES, max_prompt_tokens=MAX_PROMPT,
                           max_new_tokens=MAX_NEW,
                           sharers=[{"fuser": closed, "tok": models["st"], "payloads": payloads}])
    assert [r["qid"] for r in fused] == [q.qid for q in QUERIES]
    assert [(r["pred"], r["text"]) for r in fused] == [(r["pred"], r["text"]) for r in alone]
    assert alone[0]["pred"] in range(4) and alone[0]["text"] is None
    assert alone[1]["pred"] is None and isinstance(alone[1]["text"], str)
    assert record_scores[len(alone_logp):] == alone_logp  # bit-identical letter log-probs
    assert fused[0]["fuse_ms"] > 0 and alone[0]["fuse_ms"] == 0.0


def test_open_gate_changes_the_scores(models, record_scores):
    payloads = _kv_payloads(models)
    answer_queries(models["r"], models["rt"], [MMLU], max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW)
    open_ = make_fuser(models["r"], models["s"], gate_init=1.0, randomize=True)
    answer_queries(models["r"], models["rt"], [MMLU], max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW,
                   sharers=[{"fuser": open_, "tok": models["st"], "payloads": payloads[:1]}])
    assert len(record_scores) == 2
    alone, fused = np.array(record_scores[0]), np.array(record_scores[1])
    assert np.all(np.isfinite(fused)) and np.all(fused < 0)
    assert np.max(np.abs(fused - alone)) > 1e-4


def _co_c2c(models, refiner):
    """Receiver shares its cache, the sharer refines it with ``refiner``; returns the refined
    payloads as the receiver opens them."""
    r_sess, s_sess = sessions()  # the receiver starts the exchange
    f1, _ = share_prefill(r_sess, models["r"], models["rt"], RECV_V, QUERIES, models["st"], MAX_PROMPT)
    f2, ms = refine_prefill(s_sess, s_sess, models["s"], models["st"], SHARE_V, QUERIES, f1, refiner,
                            models["rt"], RECV_V, MAX_PROMPT)
    assert len(f2) == len(ms) == len(QUERIES)
    return open_payloads(r_sess, f2, QUERIES, "kv", expect=SHARE_V)


def test_refine_prefill_co_c2c(models, record_scores):
    plain = _kv_payloads(models)
    closed = make_fuser(models["s"], models["r"], gate_init=-10.0, randomize=True)  # sharer <- receiver
    refined_closed = _co_c2c(models, closed)
    for q, p, ref in zip(QUERIES, plain, refined_closed):
        ids = pair_example(q, models["rt"], models["st"], MAX_PROMPT).sharer_prompt_ids
        ex = pair_example(q, models["st"], models["rt"], MAX_PROMPT)
        assert ex.receiver_prompt_ids + ex.continuation_ids[:1] == ids  # the same full prompt
        assert ref.body == p.body  # gate off: the sharer's plain prefill cache, byte for byte
        exact, got = prefill(models["s"], ids), decode_kv_cache(ref.body)
        for a, b in zip(got.layers, exact.layers):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                bound = y.abs().amax(dim=-1, keepdim=True) / 127 * 0.5 * (1 + 2**-9) + 1e-6
                assert x.shape == y.shape and bool(((x - y).abs() <= bound).all())

    refiner = make_fuser(models["s"], models["r"], gate_init=1.0, randomize=True, seed=3)
    refined = _co_c2c(models, refiner)
    for p, ref in zip(plain, refined):
        a, b = decode_kv_cache(p.body), decode_kv_cache(ref.body)
        assert [layer.keys.shape for layer in a.layers] == [layer.keys.shape for layer in b.layers]
        assert max(float((x.keys - y.keys).abs().max()) for x, y in zip(a.layers, b.layers)) > 1e-3

    # the receiver fuses the refined cache like a plain one
    fuser = make_fuser(models["r"], models["s"], gate_init=1.0, randomize=True, seed=5)
    kw = dict(max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW)
    out_plain = answer_queries(models["r"], models["rt"], QUERIES, **kw,
                               sharers=[{"fuser": fuser, "tok": models["st"], "payloads": plain}])
    out_closed = answer_queries(models["r"], models["rt"], QUERIES, **kw,
                                sharers=[{"fuser": fuser, "tok": models["st"], "payloads": refined_closed}])
    out_refined = answer_queries(models["r"], models["rt"], QUERIES, **kw,
                                 sharers=[{"fuser": fuser, "tok": models["st"], "payloads": refined}])
    assert [(r["pred"], r["text"]) for r in out_closed] == [(r["pred"], r["text"]) for r in out_plain]
    assert out_refined[0]["pred"] in range(4) and isinstance(out_refined[1]["text"], str)
    lp_plain, lp_closed, lp_refined = record_scores
    assert lp_closed == lp_plain
    assert max(abs(a - b) for a, b in zip(lp_refined, lp_plain)) > 1e-6


def test_t2t_hint_goes_into_the_prompt(models, monkeypatch):
    send, recv = sessions()
    frames, ms = share_answers(send, models["s"], models["st"], SHARE_V, QUERIES, MAX_PROMPT, MAX_NEW)
    assert len(frames) == len(ms) == 2
    payloads = open_payloads(recv, frames, QUERIES, "text", expect=SHARE_V)
    hints = {p.qid: p.body.decode() for p in payloads}
    eos = {models["st"].eos_token_id}
    for q in QUERIES:  # the hint is the sharer's own greedy answer
        ids, last = prompt_split(q, models["st"], MAX_PROMPT)
        want = answer_text(models["st"], greedy_decode(models["s"], prefill(models["s"], ids), last,
                                                       MAX_NEW, eos))
        assert hints[q.qid] == want

    prefilled = []
    real = peer.prefill
    monkeypatch.setattr(peer, "prefill", lambda model, ids: prefilled.append(list(ids)) or real(model, ids))
    kw = dict(max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW)
    alone = answer_queries(models["r"], models["rt"], QUERIES, **kw)
    hinted = answer_queries(models["r"], models["rt"], QUERIES, hints=hints, **kw)
    assert len(prefilled) == 4
    for k, q in enumerate(QUERIES):
        plain_ids = prompt_split(q, models["rt"], MAX_PROMPT)[0]
        hint_ids = prompt_split(t2t_hint(q, hints[q.qid]), models["rt"], MAX_PROMPT)[0]
        assert prefilled[k] == plain_ids
        assert prefilled[2 + k] == hint_ids and len(hint_ids) > len(plain_ids)
        assert HINT_HEADER in models["rt"].decode(prefilled[2 + k])
    # the hinted MMLU answer is the one of the hinted query, scored directly
    asked = t2t_hint(MMLU, hints[MMLU.qid])
    monkeypatch.setattr(peer, "prefill", real)
    direct = answer_queries(models["r"], models["rt"], [asked], **kw)
    assert hinted[0]["pred"] == direct[0]["pred"] and alone[0]["pred"] in range(4)


# ---------------------------------------------------------------- controls and response NLL

DOLLY2 = Query(qid="dolly/2", kind="dolly", instruction="Name a fruit that is yellow.", context="",
               choices=None, answer=None, reference="A banana is yellow.", category="open_qa")
GSM = Query(qid="gsm8k/test/0", kind="gsm8k", instruction="What is 2 + 3?\nEnd with #### <number>",
            context="", choices=None, answer=None, reference="2 + 3 = 5\n#### 5", category="gsm8k")
NLL_QUERIES = [MMLU, DOLLY, DOLLY2, GSM]


def test_shuffled_partners_is_a_deterministic_derangement():
    for n in range(2, 40):
        p = peer.shuffled_partners(n)
        assert sorted(p) == list(range(n))  # a permutation of the chunk
        assert all(p[k] != k for k in range(n))  # never a query's own cache
        assert p == peer.shuffled_partners(n) == [(k + 1) % n for k in range(n)]
    for n in (0, 1):
        with pytest.raises(PeerPayloadError, match="at least 2 queries"):
            peer.shuffled_partners(n)


def test_response_nll_equals_the_cross_entropy_computed_directly(models):
    """Alone: the NLL answer_queries reports is the CE of the reference tokens from one plain
    forward pass over prompt + response (no cache), computed here by hand."""
    rows = answer_queries(models["r"], models["rt"], NLL_QUERIES, max_prompt_tokens=MAX_PROMPT,
                          max_new_tokens=MAX_NEW, nll_max_tokens=1000)
    assert rows[0]["nll"] is None and rows[0]["nll_tokens"] == 0  # MMLU: no reference
    assert rows[3]["text"] is None and rows[3]["pred"] is None  # GSM8K: scored by NLL only
    for q, row in zip(NLL_QUERIES[1:], rows[1:]):
        ids, last = prompt_split(q, models["rt"], MAX_PROMPT)
        resp = models["rt"](q.reference.strip() + models["rt"].eos_token, add_special_tokens=False)["input_ids"]
        full = torch.tensor([ids + [last] + resp])
        logp = torch.log_softmax(models["r"](full).logits[0].float(), dim=-1)
        start = len(ids)  # position of the last prompt token predicts resp[0]
        want = -sum(float(logp[start + i, t]) for i, t in enumerate(resp)) / len(resp)
        assert row["nll_tokens"] == len(resp) > 2
        assert row["nll"] == pytest.approx(want, rel=1e-4)
    cut = answer_queries(models["r"], models["rt"], [DOLLY], max_prompt_tokens=MAX_PROMPT,
                         max_new_tokens=MAX_NEW, nll_max_tokens=2)
    assert cut[0]["nll_tokens"] == 2
    off = answer_queries(models["r"], models["rt"], [DOLLY], max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW)
    assert off[0]["nll"] is None and off[0]["text"] == rows[1]["text"]  # NLL off: the answer is unchanged


def test_fused_response_nll_is_the_fusers_training_loss(models):
    """With a fuser: response_nll on the fused prompt cache equals train.pair_loss of the same
    row as a training example (float sharer cache on both sides)."""
    from edgefuse.c2c.examples import build_pair_example
    from edgefuse.c2c.train import pair_loss

    fuser = make_fuser(models["r"], models["s"], gate_init=1.0, randomize=True, seed=7)
    for q in (DOLLY, DOLLY2):
        row = {"instruction": q.instruction, "context": q.context, "response": q.reference}
        ex = build_pair_example(row, models["rt"], models["st"], 1000)
        qex = pair_example(q, models["rt"], models["st"], MAX_PROMPT)
        assert (qex.receiver_prompt_ids, qex.mapping) == (ex.receiver_prompt_ids, ex.mapping)
        resp = peer.response_ids(q, models["rt"], 1000)
        assert [qex.continuation_ids[0]] + resp == ex.continuation_ids
        fused = fuser(prefill(models["r"], ex.receiver_prompt_ids), prefill(models["s"], ex.sharer_prompt_ids),
                      ex.mapping)
        got, n = peer.response_nll(models["r"], fused, ex.continuation_ids[0], resp)
        want, m = pair_loss(fuser, models["r"], models["s"], ex)
        assert n == m == len(resp) and got == pytest.approx(float(want), rel=1e-5)
        alone, _ = peer.response_nll(models["r"], prefill(models["r"], ex.receiver_prompt_ids),
                                     ex.continuation_ids[0], resp)
        assert abs(alone - got) > 1e-3  # the open fuser changes the loss


def test_zero_and_shuffled_controls_feed_what_they_say(models):
    """The same fuser fed the received cache, zeros of its shapes, or the next query's cache:
    three different NLLs, each equal to fusing that input by hand."""
    queries = [DOLLY, DOLLY2, GSM]
    payloads = _kv_payloads(models, queries)
    fuser = make_fuser(models["r"], models["s"], gate_init=1.0, randomize=True, seed=11)
    with torch.no_grad():  # a strong fuser: the sharer input moves the loss well past float noise
        for layer in fuser.layers.values():
            for branch in (layer.key, layer.value):
                branch.up.weight.mul_(20.0)
    kw = dict(max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, nll_max_tokens=1000)
    got = {c: answer_queries(models["r"], models["rt"], queries, **kw,
                             sharers=[{"fuser": fuser, "tok": models["st"], "payloads": payloads, "control": c}])
           for c in ("none", "zero", "shuffled")}
    partners, lengths = peer.shuffled_partners(len(queries)), set()
    for k, q in enumerate(queries):
        ex = pair_example(q, models["rt"], models["st"], MAX_PROMPT)
        cache = prefill(models["r"], ex.receiver_prompt_ids)
        own, other = decode_kv_cache(payloads[k].body), decode_kv_cache(payloads[partners[k]].body)
        zero = decode_kv_cache(payloads[k].body)
        for layer in zero.layers:
            layer.keys, layer.values = torch.zeros_like(layer.keys), torch.zeros_like(layer.values)
        ts, tp = own.get_seq_length(), other.get_seq_length()
        lengths.add(ts)
        inputs = {"none": (own, ex.mapping), "zero": (zero, ex.mapping),
                  "shuffled": (other, [sorted({j * tp // ts for j in m}) for m in ex.mapping])}
        resp = peer.response_ids(q, models["rt"], 1000)
        for control, (s_cache, mapping) in inputs.items():
            want, _ = peer.response_nll(models["r"], fuser(cache, s_cache, mapping), ex.continuation_ids[0], resp)
            assert got[control][k]["nll"] == pytest.approx(want, abs=1e-6), (q.qid, control)
        values = [got[c][k]["nll"] for c in ("none", "zero", "shuffled")]
        assert min(abs(a - b) for a, b in ((values[0], values[1]), (values[0], values[2]), (values[1], values[2]))) > 1e-3
    assert len(lengths) == len(queries)  # the prompts differ in length: the mapping is rescaled
    with pytest.raises(PeerPayloadError, match="at least 2 queries"):
        answer_queries(models["r"], models["rt"], queries[:1], **kw,
                       sharers=[{"fuser": fuser, "tok": models["st"], "payloads": payloads[:1], "control": "shuffled"}])
