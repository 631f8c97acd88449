"""The endpoint-authorized cloud cache (flagCache, LCache): the tuple on the wire, the
cloud's window / eviction / revocation semantics against fresh computations over exactly the
authorized context, the device's mirror (context re-sent when the cloud holds nothing), and
end-to-end decoding under a window (tiny random-weight qwen2 models)."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import edgefuse.cloud.protocol as P
from edgefuse.cloud import wire
from edgefuse.cloud.decoding import DecodeConfig, DecodeError, Decoder, EdgeLM, auth_from_config, decode_config
from edgefuse.cloud.link import CloudLink
from edgefuse.cloud.service import CloudService
from edgefuse.cloud.speculative import verify_greedy
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.models import tiny_model
from edgefuse.transport.crypto import derive_session, generate_keypair, new_session_id
from tests.cloud.conftest import DirectLink, RawClient, device_keys, service_keys

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 33, 60, 91, 7, 200, 11, 42]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def pair():
    draft, tok = tiny_model("qwen2", seed=0)
    target, _ = tiny_model("qwen2", seed=1)
    return draft, target, tok


@pytest.fixture
def T(pair):
    _, target, tok = pair
    return Target(target, tok, "tiny-target")


@torch.no_grad()
def next_logits(model, ctx: list[int], L: int | None) -> torch.Tensor:
    """The target restricted to a window: next-token logits after the last ``L`` ids of
    ``ctx``, computed fresh (positions from 0)."""
    ctx = ctx if L is None else ctx[-L:]
    return model(torch.tensor([ctx])).logits[0, -1].float()


def ref_verify(model, committed, draft, L):
    """(accepted, token) of greedy verification, each position with its own window."""
    argmax = [int(torch.argmax(next_logits(model, committed + draft[:i], L)))
              for i in range(len(draft) + 1)]
    return verify_greedy(argmax, draft)


def ref_greedy(model, prompt, n, L):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(torch.argmax(next_logits(model, seq, L))))
    return seq[len(prompt):]


def assert_topk_close(got: P.TopK, logits: torch.Tensor, k: int):
    logp = torch.log_softmax(logits.double(), -1)
    vals, ids = torch.topk(logp, k)
    assert got.ids.tolist() == ids.tolist()
    tol = 2 * got.scale + 1e-3 * abs(got.top) + 1e-3  # 8-bit steps below a float16 top
    np.testing.assert_allclose(got.logprobs(), vals.numpy(), atol=tol)


def assert_same(a: P.Message, b: P.Message):
    assert type(a) is type(b), (a, b)
    if isinstance(a, P.Verified):
        assert (a.accepted, a.token) == (b.accepted, b.token)
    elif isinstance(a, P.TopK):
        assert a.ids.tolist() == b.ids.tolist()
        np.testing.assert_allclose(a.logprobs(), b.logprobs(), atol=2 * max(a.scale, b.scale) + 1e-3)
    else:
        assert a.code == b.code


def check_held(sess, committed, auth):
    """The cloud holds exactly ``auth.held`` of the committed ids, never an id outside them."""
    held = auth.held(len(committed))
    assert sess.held == held and sess.evicted == len(committed) - held
    assert sess.tokens == (committed[len(committed) - held:] if held else [])
    assert sess.cached <= held
    if held == 0:
        assert sess.cache is None


# ------------------------------------------------------------------------------ wire

@pytest.mark.parametrize("msg", [
    P.Open([1, 2, 151935], "0123abcd", 0.7, 40, 3, 64, auth=P.CloudAuth(False, 5), offset=9),
    P.Open([], "ab", auth=P.REVOKE, offset=3),
    P.Verify(1, 12, [5, 6], auth=P.CloudAuth(True, 64), context=[7, 8, 9]),
    P.Verify(2, 3, [5, 6], np.array([[5, 1], [6, 2]]), np.array([[0.75, 0.25], [0.5, 0.5]]),
             auth=P.CloudAuth(False, None), context=[1, 2, 3]),
    P.Fuse(3, 20, [4, 5], 16, auth=P.CloudAuth(True, 0xFFFFFFFE), context=[151935]),
    P.Auth(P.CloudAuth(True, None)),
    P.Auth(P.REVOKE),
    P.Authed(0),
    P.Authed(4096),
])
def test_round_trip_of_the_tuple_and_auth(msg):
    got = P.decode(P.encode(msg))
    assert type(got) is type(msg)
    for k, v in vars(msg).items():
        np.testing.assert_array_equal(np.asarray(getattr(got, k)), np.asarray(v))


def test_tuple_layout():
    assert P.encode(P.Auth(P.CloudAuth(False, None))) == bytes([P.AUTH, 0, 0xFF, 0xFF, 0xFF, 0xFF])
    assert P.encode(P.Auth(P.CloudAuth(True, 300))) == bytes([P.AUTH, 1, 0, 0, 1, 44])
    assert P.encode(P.Authed(7)) == bytes([P.AUTHED, 0, 0, 0, 7])
    v = P.encode(P.Verify(1, 2, [], auth=P.CloudAuth(False, 3), context=[9]))
    assert v[9:14] == bytes([0, 0, 0, 0, 3]) and v[14:18] == b"\x00\x00\x00\x01"


def _open_json(**over) -> bytes:
    msg = P.encode(P.Open([1], "ab"))
    head = P._Reader(msg, "OPEN").json()
    head.update(over)
    return bytes([P.OPEN]) + P._json(head) + msg[-4:]


@pytest.mark.parametrize("data", [
    bytes([P.AUTH, 2, 0, 0, 0, 1]),                                    # flag byte not 0/1
    bytes([P.AUTH, 1, 0, 0]),                                          # truncated
    P.encode(P.Auth(P.REVOKE)) + b"x",                                 # trailing
    P.encode(P.Verify(1, 2, [3]))[:9] + b"\x07" + P.encode(P.Verify(1, 2, [3]))[10:],
    P.encode(P.Fuse(1, 2, [3], 4))[:-2],                               # truncated
    _open_json(flag_cache="yes"),
    _open_json(flag_cache=1),
    _open_json(l_cache=-1),
    _open_json(l_cache=P.L_UNLIMITED),
    _open_json(l_cache=2.5),
    _open_json(offset=-1),
    _open_json(l_cache=None, flag_cache=None),
])
def test_malformed_tuple_is_refused(data):
    with pytest.raises(P.ProtocolError):
        P.decode(data)


def test_cloud_auth_validates():
    for bad in [dict(flag_cache=1), dict(flag_cache=None), dict(l_cache=-1),
                dict(l_cache=P.L_UNLIMITED), dict(l_cache=True), dict(l_cache="8")]:
        with pytest.raises(P.ProtocolError):
            P.CloudAuth(**bad)
    a = P.CloudAuth(True, 4)
    assert (a.window(10), a.held(10), a.window(3)) == (4, 4, 3)
    assert (P.CloudAuth(False, 4).window(10), P.CloudAuth(False, 4).held(10)) == (4, 0)
    assert P.CloudAuth().window(10) == P.CloudAuth().held(10) == 10


def test_auth_from_config_and_decode_config():
    priv = OmegaConf.load(ROOT / "edgefuse/conf/privacy/default.yaml")
    assert auth_from_config(priv) == P.CloudAuth(True, None)
    priv.cloud_auth.flag_cache, priv.cloud_auth.l_cache = False, 64
    assert auth_from_config(priv) == P.CloudAuth(False, 64)
    assert auth_from_config(OmegaConf.create({"enabled": True})) == P.CloudAuth()
    priv.cloud_auth.l_cache = -3
    with pytest.raises(DecodeError, match="cloud_auth"):
        auth_from_config(priv)
    cloud = OmegaConf.load(ROOT / "edgefuse/conf/cloud/default.yaml")
    assert decode_config(cloud).auth == P.CloudAuth()
    assert decode_config(cloud, auth=P.CloudAuth(True, 8)).auth == P.CloudAuth(True, 8)
    with pytest.raises(DecodeError):
        DecodeConfig(auth=(True, 8))


# ----------------------------------------------------------------------------- target

L = 5


def _steps(committed):
    """A fixed script of requests on top of ``committed`` (greedy): drafts that the target
    partly accepts, plain γ = 0 steps and FUSEs with newly committed ids."""
    return [("verify", [committed[-1], 3, 4]), ("fuse", [8, 9]), ("verify", []),
            ("fuse", []), ("verify", [77, 78, 79, 80, 81, 82]), ("fuse", [1]), ("verify", [2])]


def _request(kind, arg, req, base, auth, context=()):
    if kind == "verify":
        return P.Verify(req, base, list(arg), auth=auth, context=list(context))
    return P.Fuse(req, base, list(arg), 32, auth=auth, context=list(context))


def _commit(committed, kind, arg, reply):
    if kind == "verify":
        committed += list(arg[:reply.accepted]) + [reply.token]
    else:
        committed += list(arg)


@pytest.mark.parametrize("auth", [P.CloudAuth(True, L), P.CloudAuth(False, L), P.CloudAuth(False, None)])
def test_window_equals_a_fresh_session_over_the_window(pair, T, auth):
    """After every step, the windowed session answers what (a) the target restricted to the
    window computes from scratch and (b) a session opened over just the last-L context gives;
    the cloud holds the authorized ids only (none at all without flag_cache)."""
    _, target, tok = pair
    committed = list(PROMPT)
    keep = auth.held(len(PROMPT))
    sess = T.open(P.Open(PROMPT[len(PROMPT) - keep:], T.fingerprint, auth=auth,
                         offset=len(PROMPT) - keep))
    check_held(sess, committed, auth)
    for i, (kind, arg) in enumerate(_steps(committed)):
        if kind == "verify" and arg and i == 0:
            arg = [int(torch.argmax(next_logits(target, committed, auth.l_cache)))] + arg[1:]
        base = len(committed)
        ctx = committed[base - auth.window(base):base - sess.held]
        (got,) = T.step([(sess, _request(kind, arg, i, base, auth, ctx))])
        # (a) the target restricted to the window, from scratch
        if kind == "verify":
            assert (got.accepted, got.token) == ref_verify(target, committed, list(arg), auth.l_cache)
        else:
            assert_topk_close(got, next_logits(target, committed + list(arg), auth.l_cache), 32)
        # (b) a fresh session opened over exactly the window, same tuple, flag on
        win = committed[base - auth.window(base):]
        fresh = T.open(P.Open(win, T.fingerprint, auth=P.CloudAuth(True, auth.l_cache)))
        (want,) = T.step([(fresh, _request(kind, arg, i, len(win), P.CloudAuth(True, auth.l_cache)))])
        assert_same(got, want)
        _commit(committed, kind, arg, got)
        check_held(sess, committed, auth)
    assert len(committed) > len(PROMPT) + L  # the window did slide
    assert T.reprefills > 0


def test_mixed_sessions_batch_like_alone(pair, T):
    """Sessions under different tuples in ONE step answer exactly as each alone."""
    auths = [P.CloudAuth(), P.CloudAuth(True, 4), P.CloudAuth(False, None), P.CloudAuth(False, 3),
             P.CloudAuth(True, 7)]
    prompts = [PROMPT, PROMPT[:6], PROMPT[2:], PROMPT, [40, 41, 42]]

    def run(batched: bool):
        sess = [T.open(P.Open(p, T.fingerprint, auth=a)) for p, a in zip(prompts, auths)]
        hist = [list(p) for p in prompts]
        out = []
        for step in range(4):
            jobs = []
            for s, (h, a) in enumerate(zip(hist, auths)):
                base = len(h)
                ctx = h[base - a.window(base):base - sess[s].held]
                kind = "verify" if (s + step) % 2 else "fuse"
                arg = [h[-1], h[-2], 9] if kind == "verify" else [h[-1]]
                jobs.append((sess[s], _request(kind, arg, step, base, a, ctx), kind, arg))
            if batched:
                replies = T.step([(s, r) for s, r, _, _ in jobs])
            else:
                replies = [T.step([(s, r)])[0] for s, r, _, _ in jobs]
            for (s, _, kind, arg), rep, h in zip(jobs, replies, hist):
                assert not isinstance(rep, P.Error), rep
                _commit(h, kind, arg, rep)
            out.append(replies)
        return out

    for a_step, b_step in zip(run(True), run(False)):
        for a, b in zip(a_step, b_step):
            assert_same(a, b)


def test_flag_off_holds_nothing_and_needs_the_context(pair, T):
    _, target, _ = pair
    auth = P.CloudAuth(False, None)
    sess = T.open(P.Open(PROMPT, T.fingerprint, auth=auth))
    assert sess.held == 0 and sess.cache is None and sess.evicted == len(PROMPT)
    (err,) = T.step([(sess, P.Verify(1, len(PROMPT), [], auth=auth))])
    assert isinstance(err, P.Error) and err.code == "evicted"
    (err,) = T.step([(sess, P.Verify(1, len(PROMPT), [], auth=auth, context=PROMPT[1:]))])
    assert err.code == "evicted"
    (err,) = T.step([(sess, P.Verify(1, len(PROMPT), [], auth=auth, context=[0] + PROMPT))])
    assert err.code == "protocol"  # more than the window: refused, never attended
    (got,) = T.step([(sess, P.Verify(1, len(PROMPT), [], auth=auth, context=PROMPT))])
    assert got.token == int(torch.argmax(next_logits(target, PROMPT, None)))
    assert sess.held == 0 and sess.cache is None and sess.committed == len(PROMPT) + 1
    # a window without the flag: exactly the last 3 ids must come along
    auth3 = P.CloudAuth(False, 3)
    c = PROMPT + [got.token]
    for ctx, code in [(c[-2:], "evicted"), (c[-4:], "protocol")]:
        (err,) = T.step([(sess, P.Fuse(2, len(c), [], 8, auth=auth3, context=ctx))])
        assert err.code == code
    (top,) = T.step([(sess, P.Fuse(2, len(c), [12], 8, auth=auth3, context=c[-3:]))])
    assert_topk_close(top, next_logits(target, c + [12], 3), 8)
    assert sess.held == 0 and sess.cache is None
    # an OPEN that sends nothing: the device keeps the prompt to itself
    s2 = T.open(P.Open([], T.fingerprint, auth=auth, offset=len(PROMPT)))
    assert s2.committed == len(PROMPT) and s2.held == 0
    with pytest.raises(Exception, match="empty prompt"):
        T.open(P.Open([], T.fingerprint))


def test_revocation_and_shrink_evict_at_once(pair, T):
    _, target, _ = pair
    sess = T.open(P.Open(PROMPT, T.fingerprint))
    committed = list(PROMPT)
    for i in range(2):
        (rep,) = T.step([(sess, P.Verify(i, len(committed), [3, 4]))])
        _commit(committed, "verify", [3, 4], rep)
    assert sess.held == len(committed) and sess.cache is not None
    assert T.authorize(sess, P.CloudAuth(True, 4)) == 4
    assert sess.tokens == committed[-4:] and sess.cache is None  # old KV dropped, not cropped
    (rep,) = T.step([(sess, P.Verify(9, len(committed), [], auth=P.CloudAuth(True, 4)))])
    assert rep.token == int(torch.argmax(next_logits(target, committed, 4)))
    committed.append(rep.token)
    assert T.authorize(sess, P.REVOKE) == 0
    assert sess.cache is None and sess.tokens == [] and sess.evicted == len(committed)
    # revoked: nothing can be scored; the default tuple needs what was evicted
    (err,) = T.step([(sess, P.Verify(10, len(committed), [], auth=P.REVOKE))])
    assert err.code == "protocol"
    (err,) = T.step([(sess, P.Verify(10, len(committed), []))])
    assert err.code == "evicted"
    (err,) = T.step([(sess, P.Verify(10, len(committed) - 1, [], auth=P.CloudAuth(False, 2),
                                     context=committed[-2:]))])
    assert err.code == "sync"
    # re-authorize by re-sending: the cloud decodes over exactly what it was given
    (rep,) = T.step([(sess, P.Verify(10, len(committed), [], auth=P.CloudAuth(True, 6),
                                     context=committed[-6:]))])
    assert rep.token == int(torch.argmax(next_logits(target, committed, 6)))
    committed.append(rep.token)
    check_held(sess, committed, P.CloudAuth(True, 6))


# ------------------------------------------------------------------ end-to-end decoding

def _edge(draft, tok):
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()
    return edge


@pytest.mark.parametrize("auth", [P.CloudAuth(True, 4), P.CloudAuth(False, 4), P.CloudAuth(False, None)])
def test_decoding_under_a_window_is_the_windowed_target(pair, auth):
    """cloud, greedy spec_sync / spec_async and fusion at edge weight 0 all give the target's
    greedy continuation under the window; the cloud never held more than allowed."""
    draft, target, tok = pair
    T = Target(target, tok, "t")
    want = ref_greedy(target, PROMPT, 12, auth.l_cache)
    from edgefuse.cloud.fusion import FusionConfig

    for mode, extra in [("cloud", {}), ("spec_sync", {}), ("spec_sync", {"gamma": 3}),
                        ("spec_async", {"gamma": 2}),
                        ("fusion_static", {"fusion": FusionConfig(weight=0.0)})]:
        link = DirectLink(T)
        cfg = DecodeConfig(max_new_tokens=12, auth=auth, **extra)
        res = Decoder(_edge(draft, tok), link, T.fingerprint).generate(mode, PROMPT, cfg)
        assert res.fallback is None, (mode, res.fallback)
        assert res.tokens == want, mode
        assert link.session.held <= auth.held(10**9)


@pytest.mark.parametrize("auth", [P.CloudAuth(True, 4), P.CloudAuth(False, 4)])
@pytest.mark.parametrize("mode", ["spec_sync", "spec_async"])
def test_sampled_decoding_under_a_window_runs(pair, auth, mode):
    draft, target, tok = pair
    T = Target(target, tok, "t")
    res = Decoder(_edge(draft, tok), DirectLink(T), T.fingerprint).generate(
        mode, PROMPT, DecodeConfig(max_new_tokens=10, temperature=1.0, seed=3, gamma=3, auth=auth))
    assert res.fallback is None and len(res.tokens) == 10 and res.drafted > 0


def test_flag_off_costs_uplink_bytes_only(pair):
    draft, target, tok = pair
    T = Target(target, tok, "t")
    res = {}
    for auth in (P.CloudAuth(), P.CloudAuth(False, None)):
        link = DirectLink(T)
        res[auth] = Decoder(_edge(draft, tok), link, T.fingerprint).generate(
            "cloud", PROMPT, DecodeConfig(max_new_tokens=6, auth=auth))
    keep, off = res[P.CloudAuth()], res[P.CloudAuth(False, None)]
    assert keep.tokens == off.tokens
    assert off.bytes_up > keep.bytes_up and off.bytes_down == keep.bytes_down


# ------------------------------------------------------------------------- the service

@pytest.fixture
def service(pair):
    _, target, tok = pair
    svc = CloudService(Target(target, tok, "tiny-target"), "127.0.0.1", 0, max_wait_ms=5,
                       **service_keys())
    svc.start_in_thread()
    yield svc
    svc.stop()


def test_service_auth_authed_and_windowed_decode(pair, service):
    draft, target, tok = pair
    fp = tokenizer_fingerprint(tok)
    with CloudLink.connect("127.0.0.1", service.port, **device_keys()) as link:
        with pytest.raises(P.RemoteError, match="protocol"):
            link.authorize(P.CloudAuth(True, 3), timeout_s=10)  # no session yet
        link.open(PROMPT, fp, timeout_s=10)
        (live,) = service._live
        assert live.target.held == len(PROMPT)
        assert link.authorize(P.CloudAuth(True, 3), timeout_s=10) == 3
        assert live.target.tokens == PROMPT[-3:] and live.target.cache is None  # before AUTHED
        assert link.authorize(P.REVOKE, timeout_s=10) == 0
        assert live.target.tokens == [] and live.target.cache is None
        with pytest.raises(P.RemoteError, match="evicted"):
            link.request(P.Verify(1, len(PROMPT), []), timeout_s=10)
        rep = link.request(P.Verify(2, len(PROMPT), [], auth=P.CloudAuth(False, 4),
                                    context=PROMPT[-4:]), timeout_s=10)
        assert rep.token == int(torch.argmax(next_logits(target, PROMPT, 4)))
        link.send(P.Close())
        # a decode under a window over the real service
        auth = P.CloudAuth(True, 4)
        res = Decoder(_edge(draft, tok), link, fp).generate(
            "spec_sync", PROMPT, DecodeConfig(max_new_tokens=10, auth=auth, gamma=3))
        assert res.fallback is None and res.tokens == ref_greedy(target, PROMPT, 10, 4)
    raw = RawClient(service.port)
    raw.send(P.encode(P.Open(PROMPT, fp)))
    assert isinstance(raw.recv(), P.Opened)
    raw.send(bytes([P.AUTH, 2, 0, 0, 0, 1]))  # flag byte out of range
    err = raw.recv()
    assert isinstance(err, P.Error) and err.code == "protocol" and "flag_cache" in err.message
    raw.send(P.encode(P.Auth(P.CloudAuth(True, 2))))
    assert raw.recv() == P.Authed(2)
    raw.sock.close()
