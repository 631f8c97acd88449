"""The cloud service (edgefuse.cloud.service), the device link (edgefuse.cloud.link) and the framing
(edgefuse.cloud.wire) over real sockets, with the real edgefuse.cloud.target.Target on the tiny random-weight
qwen2 model: handshake, greedy equivalence, rejected frames, batching with isolation,
session lifecycle, byte accounting through a counting relay, WAN emulation, the subprocess
helpers and the CLI."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest
import torch

from edgefuse.cloud import protocol as P
from edgefuse.cloud import wire
from edgefuse.cloud.link import CloudLink, CloudUnavailable, cloud_health
from edgefuse.cloud.service import CloudService, start_service_process, stop_service_process
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.models import load_model, tiny_model
from edgefuse.transport.crypto import FRAME_OVERHEAD
from tests.cloud.conftest import RawClient, TcpRelay, device_keys, service_keys, wait_for
from edgefuse.transport.wan import WanProfile

NAME = "tiny-qwen2"
PROMPTS = [[5, 17, 33, 60, 91], [200, 11, 7], [42, 43, 44, 45, 46, 47, 48, 49], [300, 301]]
HELLO_BYTES = 4 + len(P.MAGIC_HELLO) + 32 + 1 + 16  # framed hello with a 16-byte session id
WELCOME_BYTES = 4 + len(P.MAGIC_WELCOME) + 32 + 32 + 64  # ephemeral, identity, signature
IDENTIFY_BYTES = 4 + FRAME_OVERHEAD + 1 + 32 + 64  # the sealed IDENTIFY frame


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer, fingerprint) of the tiny qwen2: the reference copy for the tests;
    each service gets its own copy (same seed, same weights)."""
    model, tok = tiny_model("qwen2")
    return model, tok, tokenizer_fingerprint(tok)


@pytest.fixture(scope="module")
def greedy(tiny):
    """Greedy continuations (20 tokens) of PROMPTS by ``model.generate``."""
    model, tok, _ = tiny
    out = {}
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=20, min_new_tokens=20,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
        out[tuple(p)] = ids[0, len(p):].tolist()
        assert len(out[tuple(p)]) == 20
    return out


class SlowTarget(Target):
    """The real target with a delay before each step (to catch a request mid-flight)."""

    delay_s = 0.0

    def step(self, jobs):
        time.sleep(self.delay_s)
        return super().step(jobs)


@pytest.fixture
def make_service():
    """Factory: a started in-process service over a fresh tiny-qwen2 Target."""
    started = []

    def make(target_cls=Target, **kw) -> CloudService:
        model, tok = tiny_model("qwen2")
        svc = CloudService(target_cls(model, tok, NAME, max_context=1024), "127.0.0.1", 0, **{**service_keys(), **kw})
        svc.start_in_thread()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


# --------------------------------------------------------------------------------- wire

def test_wire_framing_and_handshake_codecs():
    assert wire.frame(b"abc") == b"\x00\x00\x00\x03abc"
    with pytest.raises(wire.MessageTooLarge, match="exceeds"):
        wire.frame(bytes(P.MAX_MESSAGE_BYTES + 1))
    key, sid = bytes(range(32)), b"\x01\x02\x03"
    assert wire.decode_hello(wire.encode_hello(key, sid)) == (key, sid)
    assert wire.decode_welcome(wire.encode_welcome(key)) == key
    with pytest.raises(P.ProtocolError):
        wire.decode_hello(wire.encode_hello(key, sid)[:-1])  # announced 3 id bytes, carries 2
    with pytest.raises(P.ProtocolError):
        wire.decode_welcome(P.MAGIC_HEALTH + key)
    with pytest.raises(P.ProtocolError):
        wire.encode_hello(key[:31], sid)


def test_oversized_announcement_closes_the_connection(make_service):
    svc = make_service()
    raw = RawClient(svc.port)
    raw.sock.sendall((P.MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(wire.PeerClosed):
        wire.recv_message(raw.sock)
    raw.close()
    wait_for(lambda: svc.stats()["connections_open"] == 0, what="connection closed")


# ---------------------------------------------------------------------- model work

def test_open_and_verify_greedy_equals_generate(make_service, tiny, greedy):
    _, _, fp = tiny
    svc = make_service()
    prompt = PROMPTS[0]
    ref = greedy[tuple(prompt)]
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
        opened = link.open(prompt, fp, max_new=64)
        assert opened == P.Opened(NAME, fp, 1024)
        tokens = list(prompt)
        for i in range(12):  # γ = 0: remote autoregressive decoding
            rep = link.request(P.Verify(req=i, base_len=len(tokens), draft=[]), timeout_s=10)
            assert rep == P.Verified(req=i, accepted=0, token=ref[i])
            tokens.append(rep.token)
        assert tokens[len(prompt):] == ref[:12]
        # the true continuation is accepted whole, and the bonus token follows it
        rep = link.request(P.Verify(100, len(tokens), ref[12:15]), timeout_s=10)
        assert rep == P.Verified(100, 3, ref[15])
        tokens += ref[12:16]
        # a wrong second draft token: one accepted, the correction is the greedy token
        wrong = (ref[17] + 1) % 390
        rep = link.request(P.Verify(101, len(tokens), [ref[16], wrong, ref[18]]), timeout_s=10)
        assert rep == P.Verified(101, 1, ref[17])
        tokens += ref[16:18]
        # FUSE: the top-1 of the cloud's distribution is the greedy next token
        rep = link.request(P.Fuse(102, len(tokens), [], 8), timeout_s=10)
        assert isinstance(rep, P.TopK) and rep.req == 102 and len(rep.ids) == 8
        assert int(rep.ids[0]) == ref[18]
        assert np.all(np.diff(rep.logprobs()) <= 0)  # sorted, most likely first
        # the cloud refuses a request that is out of sync, and the session goes on
        with pytest.raises(P.RemoteError) as err:
            link.request(P.Verify(103, len(tokens) + 1, []), timeout_s=10)
        assert err.value.code == "sync"
        rep = link.request(P.Verify(104, len(tokens), []), timeout_s=10)
        assert rep == P.Verified(104, 0, ref[18])
        assert link.round_trips == 1 + 12 + 5


def test_pipelined_requests_keep_their_order(make_service, tiny, greedy):
    """OPEN and three dependent VERIFYs sent back to back (no waiting): the batcher defers a
    session's later requests to later batches, so each sees the previous one committed."""
    _, _, fp = tiny
    svc = make_service(max_wait_ms=30.0)
    prompt = PROMPTS[3]
    ref = greedy[tuple(prompt)]
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
        link.send(P.Open(prompt, fp))
        for i in range(3):
            link.send(P.Verify(i, len(prompt) + i, []))
        assert isinstance(link.recv(timeout_s=10), P.Opened)
        assert [link.recv(timeout_s=10) for _ in range(3)] == \
            [P.Verified(i, 0, ref[i]) for i in range(3)]
    assert svc.stats()["batches"] == 3 and svc.stats()["max_batch_size"] == 1


def test_wrong_fingerprint_is_refused_and_the_link_can_retry(make_service, tiny):
    _, _, fp = tiny
    svc = make_service()
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
        with pytest.raises(P.RemoteError) as err:
            link.open(PROMPTS[1], "0" * 16)
        assert err.value.code == "fingerprint"
        wait_for(lambda: svc.stats()["sessions_open"] == 0, what="refused session freed")
        with pytest.raises(P.RemoteError) as err:  # VERIFY without an open session
            link.request(P.Verify(0, 3, []), timeout_s=10)
        assert err.value.code == "protocol"
        assert link.open(PROMPTS[1], fp).fingerprint == fp
        assert svc.stats()["sessions_open"] == 1


def test_rejected_frames_leave_the_session_working_until_a_gap(make_service, tiny, greedy):
    _, _, fp = tiny
    svc = make_service()
    prompt = PROMPTS[2]
    ref = greedy[tuple(prompt)]
    raw = RawClient(svc.port)
    open_frame = raw.seal(P.Open(prompt, fp, max_new=32))
    raw.send_frame(open_frame)
    assert raw.recv() == P.Opened(NAME, fp, 1024)
    base = len(prompt)
    req = 0

    def verify_frame():
        nonlocal req
        req += 1
        return req, raw.seal(P.Verify(req, base + req - 1, []))

    def expect_answer(r):
        assert raw.recv() == P.Verified(r, 0, ref[r - 1])

    rejected = 0
    # 1. tampered: a ciphertext byte flipped in flight; then the genuine frame arrives
    r, genuine = verify_frame()
    tampered = bytearray(genuine)
    tampered[12] ^= 0x01
    raw.send_frame(bytes(tampered))
    rejected += 1
    raw.send_frame(genuine)
    expect_answer(r)  # the very next message answers the genuine frame: nothing for the bad one
    # 2. replayed: the OPEN frame (seq 0) again
    raw.send_frame(open_frame)
    rejected += 1
    r, genuine = verify_frame()
    raw.send_frame(genuine)
    expect_answer(r)
    # 4. truncated: shorter than header + tag; then the whole frame
    r, genuine = verify_frame()
    raw.send_frame(genuine[:FRAME_OVERHEAD - 6])
    rejected += 1
    raw.send_frame(genuine)
    expect_answer(r)
    # 4b. the tag cut short (longer than the overhead): fails authentication
    r, genuine = verify_frame()
    raw.send_frame(genuine[:-3])
    rejected += 1
    raw.send_frame(genuine)
    expect_answer(r)
    stats = svc.stats()
    assert stats["frames_rejected"] == rejected == 4
    # 5. an authentic frame whose plaintext does not parse: ERROR protocol, session goes on
    raw.send_frame(raw.seal(bytes([P.VERIFY, 0, 0])))
    reply = raw.recv()
    assert isinstance(reply, P.Error) and reply.code == "protocol"
    r, genuine = verify_frame()
    raw.send_frame(genuine)
    expect_answer(r)
    assert svc.stats()["protocol_errors"] == 1 and svc.stats()["frames_rejected"] == 4
    # 6. reordered: an authentic frame after a gap means frames were dropped in transit;
    # the stream can no longer be trusted, so the service answers ERROR integrity and closes
    r1, f1 = verify_frame()
    r2, f2 = verify_frame()
    raw.send_frame(f2)
    reply = raw.recv()
    assert isinstance(reply, P.Error) and reply.code == "integrity"
    with pytest.raises(OSError):  # the closed stream: EOF (PeerClosed) or a reset
        raw.send_frame(f1)
        raw.recv()
    assert svc.stats()["integrity_closes"] == 1 and svc.stats()["frames_rejected"] == 5
    raw.close()


def _session_script(link: CloudLink, prompt: list[int], fp: str, barrier=None) -> list:
    """A fixed mix of VERIFY (γ = 0 and drafted) and FUSE; returns every answer as values."""
    link.open(prompt, fp, max_new=64)
    if barrier is not None:
        barrier.wait()
    tokens, out = list(prompt), []
    for i in range(10):
        if i % 3 == 2:
            rep = link.request(P.Fuse(i, len(tokens), [], 16), timeout_s=20)
            top1 = int(rep.ids[0])
            out.append(("topk", rep.ids.tolist(), rep.q.tolist(), rep.top, rep.scale, rep.tail))
            rep = link.request(P.Fuse(100 + i, len(tokens), [top1], 4), timeout_s=20)
            out.append(("topk", rep.ids.tolist(), rep.q.tolist(), rep.top, rep.scale, rep.tail))
            tokens.append(top1)
        else:
            draft = [(tokens[-1] * 7 + j) % 390 for j in range(i % 3 * 2)]
            rep = link.request(P.Verify(i, len(tokens), draft), timeout_s=20)
            out.append(("verified", rep.req, rep.accepted, rep.token))
            tokens += draft[:rep.accepted] + [rep.token]
    out.append(("tokens", tokens))
    return out


def _assert_same_answers(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g[0] == "topk":  # batched rows may differ from a lone row by float rounding
            assert g[1] == w[1]
            assert np.max(np.abs(np.array(g[2], np.int64) - np.array(w[2], np.int64))) <= 1
            assert g[3:] == pytest.approx(w[3:], rel=1e-2, abs=2e-3)
        else:
            assert g == w


def test_concurrent_sessions_batch_and_stay_isolated(make_service, tiny):
    _, _, fp = tiny
    solo = make_service(max_wait_ms=0.0)
    alone = []
    for p in PROMPTS:  # each session by itself: batches of one
        with CloudLink.connect("127.0.0.1", solo.port, **device_keys()) as link:
            alone.append(_session_script(link, p, fp))
    assert solo.stats()["max_batch_size"] == 1
    svc = make_service(max_wait_ms=40.0, max_batch=8)
    assert len({json.dumps(a[-1]) for a in alone}) == len(PROMPTS)  # the sessions do differ

    results, errors = [None] * len(PROMPTS), []
    barrier = threading.Barrier(len(PROMPTS))

    def run(k):
        try:
            with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
                results[k] = _session_script(link, PROMPTS[k], fp, barrier)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for got, want in zip(results, alone):
        _assert_same_answers(got, want)
    stats = svc.stats()
    assert stats["jobs"] == len(PROMPTS) * 13
    assert stats["max_batch_size"] > 1 and stats["batches"] < stats["jobs"]
    assert sum(int(k) * v for k, v in stats["batch_sizes"].items()) == stats["jobs"]
    assert stats["jobs_dropped"] == 0 and stats["frames_rejected"] == 0


# ------------------------------------------------------------------ session lifecycle

def test_disconnect_and_close_free_the_session(make_service, tiny):
    _, _, fp = tiny
    svc = make_service()
    a = CloudLink.connect("127.0.0.1", svc.port, **device_keys())
    b = CloudLink.connect("127.0.0.1", svc.port, **device_keys())
    a.open(PROMPTS[0], fp)
    b.open(PROMPTS[1], fp)
    assert cloud_health("127.0.0.1", svc.port)["sessions_open"] == 2
    a._sock.shutdown(socket.SHUT_RDWR)  # an abrupt disconnect: no CLOSE message
    wait_for(lambda: svc.stats()["sessions_open"] == 1, what="session of a freed")
    b.close()
    b.close()  # idempotent
    wait_for(lambda: svc.stats()["sessions_open"] == 0, what="session of b freed")
    wait_for(lambda: svc.stats()["connections_open"] == 0, what="connections closed")
    with pytest.raises(CloudUnavailable):
        b.send(P.Verify(0, 5, []))
    with pytest.raises(CloudUnavailable):
        b.recv(timeout_s=1)
    a.close()
    assert svc.stats()["sessions_total"] == 2


def test_busy_beyond_max_sessions(make_service, tiny):
    _, _, fp = tiny
    svc = make_service(max_sessions=2)
    links = [CloudLink.connect("127.0.0.1", svc.port, **device_keys()) for _ in range(3)]
    links[0].open(PROMPTS[0], fp)
    links[1].open(PROMPTS[1], fp)
    with pytest.raises(P.RemoteError) as err:
        links[2].open(PROMPTS[2], fp)
    assert err.value.code == "busy"
    assert svc.stats()["busy_refusals"] == 1 and svc.stats()["sessions_open"] == 2
    links[0].close()
    wait_for(lambda: svc.stats()["sessions_open"] == 1, what="a slot freed")
    assert links[2].open(PROMPTS[2], fp).model == NAME  # the same connection retries
    for link in links:
        link.close()


def test_health_fields(make_service, tiny):
    _, _, fp = tiny
    svc = make_service(max_batch=4, max_wait_ms=2.0, max_sessions=7, health_token="t0ken")
    h = cloud_health("127.0.0.1", svc.port, token="t0ken")  # the full status needs the token
    assert h["status"] == "ok" and h["model"] == NAME and h["fingerprint"] == fp
    assert h["context_len"] == 1024 and h["max_batch"] == 4 and h["max_sessions"] == 7
    assert h["sessions_open"] == 0 and h["queue_depth"] == 0 and h["batches"] == 0
    assert h["uptime_s"] >= 0
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
        link.open(PROMPTS[0], fp)
        link.request(P.Verify(1, len(PROMPTS[0]), []), timeout_s=10)
        h = cloud_health("127.0.0.1", svc.port, token="t0ken")
        assert h["sessions_open"] == 1 and h["batches"] == 1 and h["jobs"] == 1
    assert h["health_probes"] == 2 and h["uptime_s"] > 0


def test_stop_mid_request_raises_cloud_unavailable(make_service, tiny):
    _, _, fp = tiny
    svc = make_service(target_cls=SlowTarget)
    svc.target.delay_s = 0.5
    link = CloudLink.connect("127.0.0.1", svc.port, **device_keys())
    link.open(PROMPTS[0], fp)
    link.send(P.Verify(1, len(PROMPTS[0]), []))
    threading.Timer(0.1, svc.stop).start()
    with pytest.raises(CloudUnavailable):  # not the TimeoutError of a 10 s wait
        link.recv(timeout_s=10)
    with pytest.raises(CloudUnavailable):
        link.send(P.Verify(2, len(PROMPTS[0]), []))
    link.close()
    svc.stop()
    assert svc.stats()["sessions_open"] == 0
    with pytest.raises(CloudUnavailable):
        CloudLink.connect("127.0.0.1", svc.port, **device_keys(), timeout_s=2)


# ---------------------------------------------------------------- byte accounting, WAN

class Relay(TcpRelay):
    """A TCP relay between a client and ``port`` that counts the bytes each way."""

    def __init__(self, port: int):
        self.up = self.down = 0
        super().__init__(port)

    def _pump(self, src, dst, attr):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                setattr(self, attr, getattr(self, attr) + len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def test_byte_accounting_equals_bytes_on_the_socket(make_service, tiny):
    _, _, fp = tiny
    svc = make_service()
    relay = Relay(svc.port)
    before = svc.stats()
    link = CloudLink.connect("127.0.0.1", relay.port, **device_keys())
    prompt = PROMPTS[0]
    opened = link.open(prompt, fp)
    tokens = list(prompt)
    plain_up = [P.encode(P.Open(prompt, fp))]
    plain_down = [P.encode(opened)]
    for i in range(4):
        msg = P.Verify(i, len(tokens), [tokens[-1]] * i) if i < 3 else P.Fuse(i, len(tokens), [], 32)
        rep = link.request(msg, timeout_s=10)
        plain_up.append(P.encode(msg))
        plain_down.append(P.encode(rep))
        if isinstance(rep, P.Verified):
            tokens += msg.draft[:rep.accepted] + [rep.token]
    link.close()
    plain_up.append(P.encode(P.Close()))
    relay.join()
    assert link.bytes_up == relay.up and link.bytes_down == relay.down
    # and the counts are exactly handshake + (prefix + frame overhead + plaintext) per message
    per = P.LENGTH_PREFIX_BYTES + FRAME_OVERHEAD
    assert (HELLO_BYTES, WELCOME_BYTES, IDENTIFY_BYTES) == (57, 136, 127)
    assert relay.up == HELLO_BYTES + IDENTIFY_BYTES + sum(per + len(p) for p in plain_up)
    assert relay.down == WELCOME_BYTES + sum(per + len(p) for p in plain_down)
    assert (link.messages_up, link.messages_down) == (6, 5)
    wait_for(lambda: svc.stats()["connections_open"] == 0, what="relay connection closed")
    after = svc.stats()
    assert after["bytes_in"] - before["bytes_in"] == relay.up
    assert after["bytes_out"] - before["bytes_out"] == relay.down


def test_wan_emulation_delays_without_blocking(make_service, tiny):
    _, _, fp = tiny
    svc = make_service()
    wan = WanProfile(rtt_ms=100.0, bandwidth_mbps=float("inf"))
    t0 = time.monotonic()
    link = CloudLink.connect("127.0.0.1", svc.port, **device_keys(), wan=wan)
    assert time.monotonic() - t0 >= 0.1  # the handshake is one emulated round trip
    prompt = PROMPTS[1]
    link.open(prompt, fp)
    t0 = time.monotonic()
    link.send(P.Verify(1, len(prompt), []))  # returns before the emulated uplink delay
    with pytest.raises(TimeoutError):  # the answer is still "in flight" ...
        link.recv(timeout_s=0.03)
    rep = link.recv(timeout_s=5)  # ... until one RTT has passed
    assert isinstance(rep, P.Verified) and time.monotonic() - t0 >= 0.1
    # two pipelined requests: both answered after about one RTT, not two, in order
    base = len(prompt) + 1
    t0 = time.monotonic()
    link.send(P.Verify(2, base, []))
    link.send(P.Verify(3, base + 1, []))
    link.count_round_trip()
    first, second = link.recv(timeout_s=5), link.recv(timeout_s=5)
    elapsed = time.monotonic() - t0
    assert (first.req, second.req) == (2, 3)
    assert elapsed >= 0.1  # the emulated RTT was waited (upper bounds are for benchmarks)
    assert link.round_trips == 2  # open + the counted pipelined pair
    assert link.wan_up.frames == 6 and link.wan_down.frames == 5  # handshake (and IDENTIFY) included
    link.close()


# ------------------------------------------------------------ process helpers and CLI

def test_load_model_resolves_the_tiny_name():
    model, tok = load_model(NAME)
    assert model.config.model_type == "qwen2" and len(tok) <= 512


def test_service_process_starts_answers_and_stops_on_sigterm(tmp_path, tiny, greedy):
    _, _, fp = tiny
    log_path = tmp_path / "cloud.log"
    proc, port = start_service_process(NAME, port=0, max_wait_ms=1.0, log_path=log_path,
                                       timeout_s=90)
    try:
        h = cloud_health("127.0.0.1", port, token=proc.health_token)
        assert h["model"] == NAME and h["fingerprint"] == fp and h["pid"] == proc.pid
        with CloudLink.connect("127.0.0.1", port, **device_keys()) as link:
            link.open(PROMPTS[3], fp)
            rep = link.request(P.Verify(7, len(PROMPTS[3]), []), timeout_s=10)
            assert rep == P.Verified(7, 0, greedy[tuple(PROMPTS[3])][0])
    finally:
        rc = stop_service_process(proc)
    assert rc == 0
    text = log_path.read_text()
    assert "listening on 127.0.0.1:%d" % port in text and "SIGTERM received" in text
    assert "cloud service stopped" in text


def test_service_process_failure_reports_the_log(tmp_path):
    from edgefuse.cloud.service import ServiceStartError

    with pytest.raises(ServiceStartError, match="exited with code 2") as err:
        start_service_process("no-such-model", log_path=tmp_path / "bad.log", timeout_s=60)
    assert "no-such-model" in str(err.value)


def test_cli_health(make_service, capsys):
    from edgefuse.cli.main import main

    svc = make_service()
    assert main(["cloud", "health", "--port", str(svc.port)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["model"] == NAME and status["sessions_open"] == 0
    svc.stop()
    assert main(["cloud", "health", "--port", str(svc.port), "--timeout", "1"]) == 1


# ------------------------------------------------------------------- chunked prefill

def test_chunked_prefill_caches_what_a_whole_prefill_does_and_answers_alike(tiny):
    """A prompt of 37 ids prefilled 5 at a time: the cache matches the whole prefill's (up to
    float rounding), and every greedy answer after it (VERIFY of a draft, FUSE top-k) is the
    same as after a whole prefill."""
    model, tok, fp = tiny
    prompt = [(7 * i + 3) % 300 + 10 for i in range(37)]
    whole, chunked = Target(model, tok, NAME), Target(model, tok, NAME, prefill_chunk=5)
    a = whole.open(P.Open(prompt, fp, 0.0, 0, 0, 32))
    b = chunked.open(P.Open(prompt, fp, 0.0, 0, 0, 32))
    assert chunked.prefill_left(b) == 36 and b.cached == 0 and whole.prefill_left(a) == 0
    steps = 0
    while chunked.prefill_left(b):
        chunked.prefill_step(b)
        steps += 1
    assert steps == 8 and b.cached == a.cached == 36  # ceil(36 / 5)
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5) and torch.allclose(la.values, lb.values, atol=1e-5)
    draft = [11, 12, 13]
    (va,) = whole.step([(a, P.Verify(1, len(prompt), draft))])
    (vb,) = chunked.step([(b, P.Verify(1, len(prompt), draft))])
    assert (va.accepted, va.token) == (vb.accepted, vb.token)
    n = len(prompt) + va.accepted + 1
    (fa,) = whole.step([(a, P.Fuse(2, n, [], 8))])
    (fb,) = chunked.step([(b, P.Fuse(2, n, [], 8))])
    assert list(fa.ids) == list(fb.ids)


def test_a_long_new_prompt_does_not_stall_a_decoding_session(make_service, tiny, greedy):
    """Session A decodes (one VERIFY per token) while session B opens with a 400-id prompt
    prefilled 16 at a time: A's jobs run between B's chunks, and both answer exactly as alone."""
    _, _, fp = tiny
    svc = make_service(max_wait_ms=0.0)
    svc.target.prefill_chunk = 16
    long_prompt = [(5 * i + 1) % 300 + 10 for i in range(400)]
    p = PROMPTS[0]
    errors, out = [], {}

    def decode_a():
        try:
            with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
                link.open(p, fp, max_new=40)
                toks = []
                for _ in range(20):
                    r = link.request(P.Verify(len(toks), len(p) + len(toks), []), timeout_s=30)
                    toks.append(int(r.token))
                    if len(toks) == 2:
                        started.set()
                out["a"] = toks
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            started.set()

    started = threading.Event()
    t = threading.Thread(target=decode_a)
    t.start()
    started.wait(30)
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
        link.open(long_prompt, fp, max_new=8)
        r = link.request(P.Verify(1, len(long_prompt), []), timeout_s=30)
        out["b"] = int(r.token)
    t.join(60)
    assert not errors, errors
    assert out["a"] == greedy[tuple(p)]
    ref = Target(tiny[0], tiny[1], NAME)
    s = ref.open(P.Open(long_prompt, fp, 0.0, 0, 0, 8))
    (want,) = ref.step([(s, P.Verify(1, len(long_prompt), []))])
    assert out["b"] == int(want.token)
    stats = svc.stats()
    assert stats["prefill_chunks"] == 25 + 1  # B: ceil(399 / 16); A: its 4 prompt ids in one
    assert stats["prefill_interleaved_batches"] >= 1


def _chunking_service():
    """A service (never started) over a tiny target prefilling 4 ids a chunk; ``log`` gets
    every answer (kind, session id, message type) in the order the worker gives them."""
    from edgefuse.cloud.service import _Conn, _Session

    model, tok = tiny_model("qwen2", seed=1)
    target = Target(model, tok, NAME, prefill_chunk=4)
    svc = CloudService(target, "127.0.0.1", 0, insecure_anonymous=True, max_wait_ms=0)
    log = []
    svc._reply = lambda item, msg, clear=False: msg is not None and log.append(
        (item.kind, item.sess.id, type(msg).__name__))
    conn = _Conn(1, None, None)
    return svc, target, log, (lambda i: _Session(i, conn))


def test_items_waiting_during_a_chunked_prefill_keep_their_order_and_end(tiny):
    """The attacks on the interleaving: CLOSEs of other sessions queued during a prefill (it
    must end, not spin); another session's AUTH then VERIFY (the AUTH must be answered first);
    the opening session's own VERIFY sent right behind its OPEN (it must wait for OPENED)."""
    from edgefuse.cloud.service import _Item

    svc, target, log, session = _chunking_service()
    a, b, c = session(1), session(2), session(3)
    target.prefill_chunk = 0
    b.target = target.open(P.Open([11, 12, 13], target.fingerprint, 0.0, 0, 0, 8))
    target.prefill_chunk = 4
    svc._live.update({a, b})
    c.closed = True
    svc._queue.put(_Item("close", c))
    svc._queue.put(_Item("auth", b, P.Auth(P.CloudAuth())))
    svc._queue.put(_Item("job", b, P.Verify(1, 3, [])))
    svc._queue.put(_Item("job", a, P.Verify(1, 40, [])))  # A's own, right behind its OPEN
    for it in list(svc._queue.queue):
        it.counted = True
    a.target = target.open(P.Open([(7 * i + 3) % 300 + 10 for i in range(40)], target.fingerprint, 0.0, 0, 0, 8))
    done = []
    t = threading.Thread(target=lambda: done.append(svc._prefill_chunked(target, a)), daemon=True)
    t.start()
    t.join(20)
    assert done == [10] and target.prefill_left(a.target) == 0  # ended: ceil(39 / 4) chunks
    assert log == []  # nothing overtook: B's AUTH waits, so does its VERIFY, and A's own job
    assert [(i.kind, i.sess.id) for i in svc._pending] == [("close", 3), ("auth", 2), ("job", 2), ("job", 1)]


def test_jobs_of_other_sessions_run_between_the_chunks(tiny):
    from edgefuse.cloud.service import _Item

    svc, target, log, session = _chunking_service()
    a, b = session(1), session(2)
    target.prefill_chunk = 0
    b.target = target.open(P.Open([11, 12, 13], target.fingerprint, 0.0, 0, 0, 8))
    target.prefill_chunk = 4
    svc._live.update({a, b})
    job = _Item("job", b, P.Verify(1, 3, []), counted=True)
    svc._queue.put(job)
    a.target = target.open(P.Open(list(range(10, 30)), target.fingerprint, 0.0, 0, 0, 8))
    assert svc._prefill_chunked(target, a) == 5
    assert log == [("job", 2, "Verified")] and not svc._pending and svc.stats()["prefill_interleaved_batches"] == 1
