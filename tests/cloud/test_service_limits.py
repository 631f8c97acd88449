"""The cloud service's limits against an active attacker (edgefuse.cloud.service "Limits",
edgefuse.cloud.target ``max_draft`` / ``max_batch_tokens``). Each test runs the attack on a
real service over real sockets (the tiny random-weight qwen2 as the target) and checks that
it is refused or bounded, by counters and decoded tokens, and that an honest device on the
same service still gets the target's own answers."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from edgefuse.cloud import protocol as P
from edgefuse.cloud import wire
from edgefuse.cloud.link import CloudLink, CloudUnavailable, cloud_health
from edgefuse.cloud.service import (CloudService, LIMITS, service_limits, start_service_process,
                                    stop_service_process)
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.config import compose
from edgefuse.models import tiny_model
from tests.cloud.conftest import RawClient, device_keys, service_keys, wait_for

NAME = "tiny-qwen2"
PROMPT = [5, 17, 33, 60, 91]
LONG = [(7 * i + 3) % 380 + 5 for i in range(200)]  # 200 in-vocabulary ids
HELLO_BYTES = 4 + len(P.MAGIC_HELLO) + 32 + 1 + 16  # framed hello with a 16-byte session id
IDENTIFY_BYTES = 4 + 26 + 1 + 32 + 64  # the sealed IDENTIFY frame
PUBLIC_HEALTH = {"status", "model", "context_len", "sessions_open", "connections_open",
                 "queue_depth", "uptime_s", "authenticated"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer, fingerprint) of the tiny qwen2 (the reference copy)."""
    model, tok = tiny_model("qwen2")
    return model, tok, tokenizer_fingerprint(tok)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens ``model.generate`` continues ``prompt`` with (no EOS stop)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


class SlowTarget(Target):
    """The real target with a delay before each step (requests pile up behind it)."""

    delay_s = 0.0

    def step(self, jobs):
        time.sleep(self.delay_s)
        return super().step(jobs)


@pytest.fixture
def serve():
    """Factory: ``serve(target_kw={...}, **service_kw)`` starts an in-process service over a
    fresh tiny-qwen2 Target (``target_cls`` to swap it); all are stopped after the test."""
    started = []

    def start(target_cls=Target, target_kw=None, **kw) -> CloudService:
        model, tok = tiny_model("qwen2")
        tkw = {"max_context": 512, **(target_kw or {})}
        svc = CloudService(target_cls(model, tok, NAME, **tkw), "127.0.0.1", 0, **{**service_keys(), **kw})
        svc.start_in_thread()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the service closed ``sock``: EOF or a reset within 10 s (a socket timeout,
    i.e. the service still waiting for bytes, is False)."""
    sock.settimeout(10)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def honest_decode(port: int, model, fp: str) -> list[int]:
    """A real device on the service: OPEN, 5 × γ = 0, then a 3-token draft of the true
    continuation (accepted whole, bonus token after it); returns the 9 tokens it got, after
    checking each answer."""
    ref = greedy(model, PROMPT, 9)
    with CloudLink.connect("127.0.0.1", port, **device_keys()) as link:
        assert link.open(PROMPT, fp, max_new=32) == P.Opened(NAME, fp, 512)
        tokens = list(PROMPT)
        for i in range(5):
            rep = link.request(P.Verify(i, len(tokens), []), timeout_s=20)
            assert rep == P.Verified(i, 0, ref[i])
            tokens.append(rep.token)
        rep = link.request(P.Verify(9, len(tokens), ref[5:8]), timeout_s=20)
        assert rep == P.Verified(9, 3, ref[8])
        tokens += ref[5:9]
    return tokens[len(PROMPT):]


# ------------------------------------------------------------ finding 4: amplification

def test_amplification_verify_is_refused_and_sessions_go_on(serve, tiny):
    model, _, fp = tiny
    svc = serve(target_kw={"max_draft": 8, "max_batch_tokens": 512})
    window = P.CloudAuth(True, 200)
    attack = P.Verify(1, len(LONG), [5] * 255, auth=window)
    # the attack: ~1 KB that plans 255 window rows of 200 ids (51,000 token rows)
    assert len(P.encode(attack)) == 1 + 8 + 5 + 4 + 1 + 4 * 255 + 1 == 1040
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
        link.open(LONG, fp, max_new=50, auth=window)
        with pytest.raises(P.RemoteError) as err:
            link.request(attack, timeout_s=20)
        assert err.value.code == "limit"
        assert "drafts 255 tokens" in err.value.message and "at most 8" in err.value.message
        # within max_draft, but 1 + 8 × 200 = 1,601 token rows > max_batch_tokens
        with pytest.raises(P.RemoteError) as err:
            link.request(P.Verify(2, len(LONG), [5] * 8, auth=window), timeout_s=20)
        assert err.value.code == "limit" and "1601 token rows" in err.value.message
        # the same session still answers, with the target's own next token
        rep = link.request(P.Verify(3, len(LONG), [], auth=window), timeout_s=20)
        assert rep == P.Verified(3, 0, greedy(model, LONG, 1)[0])
    assert honest_decode(svc.port, model, fp) == greedy(model, PROMPT, 9)
    stats = svc.stats()
    assert stats["limit_refusals"] == 2 and svc.target.limit_refusals == 2
    # prefill of 199 ids was the largest forward: nothing near 51,000 or 1,601 ever ran
    assert stats["forward_tokens_max"] == svc.target.forward_tokens_max == 199


def _windowed_sessions(target: Target, fp: str, prompts: list[list[int]], l_cache: int):
    """Open one session per prompt under the window ``l_cache`` (only its last ``l_cache``
    ids sent, the rest as offset)."""
    auth = P.CloudAuth(True, l_cache)
    return [target.open(P.Open(p[-l_cache:], fp, max_new=20, auth=auth, offset=len(p) - l_cache))
            for p in prompts], auth


def test_a_batch_over_max_batch_tokens_is_split_with_the_same_answers(tiny):
    model, tok, fp = tiny
    prompts = [LONG[:120], LONG[50:180]]
    capped = Target(model, tok, NAME, max_context=256, max_batch_tokens=512)
    plain = Target(model, tok, NAME, max_context=256, max_batch_tokens=8192)
    replies, forwards = {}, {}
    for name, t in (("capped", capped), ("plain", plain)):
        sessions, auth = _windowed_sessions(t, fp, prompts, 100)
        before = (t.forwards, t.forward_tokens_max)
        t.forward_tokens_max = 0
        # γ = 3 under a full 100-id window: 1 main id + 3 own rows of 100 ids = 301 each
        jobs = [(s, P.Verify(k, len(p), [p[-1], p[-2], p[-3]], auth=auth))
                for k, (s, p) in enumerate(zip(sessions, prompts))]
        replies[name] = t.step(jobs)
        forwards[name] = (t.forwards - before[0], t.forward_tokens_max)
    assert all(isinstance(r, P.Verified) for r in replies["plain"])
    assert replies["capped"] == replies["plain"]
    # main rows: one forward of 2 sessions × 1 id padded to 4 rows; the 6 window rows of 100:
    # one forward of 600 uncapped, 5 + 1 rows (500 and 100) under the cap of 512
    assert forwards["plain"] == (2, 600)
    assert forwards["capped"] == (3, 500)


def test_main_rows_over_max_batch_tokens_are_split(tiny):
    """Three FUSEs each committing 255 ids (256-id main rows): 768 token rows in one forward
    uncapped, split 512 + 256 under the cap, with the same top-k ids."""
    model, tok, fp = tiny
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    out = {}
    for cap in (512, 8192):
        t = Target(model, tok, NAME, max_context=512, max_batch_tokens=cap)
        sessions = [t.open(P.Open(p, fp, max_new=300)) for p in prompts]
        t.forward_tokens_max, f0 = 0, t.forwards
        jobs = [(s, P.Fuse(k, len(p), [(3 * k + j) % 380 + 5 for j in range(255)], 8))
                for k, (s, p) in enumerate(zip(sessions, prompts))]
        reps = t.step(jobs)
        out[cap] = ([r.ids.tolist() for r in reps], t.forwards - f0, t.forward_tokens_max)
    assert out[512][0] == out[8192][0]
    assert out[8192][1:] == (1, 768) and out[512][1:] == (2, 512)


# --------------------------------------------------- finding 5: connections and idleness

def test_idle_connections_are_refused_past_the_cap_then_closed(serve, tiny):
    model, _, fp = tiny
    svc = serve(max_connections=8, max_sessions=4, idle_timeout_s=2.0)
    holders = [RawClient(svc.port) for _ in range(8)]
    for raw in holders[:4]:  # 4 idle sessions fill max_sessions, 4 more idle connections
        raw.send(P.Open(PROMPT, fp))
        assert raw.recv() == P.Opened(NAME, fp, 512)
    assert svc.stats()["connections_open"] == 8 and svc.stats()["sessions_open"] == 4
    flood = [socket.create_connection(("127.0.0.1", svc.port), timeout=10) for _ in range(56)]
    # refused on accept: closed before a hello is read or a key generated
    assert all(closed_by_peer(s) for s in flood)
    stats = svc.stats()
    assert stats["connections_refused"] == 56 and stats["connections_total"] == 8
    with pytest.raises(CloudUnavailable):  # at the cap, a device is refused too ...
        CloudLink.connect("127.0.0.1", svc.port, **device_keys())
    # ... until the idle timeout closes the idle ones and frees their sessions
    wait_for(lambda: svc.stats()["idle_closed"] == 8, what="idle connections closed")
    assert all(closed_by_peer(raw.sock) for raw in holders)
    wait_for(lambda: svc.stats()["sessions_open"] == 0, what="idle sessions freed")
    assert honest_decode(svc.port, model, fp) == greedy(model, PROMPT, 9)
    assert svc.stats()["idle_closed"] == 8  # the device was never idle
    for s in flood:
        s.close()


def test_a_request_waiting_for_the_model_is_not_idle(serve, tiny):
    model, _, fp = tiny
    svc = serve(target_cls=SlowTarget, idle_timeout_s=0.5)
    svc.target.delay_s = 2.0  # four idle timeouts
    link = CloudLink.connect("127.0.0.1", svc.port, **device_keys())
    link.open(PROMPT, fp)
    rep = link.request(P.Verify(1, len(PROMPT), []), timeout_s=20)
    assert rep == P.Verified(1, 0, greedy(model, PROMPT, 1)[0])
    assert svc.stats()["idle_closed"] == 0 and link.alive
    # idle once answered: then closed, with its session
    wait_for(lambda: svc.stats()["idle_closed"] == 1, what="idle link closed")
    wait_for(lambda: not link.alive, what="link sees the close")
    assert svc.stats()["sessions_open"] == 0
    link.close()


def test_oversized_frames_are_refused_from_the_length_prefix(serve, tiny):
    model, _, fp = tiny
    svc = serve()
    assert svc.max_frame_bytes == P.MAX_REQUEST_BYTES == 65536
    before = svc.stats()
    # before the handshake: a 16 MiB announcement and a few bytes of it
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=10)
    s.sendall((16 * 1024 * 1024).to_bytes(4, "big") + b"x" * 100)
    assert closed_by_peer(s)
    s.close()
    # after the handshake: the same on an encrypted session
    raw = RawClient(svc.port)
    raw.sock.sendall((16 * 1024 * 1024).to_bytes(4, "big") + b"x" * 100)
    assert closed_by_peer(raw.sock)
    raw.close()
    wait_for(lambda: svc.stats()["connections_open"] == 0, what="both connections closed")
    after = svc.stats()
    assert after["frames_oversized"] - before["frames_oversized"] == 2
    # the service read the two prefixes, the hello and IDENTIFY, none of the announced bodies
    assert after["bytes_in"] - before["bytes_in"] == 4 + HELLO_BYTES + IDENTIFY_BYTES + 4
    # exactly max_frame_bytes is read (it is no genuine frame: rejected, session intact) ...
    raw = RawClient(svc.port)
    wire.send_message(raw.sock, bytes(svc.max_frame_bytes))
    raw.send(P.Open(PROMPT, fp))
    assert raw.recv() == P.Opened(NAME, fp, 512)
    raw.send(P.Verify(0, len(PROMPT), []))
    assert raw.recv() == P.Verified(0, 0, greedy(model, PROMPT, 1)[0])
    assert svc.stats()["frames_rejected"] == 1
    # ... one byte more closes the connection
    raw.sock.sendall((svc.max_frame_bytes + 1).to_bytes(4, "big"))
    assert closed_by_peer(raw.sock)
    raw.close()
    assert svc.stats()["frames_oversized"] - before["frames_oversized"] == 3


def test_backpressure_bounds_the_queues(serve, tiny):
    model, _, fp = tiny
    svc = serve(target_cls=SlowTarget, max_pending=2, max_queue=3)
    svc.target.delay_s = 0.02
    ref = {tuple(p): greedy(model, p, 12) for p in (PROMPT, LONG[:9])}

    def pipeline(raw: RawClient, prompt: list[int], n: int) -> list:
        """OPEN and n dependent VERIFYs written at once, without reading; then the answers."""
        msgs = [P.Open(prompt, fp)] + [P.Verify(i, len(prompt) + i, []) for i in range(n)]
        raw.sock.sendall(b"".join(wire.frame(raw.secure.seal(P.encode(m))) for m in msgs))
        return [raw.recv() for _ in range(n + 1)]

    raw = RawClient(svc.port)
    got = pipeline(raw, PROMPT, 12)
    assert got == [P.Opened(NAME, fp, 512)] + [P.Verified(i, 0, t) for i, t in enumerate(ref[tuple(PROMPT)])]
    stats = svc.stats()
    assert stats["queued_max"] == 2 and stats["backpressure_waits"] >= 1
    raw.close()
    # two connections pipelining at once: at most max_queue = 3 in all (not 2 × 2)
    results = {}
    clients = [RawClient(svc.port) for _ in range(2)]
    threads = [threading.Thread(target=lambda k=k, p=p: results.__setitem__(k, pipeline(clients[k], p, 12)))
               for k, p in enumerate((PROMPT, LONG[:9]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k, p in enumerate((PROMPT, LONG[:9])):
        assert results[k][1:] == [P.Verified(i, 0, t) for i, t in enumerate(ref[tuple(p)])]
    assert svc.stats()["queued_max"] == 3
    for c in clients:
        c.close()


def test_an_idle_session_does_not_make_the_batcher_wait(serve, tiny):
    model, _, fp = tiny
    svc = serve(max_wait_ms=300.0)
    idle = CloudLink.connect("127.0.0.1", svc.port, **device_keys())
    idle.open(LONG[:9], fp)
    idle.request(P.Verify(0, 9, []), timeout_s=20)  # one request, then silence
    time.sleep(1.0)  # well past its round (twice its gap + max_wait_ms)
    before = svc.stats()
    ref = greedy(model, PROMPT, 6)
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
        link.open(PROMPT, fp)
        for i in range(6):
            assert link.request(P.Verify(i, len(PROMPT) + i, []), timeout_s=20) == \
                P.Verified(i, 0, ref[i])
    after = svc.stats()
    assert after["batches"] - before["batches"] == 6
    # no batch blocked for a job from the idle session (each would have run out its 300 ms)
    assert after["batch_waits"] - before["batch_waits"] == 0
    assert after["batch_wait_timeouts"] - before["batch_wait_timeouts"] == 0
    idle.close()


def test_an_active_session_is_still_waited_for(serve, tiny):
    """The counterpart: two sessions in lock step, one slower to answer — the batcher waits
    for the second (it answered within its round), and the two share batches."""
    model, _, fp = tiny
    svc = serve(max_wait_ms=2000.0)
    links = [CloudLink.connect("127.0.0.1", svc.port, **device_keys()) for _ in range(2)]
    for link in links:
        link.open(PROMPT, fp)
    ref = greedy(model, PROMPT, 4)
    go = threading.Barrier(2)
    got = {0: [], 1: []}

    def run(k):
        for i in range(4):
            go.wait()
            if k == 1:
                time.sleep(0.05)  # arrives after the other's job opened the batch
            got[k].append(links[k].request(P.Verify(i, len(PROMPT) + i, []), timeout_s=20))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[0] == got[1] == [P.Verified(i, 0, ref[i]) for i in range(4)]
    stats = svc.stats()
    assert stats["batch_sizes"] == {"2": 4} and stats["batch_waits"] >= 4
    for link in links:
        link.close()


# ------------------------------------------------------------------- health and config

def test_health_says_little_without_the_token(serve, tiny):
    _, _, fp = tiny
    svc = serve(health_token="s3cret-token")
    with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:  # traffic of another session
        link.open(PROMPT, fp)
        link.request(P.Verify(1, len(PROMPT), []), timeout_s=20)
        public = cloud_health("127.0.0.1", svc.port)
        wrong = cloud_health("127.0.0.1", svc.port, token="guess")
        full = cloud_health("127.0.0.1", svc.port, token="s3cret-token")
    for h in (public, wrong):
        assert set(h) == PUBLIC_HEALTH and h["authenticated"] is False
        assert h["model"] == NAME and h["sessions_open"] == 1 and h["status"] == "ok"
    assert fp not in repr(public) and "bytes_in" not in public and "pid" not in public
    assert full["authenticated"] is True and full["fingerprint"] == fp
    assert full["jobs"] == 1 and full["bytes_in"] > 0 and full["health_probes"] == 3
    assert full["health_auth_failures"] == 1
    # a service without a token never sends the full status
    bare = serve()
    assert set(cloud_health("127.0.0.1", bare.port, token="anything")) == PUBLIC_HEALTH


def test_limits_reach_the_service_process_and_the_config(tmp_path, tiny):
    _, _, fp = tiny
    limits = {"max_handshakes": 3, "max_connections": 5, "idle_timeout_s": 45.0, "handshake_timeout_s": 7.0,
              "max_frame_bytes": 4096, "max_pending": 3, "max_queue": 9, "max_draft": 5,
              "max_batch_tokens": 2048, "prefill_chunk": 8, "row_padding": "3"}
    assert set(limits) == set(LIMITS)
    proc, port = start_service_process(NAME, port=0, max_wait_ms=1.0, max_context=1024,
                                       log_path=tmp_path / "cloud.log", timeout_s=90, **limits)
    try:
        assert "max_draft" not in cloud_health("127.0.0.1", port)
        h = cloud_health("127.0.0.1", port, token=proc.health_token)
        assert h.pop("row_padding") == {"source": "min 3", "pad_to": {"2": 3}, "costs_ms": {}}
        assert {k: h[k] for k in limits if k != "row_padding"} == \
            {k: v for k, v in limits.items() if k != "row_padding"} and h["pid"] == proc.pid
        with CloudLink.connect("127.0.0.1", port, **device_keys()) as link:
            link.open(PROMPT, fp)
            with pytest.raises(P.RemoteError) as err:  # the child's target got max_draft
                link.request(P.Verify(1, len(PROMPT), [5] * 6), timeout_s=20)
            assert err.value.code == "limit"
    finally:
        assert stop_service_process(proc) == 0
    assert proc.health_token not in " ".join(proc.args)  # not on the command line
    # the shipped defaults, as the decoding phase passes them
    assert service_limits(compose("default").cloud.service) == {
        "max_handshakes": 32, "max_connections": 128, "idle_timeout_s": 300.0, "handshake_timeout_s": 10.0,
        "max_frame_bytes": 65536, "max_pending": 4, "max_queue": 256, "max_draft": 16,
        "max_batch_tokens": 8192, "prefill_chunk": 64, "row_padding": "auto"}
