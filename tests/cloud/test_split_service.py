"""Split inference through the real cloud service on a socket (edgefuse.cloud.service +
edgefuse.cloud.split_target) with a tiny random-weight 4-layer Qwen2: the device's own
front/back (edgefuse.cloud.split.DeviceSplit) around the cloud's middle equals the unsplit
model; every refusal of the split rules (policy, misplaced messages, sync, counts before
decoding, exact lengths, non-finite values), the cache authorization over middle rows
(flag_cache off, a sliding l_cache window, AUTH revoke), tampered / replayed MID frames,
batching two sessions in one middle forward, the split head, the split frame cap and the
counters."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from edgefuse.cloud import protocol as P
from edgefuse.cloud import split as S
from edgefuse.cloud import vocab as V
from edgefuse.cloud import wire
from edgefuse.cloud.link import CloudLink
from edgefuse.cloud.service import CloudService
from edgefuse.cloud.split_target import SplitPolicy, SplitTarget
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.models import tiny_tokenizer
from edgefuse.transport.crypto import FRAME_OVERHEAD
from tests.cloud.conftest import RawClient, device_keys, service_keys, target_greedy, wait_for

NAME = "tiny-qwen2-4"
CTX = 256
D = 64
PROMPT = [5, 17, 33, 60, 91, 7, 250]
SPEC = P.SplitRequest(1, 1, None, "float16")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer, fingerprint): a 4-layer Qwen2 (so k = 1, m = 1 leaves a middle of
    two layers, whose second layer's KV carries the first's attention)."""
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(num_hidden_layers=4, vocab_size=len(tok), hidden_size=D,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    return model, tok, tokenizer_fingerprint(tok)


@pytest.fixture
def make_service(tiny):
    """Factory: a started service whose split runner (``runner``, a :class:`SplitTarget`
    class) follows ``policy`` (``split=False``: no split runner at all)."""
    model, tok, _ = tiny
    started = []

    def make(policy: SplitPolicy | None = None, split: bool = True, runner=SplitTarget,
             **kw) -> CloudService:
        runner = (runner(model, tok, NAME, policy, max_context=CTX, max_batch_tokens=512)
                  if split else None)
        svc = CloudService(Target(model, tok, NAME, max_context=CTX), "127.0.0.1", 0,
                           split=runner, **{**service_keys(), **kw})
        svc.start_in_thread()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


class SplitDevice:
    """The device end of one split session over a real link: its front/back/head, and the
    same :class:`P.SplitLedger` arithmetic as the cloud to know what to re-send."""

    def __init__(self, link, model, request: P.SplitRequest = SPEC, auth: P.CloudAuth | None = None):
        self.link, self.request = link, request
        self.spec = S.SplitSpec(request.k, request.m, request.head_split, request.act)
        self.dev = S.DeviceSplit(S.split_model(model, request.k, request.m), self.spec)
        self.auth = auth or P.CloudAuth()
        self.led = P.SplitLedger()
        self.req = 0
        self.sent_acts = 0

    def mid_msg(self, ids, resend: int | None = None) -> tuple[P.Mid, int]:
        """Run the front over ``ids`` and build the MID (``resend`` overrides ``c``)."""
        base = self.dev.length
        new = self.dev.front(ids)
        self.led.apply(self.auth)
        c = self.led.resend(self.auth, base) if resend is None else resend
        w0 = base - self.auth.window(base)
        rows = torch.cat([self.dev.front_rows(w0, w0 + c), new]) if c else new
        self.req += 1
        acts = S.encode_acts(rows, self.request.act)
        self.sent_acts += len(acts)
        return P.Mid(self.req, base, c, len(ids), acts, self.auth), base

    def mid(self, ids, resend: int | None = None) -> torch.Tensor:
        """One MID round trip; returns the middle's output rows ``[n, D]``."""
        msg, base = self.mid_msg(ids, resend)
        try:
            reply = self.link.request(msg, timeout_s=20)
        except P.RemoteError:
            self.dev.crop(base)
            raise
        return self.took(reply, base, len(ids))

    def took(self, reply, base: int, n: int) -> torch.Tensor:
        assert isinstance(reply, P.MidOut) and reply.n == n, reply
        self.led.commit(self.auth, base, n)
        return S.decode_acts(reply.acts, n, D, self.request.act)

    def authorize(self, auth: P.CloudAuth) -> int:
        """AUTH: the cloud evicts at once; the device's ledger mirrors it (same held)."""
        held = self.link.authorize(auth)
        self.led.apply(auth)
        assert held == self.led.held
        self.auth = auth
        return held

    def logits(self, h) -> torch.Tensor:
        return self.dev.logits(self.dev.back(h))


def middle_alone(model, rows: torch.Tensor, origin: int, k: int = 1, m: int = 1) -> torch.Tensor:
    """The middle layers over ``rows`` alone, a fresh cache at absolute position ``origin``."""
    middle = S.split_model(model, k, m).middle
    outs, _ = S.middle_forward(middle, [None], [0], [rows.float()], offsets=[origin])
    return outs[0].float()


def connect(svc) -> CloudLink:
    return CloudLink.connect("127.0.0.1", svc.port, **device_keys())


# --------------------------------------------------------------------------- equivalence

def test_split_decoding_equals_the_unsplit_model(make_service, tiny):
    model, _, fp = tiny
    svc = make_service()
    ref = target_greedy(model, PROMPT, 8)
    with connect(svc) as link:
        opened = link.open_split(SPEC, fp)
        assert opened == P.Opened(NAME, fp, CTX, SPEC)
        dev = SplitDevice(link, model)
        z = dev.logits(dev.mid(PROMPT))
        with torch.no_grad():
            full = model(torch.tensor([PROMPT])).logits[0]
        assert torch.allclose(z, full, atol=2e-2), (z - full).abs().max()
        tokens = []
        for _ in range(8):
            tokens.append(int(z[-1].argmax()))
            z = dev.logits(dev.mid([tokens[-1]]))
        assert tokens == ref
    st = svc.stats()
    assert st["split_sessions_total"] == 1 and st["split_jobs"] == 9 == st["split_batches"]
    assert st["split_bytes_in"] == dev.sent_acts == S.acts_nbytes(len(PROMPT) + 8, D, "float16")
    assert st["split_bytes_out"] == dev.sent_acts  # float16 out, one row per row in
    assert st["split_rebuild_rows"] == 0  # everything held: no window re-fed


# ----------------------------------------------------------------------------- refusals

def test_split_open_refusals(make_service, tiny):
    _, _, fp = tiny
    svc = make_service(SplitPolicy(allowed=((1, 1),), head_split=False))
    with connect(svc) as link:
        for req, what in ((P.SplitRequest(1, 2), "does not serve the split k=1, m=2"),
                          (P.SplitRequest(2, 2), "at least one"),  # no middle layer left
                          (P.SplitRequest(1, 1, 16, "int8", "full"), "split head"),
                          (P.SplitRequest(1, 1, None, "int8", "ascii"), "mask without")):
            with pytest.raises(P.RemoteError, match=what) as err:
                link.open_split(req, fp)
            assert err.value.code == "split"
        with pytest.raises(P.RemoteError) as err:
            link.open_split(SPEC, "0" * 16)
        assert err.value.code == "fingerprint"
        assert link.open_split(SPEC, fp).split == SPEC  # the link is still usable
    assert svc.stats()["split_refusals"] == 4
    # a split OPEN carrying prompt ids (crafted: the encoder refuses to build one)
    raw = RawClient(svc.port)
    good = P.encode(P.Open([], fp, split=SPEC))
    raw.send(good + struct.pack(">ii", 5, 6))
    reply = raw.recv()
    assert isinstance(reply, P.Error) and reply.code == "protocol" and "no prompt ids" in reply.message
    raw.send(good)
    assert isinstance(raw.recv(), P.Opened)
    raw.close()
    # a service without a split runner
    plain = make_service(split=False)
    with connect(plain) as link:
        with pytest.raises(P.RemoteError) as err:
            link.open_split(SPEC, fp)
        assert err.value.code == "split"


def test_misplaced_messages_are_refused(make_service, tiny):
    model, _, fp = tiny
    svc = make_service()
    with connect(svc) as link:  # a plain session: no MID / HEAD / MASK
        link.open(PROMPT, fp, max_new=16)
        for msg in (P.Mid(1, len(PROMPT), 0, 1, bytes(2 * D)), P.Head(2, 1, 0, b""),
                    P.Mask(b"\x01")):
            with pytest.raises(P.RemoteError, match="in a plain session") as err:
                link.request(msg, timeout_s=10)
            assert err.value.code == "protocol"
        assert link.request(P.Verify(3, len(PROMPT), []), timeout_s=10).req == 3
    with connect(svc) as link:  # a split session: no VERIFY / FUSE
        link.open_split(SPEC, fp)
        dev = SplitDevice(link, model)
        dev.mid(PROMPT)
        for msg in (P.Verify(1, len(PROMPT), []), P.Fuse(2, len(PROMPT), [], 4)):
            with pytest.raises(P.RemoteError, match="in a split session") as err:
                link.request(msg, timeout_s=10)
            assert err.value.code == "protocol"
        with pytest.raises(P.RemoteError, match="without a split head"):
            link.request(P.Head(3, 1, 0, bytes(2 * 10)), timeout_s=10)
        dev.mid([3])  # the session goes on
    assert svc.stats()["protocol_errors"] == 5  # the 5 misplaced ones, refused on arrival


def test_mid_checks_sync_counts_lengths_and_values(make_service, tiny):
    model, _, fp = tiny
    svc = make_service()
    with connect(svc) as link:
        link.open_split(P.SplitRequest(1, 1, None, "int8"), fp)
        dev = SplitDevice(link, model, P.SplitRequest(1, 1, None, "int8"))
        dev.mid(PROMPT[:4])  # committed 0, 4 pending
        base = 4

        def refused(msg, code, match=""):
            with pytest.raises(P.RemoteError, match=match) as err:
                link.request(msg, timeout_s=10)
            assert err.value.code == code, err.value

        row = S.acts_nbytes(1, D, "int8")
        # base_len outside committed .. committed + pending (0..4): rolled back too far / ahead
        refused(P.Mid(10, base + 1, 0, 1, bytes(row)), "sync", "outside 0..4")
        # counts bounded before the acts are looked at (the body is 3 bytes)
        refused(P.Mid(11, base, 0, CTX + 1, b"abc"), "context")
        refused(P.Mid(12, base, 0xFFFFFFFF, 0xFFFFFFFF, b"abc"), "context")
        refused(P.Mid(13, base, 0, 0, b""), "protocol", "at least one")
        refused(P.Mid(14, base, 3, 1, bytes(4 * row)), "protocol", "exceed the authorized window")
        # the acts' length must be exact
        refused(P.Mid(15, base, 0, 2, bytes(2 * row - 1)), "protocol", "bytes")
        refused(P.Mid(16, base, 0, 2, bytes(2 * row + 1)), "protocol", "bytes")
        # a NaN scale (int8) and a NaN value (float16 session below) are refused
        nan_scale = np.array([np.nan], "<f2").tobytes() + bytes(D)
        refused(P.Mid(17, base, 0, 1, nan_scale), "protocol", "do not decode")
        h = dev.mid([8])  # nothing above changed the session
        assert h.shape == (1, D) and dev.led.committed == base
    with connect(svc) as link:
        link.open_split(SPEC, fp)
        bad = np.zeros((1, D), "<f2")
        bad[0, 5] = np.inf
        with pytest.raises(P.RemoteError, match="do not decode") as err:
            link.request(P.Mid(1, 0, 0, 1, bad.tobytes()), timeout_s=10)
        assert err.value.code == "protocol"


def test_base_len_rolls_back_drafted_rows(make_service, tiny):
    """A block of 4 drafted rows, 2 accepted: the next MID's base_len rolls the other two
    back at the cloud, and its output equals a session that never saw them."""
    model, _, fp = tiny
    svc = make_service()
    with connect(svc) as link:
        link.open_split(SPEC, fp)
        dev = SplitDevice(link, model)
        dev.mid(PROMPT)
        dev.mid([40, 41, 42, 43])  # drafted rows at 7..10
        dev.dev.crop(len(PROMPT) + 2)  # the device accepted two
        got = dev.mid([99])
    with connect(svc) as link:
        link.open_split(SPEC, fp)
        ref_dev = SplitDevice(link, model)
        ref_dev.mid(PROMPT + [40, 41])
        want = ref_dev.mid([99])
    assert torch.allclose(got, want, atol=1e-3)
    rows = dev.dev.front_rows(0, dev.dev.length)
    assert torch.allclose(got, middle_alone(model, rows, 0)[-1:], atol=1e-3)


# --------------------------------------------------------------------- authorization

def test_flag_cache_off_keeps_nothing_and_requires_the_window(make_service, tiny):
    model, _, fp = tiny
    svc = make_service()
    off = P.CloudAuth(False, None)
    with connect(svc) as link:
        link.open_split(SPEC, fp, auth=off)
        dev = SplitDevice(link, model, auth=off)
        dev.mid(PROMPT)
        split_target = svc.split
        sess = next(iter(svc._live)).target
        assert sess.rows.shape[0] == 0 and sess.kv is None  # nothing kept after the reply
        with pytest.raises(P.RemoteError) as err:  # the window not re-sent
            dev.mid([3], resend=0)
        assert err.value.code == "evicted"
        with pytest.raises(P.RemoteError) as err:
            dev.mid([3], resend=len(PROMPT) - 1)  # one row short
        assert err.value.code == "evicted"
        got = dev.mid([3])  # the whole window re-sent
        rows = dev.dev.front_rows(0, dev.dev.length)
        assert torch.allclose(got, middle_alone(model, rows, 0)[-1:], atol=1e-3)
        assert split_target.rebuild_rows == len(PROMPT)


def test_too_many_resent_rows_are_refused(make_service, tiny):
    model, _, fp = tiny
    svc = make_service()
    with connect(svc) as link:
        link.open_split(SPEC, fp)
        dev = SplitDevice(link, model)
        dev.mid(PROMPT)
        with pytest.raises(P.RemoteError, match="exceed the authorized window") as err:
            dev.mid([3], resend=2)  # the cloud holds all 7: nothing may be re-sent
        assert err.value.code == "protocol"
        dev.mid([3])


def test_sliding_window_evicts_and_requires_the_resend(make_service, tiny):
    """l_cache = 4: every MID's middle attends to the last 4 committed rows only (at their
    absolute positions); an AUTH that shrinks the window drops the middle KV, and a MID that
    does not re-send what the cloud no longer holds is ERROR evicted."""
    model, _, fp = tiny
    svc = make_service()
    win = P.CloudAuth(True, 4)
    with connect(svc) as link:
        link.open_split(SPEC, fp, auth=win)
        dev = SplitDevice(link, model, auth=win)
        dev.mid(PROMPT)
        for t in (3, 4, 5):
            B = dev.dev.length
            got = dev.mid([t])
            rows = dev.dev.front_rows(B - 4, B + 1)
            assert torch.allclose(got, middle_alone(model, rows, B - 4)[-1:], atol=1e-3)
        assert svc.split.rebuild_rows >= 3 * 4  # the window slid each time: KV re-fed
        sess = next(iter(svc._live)).target
        assert sess.held == 4 and sess.rows.shape[0] == 5  # 4 committed + 1 pending
        # shrink to 2: held at once, the middle KV dropped
        assert dev.authorize(P.CloudAuth(True, 2)) == 2
        assert sess.kv is None and sess.rows.shape[0] == 3
        # grow back to 4 without re-sending the 2 rows the cloud no longer has
        dev.auth = win
        with pytest.raises(P.RemoteError) as err:
            dev.mid([6], resend=0)
        assert err.value.code == "evicted"
        B = dev.dev.length
        got = dev.mid([6])  # the ledger says: re-send 1 (2 held + the pending row = 3 of 4)
        rows = dev.dev.front_rows(B - 4, B + 1)
        assert torch.allclose(got, middle_alone(model, rows, B - 4)[-1:], atol=1e-3)


def test_auth_revoke_evicts_the_middle_cache_at_once(make_service, tiny):
    model, _, fp = tiny
    svc = make_service()
    with connect(svc) as link:
        link.open_split(SPEC, fp)
        dev = SplitDevice(link, model)
        dev.mid(PROMPT)
        sess = next(iter(svc._live)).target
        assert sess.rows.shape[0] == len(PROMPT) and sess.kv is not None
        assert dev.authorize(P.REVOKE) == 0
        assert sess.rows.shape[0] == 0 and sess.kv is None and sess.ledger.pending_held == 0
        with pytest.raises(P.RemoteError, match="authorizes no rows") as err:
            dev.mid([3])
        assert err.value.code == "protocol"
        dev.auth = P.CloudAuth()
        with pytest.raises(P.RemoteError) as err:
            dev.mid([3], resend=0)
        assert err.value.code == "evicted"
        got = dev.mid([3])
        rows = dev.dev.front_rows(0, dev.dev.length)
        assert torch.allclose(got, middle_alone(model, rows, 0)[-1:], atol=1e-3)


# ------------------------------------------------------------------- channel attacks

def test_tampered_and_replayed_mid_frames_are_refused(make_service, tiny):
    model, _, fp = tiny
    svc = make_service()
    parts = S.split_model(model, 1, 1)
    dev = S.DeviceSplit(parts, S.SplitSpec(1, 1, None, "float16"))
    raw = RawClient(svc.port)
    raw.send(P.Open([], fp, split=SPEC))
    assert isinstance(raw.recv(), P.Opened)
    x = dev.front(PROMPT)
    mid = raw.seal(P.Mid(1, 0, 0, len(PROMPT), S.encode_acts(x, "float16")))
    tampered = bytearray(mid)
    tampered[40] ^= 0x10  # one activation bit flipped in flight
    raw.send_frame(bytes(tampered))
    raw.send_frame(mid)
    first = raw.recv()
    assert isinstance(first, P.MidOut) and first.req == 1  # the genuine one, nothing else
    raw.send_frame(mid)  # replayed
    y = dev.front([9])
    raw.send(P.Mid(2, len(PROMPT), 0, 1, S.encode_acts(y, "float16")))
    second = raw.recv()
    assert isinstance(second, P.MidOut) and second.req == 2  # in sync: the replay did nothing
    rows = dev.front_rows(0, dev.length)
    assert torch.allclose(S.decode_acts(second.acts, 1, D, "float16"),
                          middle_alone(model, rows, 0)[-1:], atol=1e-3)
    st = svc.stats()
    assert st["frames_rejected"] == 2 and st["split_jobs"] == 2
    raw.close()


# ----------------------------------------------------------------------------- batching

def test_two_sessions_batched_equal_each_alone(make_service, tiny):
    model, _, fp = tiny
    svc = make_service(max_wait_ms=3000.0)
    prompts = [PROMPT, [300, 301, 302]]
    outs = {}
    for variant in (0, 1):  # variant 1 changes the second session's rows only
        links = [connect(svc) for _ in prompts]
        try:
            devs = []
            for link in links:
                link.open_split(SPEC, fp)
                devs.append(SplitDevice(link, model))
            ps = [prompts[0], [p + 7 * variant for p in prompts[1]]]
            msgs = [d.mid_msg(p) for d, p in zip(devs, ps)]
            for link, (msg, _) in zip(links, msgs):
                link.send(msg)
            got = [d.took(link.recv(timeout_s=20), base, len(p))
                   for d, link, (_, base), p in zip(devs, links, msgs, ps)]
            for d, g, p in zip(devs, got, ps):
                alone = middle_alone(model, d.dev.front_rows(0, len(p)), 0)
                assert torch.allclose(g, alone, atol=1e-3), (g - alone).abs().max()
            outs[variant] = got
        finally:
            for link in links:
                link.close()
    st = svc.stats()
    assert st["batch_sizes"] == {"2": 2} and st["split_batches"] == 2
    # the first session's rows never saw the second's: its output is the same bit for bit
    assert torch.equal(outs[0][0], outs[1][0])
    assert not torch.equal(outs[0][1], outs[1][1])


class SlowSplitTarget(SplitTarget):
    """The real split runner with a delay before each step (to queue jobs behind one)."""

    delay_s = 0.0

    def step(self, jobs):
        time.sleep(self.delay_s)
        return super().step(jobs)


def test_mid_and_verify_never_share_a_forward(make_service, tiny):
    """A VERIFY and a MID of two sessions queued behind a slow MID: the next batch takes the
    VERIFY alone, the MID runs in its own; both are answered right."""
    model, _, fp = tiny
    svc = make_service(max_wait_ms=0.0, runner=SlowSplitTarget)
    with connect(svc) as plain, connect(svc) as s1, connect(svc) as s2:
        plain.open(PROMPT, fp, max_new=16)
        devs = []
        for link in (s1, s2):
            link.open_split(SPEC, fp)
            devs.append(SplitDevice(link, model))
        first, base1 = devs[0].mid_msg(PROMPT)
        second, base2 = devs[1].mid_msg(PROMPT[:3])
        svc.split.delay_s = 0.5
        s1.send(first)  # occupies the worker for 0.5 s
        time.sleep(0.1)
        plain.send(P.Verify(1, len(PROMPT), []))
        time.sleep(0.05)
        s2.send(second)
        devs[0].took(s1.recv(timeout_s=20), base1, len(PROMPT))
        assert isinstance(plain.recv(timeout_s=20), P.Verified)
        h = devs[1].took(s2.recv(timeout_s=20), base2, 3)
        assert torch.allclose(h, middle_alone(model, devs[1].dev.front_rows(0, 3), 0), atol=1e-3)
    st = svc.stats()
    assert st["max_batch_size"] == 1 and st["split_batches"] == 2 and st["batches"] == 3
    assert svc.split.jobs == 2 and svc.target.jobs == 1


# --------------------------------------------------------------------------- split head

def test_split_head_logits_and_explicit_mask(make_service, tiny):
    model, tok, fp = tiny
    svc = make_service()
    s = 40
    with torch.no_grad():
        full = model(torch.tensor([PROMPT])).logits[0]
    # a named mask: the whole vocabulary, top-k 0 (every partial logit, 8-bit)
    req = P.SplitRequest(1, 1, s, "float16", "full")
    with connect(svc) as link:
        link.open_split(req, fp)
        dev = SplitDevice(link, model, req)
        hidden = dev.dev.back(dev.mid(PROMPT))
        z_end, tail = dev.dev.head_part(hidden)
        with pytest.raises(P.RemoteError, match="exceeds the mask") as err:
            link.request(P.Head(50, 1, len(tok) + 1, S.encode_acts(tail[:1], "float16")), timeout_s=10)
        assert err.value.code == "protocol"
        extra = torch.cat([tail, tail[:1]])  # one row more than the last MID's, well formed
        with pytest.raises(P.RemoteError, match="the last MID had 7") as err:
            link.request(P.Head(51, len(PROMPT) + 1, 0, S.encode_acts(extra, "float16")), timeout_s=10)
        assert err.value.code == "protocol"
        with pytest.raises(P.RemoteError, match="bytes"):
            link.request(P.Head(52, 2, 0, S.encode_acts(tail[:2], "float16")[:-1]), timeout_s=10)
        rep = link.request(P.Head(53, len(PROMPT), 0, S.encode_acts(tail, "float16")), timeout_s=10)
        assert isinstance(rep, P.Logits) and rep.req == 53
        mask = V.vocab_mask(tok, "full", vocab_size=len(tok))
        z = V.decode_masked(rep.payload, len(PROMPT), len(mask), 0)
        fused = z_end + torch.from_numpy(z.values)
        assert torch.allclose(fused, full, atol=float(z.scale.max()) / 2 + 2e-2)
    # an explicit mask: HEAD before MASK refused, a bad bitmap refused, then top-k within it
    req = P.SplitRequest(1, 1, s, "float16", "explicit")
    with connect(svc) as link:
        link.open_split(req, fp)
        dev = SplitDevice(link, model, req)
        _, tail = dev.dev.head_part(dev.dev.back(dev.mid(PROMPT)))
        with pytest.raises(P.RemoteError, match="before the session's explicit MASK"):
            link.request(P.Head(1, 1, 0, S.encode_acts(tail[-1:], "float16")), timeout_s=10)
        ids = [3, 10, 17, 60, 61]
        bitmap = V.mask_to_bitmap(ids, len(tok))
        for bad in (bitmap[:-1], bitmap + b"\x00", bytes(len(bitmap))):
            with pytest.raises(P.RemoteError, match="bad MASK") as err:
                link.request(P.Mask(bad), timeout_s=10)
            assert err.value.code == "protocol"
        masked = link.request(P.Mask(bitmap), timeout_s=10)
        mask = V.vocab_mask(tok, V.EXPLICIT, vocab_size=len(tok), ids=ids)
        assert masked == P.Masked(len(mask))
        rep = link.request(P.Head(2, 1, 3, S.encode_acts(tail[-1:], "float16")), timeout_s=10)
        z = V.decode_masked(rep.payload, 1, len(mask), 3)
        want = S.partial_logits(S.head_tail(model.lm_head.weight, s), tail[-1:].float(), ids=mask)
        top = torch.topk(want[0], 3)
        assert sorted(mask[z.idx[0]].tolist()) == sorted(mask[top.indices.numpy()].tolist())
        assert np.allclose(z.values[0], top.values.numpy(), atol=float(z.scale[0]) / 2 + 1e-3)
    st = svc.stats()
    assert st["split_head_jobs"] == 2 and st["split_mask_jobs"] == 1


# ------------------------------------------------------------------------- frame limit

def test_split_sessions_get_a_frame_cap_from_their_bounds(make_service, tiny):
    model, _, fp = tiny
    svc = make_service(max_frame_bytes=4096)
    cap = svc.split.frame_limit(SPEC)
    assert cap == FRAME_OVERHEAD + P.MID_HEADER_BYTES + S.acts_nbytes(CTX, D, "float16")
    rows = 100  # 12,800 bytes of float16 acts: over the plain cap, under the split one
    with connect(svc) as link:
        link.open_split(SPEC, fp)
        dev = SplitDevice(link, model)
        h = dev.mid(list(range(3, 3 + rows)))
        assert h.shape == (rows, D)
    # a plain session announcing the same frame is closed before it is read
    with connect(svc) as link:
        link.open(PROMPT, fp, max_new=16)
        link.send(P.Mid(1, len(PROMPT), 0, rows, bytes(rows * 2 * D)))
        wait_for(lambda: not link.alive, what="oversized frame closed the connection")
    # and a split session announcing more than its own cap, too
    raw = RawClient(svc.port)
    raw.send(P.Open([], fp, split=SPEC))
    assert isinstance(raw.recv(), P.Opened)
    raw.sock.sendall((cap + 1).to_bytes(4, "big"))
    with pytest.raises(wire.PeerClosed):
        wire.recv_message(raw.sock)
    raw.close()
    assert svc.stats()["frames_oversized"] == 2


# ---------------------------------------------------------------------------- policy

def test_split_policy_from_config():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"allowed": [{"k": 2, "m": 2}, {"k": 1, "m": 0}], "head_split": False,
                             "acts": ["int8"]})
    pol = SplitPolicy.from_config(node)
    assert pol == SplitPolicy(((2, 2), (1, 0)), False, ("int8",))
    assert pol.permits(2, 2) and not pol.permits(2, 1)
    assert SplitPolicy.from_config(pol.to_config()) == pol
    assert SplitPolicy.from_config({}).permits(5, 3)  # "any" by default
    for bad, match in (({"allowed": "some"}, "list of"), ({"allowed": [{"k": 1}]}, "entries"),
                       ({"allowed": [{"k": 0, "m": 1}]}, "k >= 1"), ({"head_split": "yes"}, "bool"),
                       ({"acts": ["int4"]}, "subset"), ({"acts": []}, "subset"),
                       # a misspelt restriction must not serve any split
                       ({"alowed": [{"k": 1, "m": 0}]}, "unknown key"), ([1], "must be a mapping")):
        with pytest.raises(ValueError, match=match):
            SplitPolicy.from_config(bad)
