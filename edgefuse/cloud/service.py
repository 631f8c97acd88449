"""The cloud LLM service: many device sessions, one model, batched verify / top-k steps.

Transport choice: framed TCP (``u32 length ‖ body``, see :mod:`edgefuse.cloud.wire`) rather than gRPC
or WebSocket, because

- it needs no extra dependency (asyncio on the cloud, plain sockets on the device);
- byte accounting is exact: the bytes a device counts are the bytes on the socket (length
  prefix, handshake and AES-GCM overhead included), with no HTTP/2 or WebSocket framing,
  headers or compression hidden underneath;
- one persistent bidirectional stream per device carries the whole session in order, which is
  what the ordered AES-GCM frames of :class:`edgefuse.transport.SecureSession` assume and what
  pipelined requests (draft block k+1 while block k is in flight) need.

Model of execution:

- one connection = one session = one :class:`edgefuse.cloud.target.TargetSession`. Requests never carry
  a session id: a connection can only reach its own cache.
- An asyncio event loop (one thread) accepts connections, does the handshake, opens and seals
  frames, and decodes messages.
- ONE worker thread does all model work: OPEN → ``target.open``, CLOSE or a disconnect →
  ``target.close``, AUTH → ``target.authorize`` (the endpoint-authorized cache control
  (flagCache, LCache) of the edge–cloud seed design: the eviction is done before AUTHED is
  sent); VERIFY and FUSE jobs are batched: the worker takes the first queued job,
  waits up to ``max_wait_ms`` for more (at most one job per session, at most ``max_batch``;
  it waits only while a session not yet in the batch could still send one — see "Limits" —
  so a lone session, or one beside idle ones, never waits, and N sessions in step stay
  batched together),
  runs ``target.step(jobs)`` once and routes each answer back to its connection
  (``loop.call_soon_threadsafe``). Per-session order is kept: a session's later requests wait
  for its earlier ones. A job whose session has closed meanwhile is dropped.
- A frame that fails to open (forged, replayed, truncated) is logged and counted
  (``frames_rejected``) and otherwise ignored: the session is unchanged and the next genuine
  frame works. An authentic frame after a gap (a genuine frame was altered or dropped in
  transit, so the stream can never line up again) gets ERROR ``integrity`` and the
  connection closes, freeing its session, as TLS does with a bad record: the device learns
  at once instead of waiting out its timeout (``integrity_closes``). A plaintext that does
  not parse gets ERROR ``protocol``; the session goes on.
  :class:`edgefuse.cloud.target.SessionError` becomes ERROR with its code; any other failure of the
  target becomes ERROR ``internal``.
- ``max_sessions``: an OPEN beyond it gets ERROR ``busy`` (the connection stays usable; the
  device may retry or close).

Authentication (SIGMA-I, :mod:`edgefuse.cloud.wire`): the service signs its WELCOME with its
Ed25519 ``identity`` and serves only a device whose IDENTIFY (the first sealed frame) carries
a key of its ``authorized`` store and a signature of this connection's transcript. Anything
else first (an OPEN, a bad signature, an unknown key, a frame that does not open) gets ERROR
``unauthorized`` where a key exists to seal it, and the connection closes
(``auth_failures``). Before IDENTIFY nothing is served: no OPEN, no session slot, no queue
slot. An anonymous hello is closed at once (``handshakes_refused``) unless the service was
built with ``insecure_anonymous=True`` (``--insecure-anonymous``, the benchmark's "auth off"
column), which in turn refuses every authenticated hello.

Limits (against a client that sends what it likes; unauthenticated connections cost only
handshakes, an authenticated device is bounded as below; config ``cloud.service.*``, CLI
``edgefuse cloud serve --...``):

- ``max_connections`` (128): a connection beyond it is closed as soon as it is accepted,
  before a byte is read or a key generated (``connections_refused``); so is one beyond
  ``max_handshakes`` (32) connections not yet authenticated, so a flood of unauthenticated
  connections leaves ``max_connections - max_handshakes`` places to authorized devices.
- ``handshake_timeout_s`` (10 s) from accept to a verified IDENTIFY (the hello, the welcome
  and the IDENTIFY together; ``handshake_timeouts``); then ``idle_timeout_s`` (300 s): a
  connection that sends no valid message for that long while no request of its is waiting
  for the worker is closed, and its session freed (``idle_closed``). Rejected frames do not
  count as activity.
- ``max_frame_bytes`` (64 KiB; a real request is at most ~8 KB): checked from the length
  prefix, before the body is read; the first message may have 512 bytes. A larger
  announcement closes the connection (``frames_oversized``).
- ``max_pending`` (4) requests per connection and ``max_queue`` (256) in all wait for the
  worker at most; past either, the connection is not read until an answer goes out
  (backpressure through TCP, ``backpressure_waits``), so queued memory is bounded by
  ``max_queue × max_frame_bytes``.
- the target's ``max_draft`` (16) drafted tokens per VERIFY and ``max_batch_tokens`` (8192)
  token rows per forward pass (:class:`edgefuse.cloud.target.Target`): beyond them ERROR
  ``limit``, the session goes on.
- the batcher waits only for sessions that could still join: a session counts while its
  device is answering within about its own last round (twice its last gap between answer
  and next request, plus ``max_wait_ms``); an idle one does not make others wait
  (``batch_waits`` / ``batch_wait_timeouts`` count the waits).
- the health probe without the service's health token (``EDGEFUSE_CLOUD_HEALTH_TOKEN`` in its
  environment; :func:`start_service_process` makes one) answers liveness and load only:
  status, model, context_len, sessions_open, connections_open, queue_depth, uptime_s. With
  the token it adds the fingerprint, pid, limits and every counter (other sessions' bytes,
  jobs and batches are traffic metadata).

Not bounded: an authorized device holding ``max_sessions`` sessions still locks the others
out with ``busy`` (the log names it); an unauthenticated flood of ``max_handshakes``
connections renewed every ``handshake_timeout_s`` delays new devices' connections.

Run it in-process (:meth:`CloudService.start_in_thread` / :meth:`CloudService.stop`), in the
foreground until SIGINT/SIGTERM (:meth:`CloudService.serve_forever`, used by
``edgefuse cloud serve``), or as a child process
(:func:`start_service_process` / :func:`stop_service_process`).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import itertools
import logging
import os
import queue
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from edgefuse.cloud import protocol as P
from edgefuse.cloud.wire import (MessageTooLarge, PeerClosed, check_identify, decode_hello,
                                 encode_health, encode_signed_welcome, encode_welcome,
                                 health_probe_token, hello_is_anonymous, is_health_probe,
                                 session_transcript, write_message)
from edgefuse.transport.crypto import FrameError, HandshakeError, ReorderError, derive_session, generate_keypair
from edgefuse.transport.identity import (AUTHORIZED_FILE, IDENTITY_FILE, Identity, IdentityError,
                                         TrustStore, cloud_dir, load_identity)

log = logging.getLogger("edgefuse.cloud")

DEFAULT_PORT = 39200
HEALTH_TOKEN_ENV = "EDGEFUSE_CLOUD_HEALTH_TOKEN"  # the service's health token (its environment)
_STOP = object()  # the worker's stop sentinel
_PREFIX = struct.Struct(">I")
_REPO_ROOT = Path(__file__).resolve().parents[2]


class ServiceStartError(RuntimeError):
    """The cloud service process died or did not answer its health check in time; the
    message carries the tail of its log."""


class _Conn:
    """One TCP connection (event-loop thread only, except the read-only counters)."""

    def __init__(self, cid: int, peer: Any, writer: asyncio.StreamWriter):
        self.id = cid
        self.peer = peer
        self.writer = writer
        self.secure = None
        self.device: str | None = None  # the authorized device's name, once IDENTIFY verified
        self.kind = "connection"  # or "health probe"
        self.current: _Session | None = None
        self.closed = False
        self.bytes_in = self.bytes_out = 0
        self.messages_in = self.messages_out = 0
        self.frames_rejected = 0
        self.pending = 0  # requests of this connection queued for the worker, not answered
        self.last_active = time.monotonic()  # last valid message in or answer out
        self.idle = False  # closed by the idle timeout
        self.room = asyncio.Event()  # set when an answer frees a queue slot
        self.frame_limit: int | None = None  # a split session's larger frame cap (else the service's)

    def send(self, msg: P.Message) -> None:
        """Seal and queue one message on the socket (event-loop thread)."""
        if self.closed or self.secure is None or self.writer.is_closing():
            return
        try:
            plain = P.encode(msg)
        except P.ProtocolError as exc:  # a target answer that cannot be encoded: a bug
            log.error("connection %d: cannot encode %s: %s", self.id, type(msg).__name__, exc)
            plain = P.encode(P.Error("internal", f"cannot encode the answer: {exc}"))
        self.bytes_out += write_message(self.writer, self.secure.seal(plain))
        self.messages_out += 1


class _Session:
    """One OPEN on a connection: the target's session once the worker has opened it."""

    def __init__(self, sid: int, conn: _Conn):
        self.id = sid
        self.conn = conn
        self.target = None  # TargetSession, set by the worker
        self.closed = False  # set by the event loop (CLOSE, disconnect, shutdown)
        self.failed = False  # target.open refused
        self.jobs = 0
        self.answered_at: float | None = None  # worker: when its last answer went out
        self.gap: float | None = None  # worker: last answer → next request (s)
        self.split = False  # a split-inference session (MID / HEAD / MASK, never VERIFY / FUSE)


@dataclass
class _Item:
    kind: str  # "open" | "close" | "auth" | "job" (VERIFY / FUSE) | "mid" | "head" | "mask"
    sess: _Session
    msg: Any = None
    t: float = 0.0  # when it was queued (monotonic s)
    counted: bool = False  # holds a queue slot until answered
    answered: bool = False


class CloudService:
    """An asyncio TCP server in front of one :class:`edgefuse.cloud.target.Target`.

    Args:
        target: the model runner (``open`` / ``step`` / ``close``, attributes ``name``,
            ``fingerprint``, ``context_len``); only the worker thread calls it.
        host, port: where to listen; ``port=0`` picks a free port, see :attr:`port` once
            started.
        max_batch: jobs per ``target.step`` call, at most (≥ 1).
        max_wait_ms: how long (ms) the worker waits at most to fill a batch after its first
            job arrives (≥ 0; 0 = take only what is already queued); it stops early once
            every open session is in the batch. It should be about one RTT: sessions that
            fell out of step then rejoin the next batch (measured with the 1.5B target at
            80 ms RTT, 4 devices: at 20 ms a batch of 3 and a lone session alternated,
            1,100 ms/token; at 100 ms all 4 ran together, 750 ms/token).
        max_sessions: sessions open at once; an OPEN beyond gets ERROR ``busy``.
        handshake_timeout_s: a connection not authenticated (hello, welcome and a verified
            IDENTIFY; a health probe answered) within this many seconds of accept is closed.
        max_connections: connections open at once; one more is closed on accept.
        idle_timeout_s: seconds without a valid message (and no request waiting for the
            worker) after which a connection and its session are closed.
        max_frame_bytes: the largest message body accepted after the handshake (bytes,
            512 .. 16 MiB), checked from the length prefix before the body is read.
        max_pending: requests per connection waiting for the worker, at most (≥ 1).
        max_queue: requests waiting for the worker in all, at most (≥ 1).
        health_token: the secret a health probe must carry for the full status (None: the
            full status is never sent over the network).
        identity: the service's Ed25519 identity (signs every WELCOME; devices pin its key).
        authorized: the devices it serves (their pinned keys, by name).
        max_handshakes: connections not yet authenticated at once, at most (1 ..
            ``max_connections``; None = min(32, ``max_connections``)); one more is closed on
            accept.
        insecure_anonymous: speak only the anonymous handshake (no identities; the
            benchmark's "auth off" column); ``identity`` and ``authorized`` are then unused.
        split: the split-inference runner (:class:`edgefuse.cloud.split_target.SplitTarget`,
            ``open`` / ``step`` / ``head`` / ``set_mask`` / ``authorize`` / ``close``,
            ``frame_limit``); None: a split OPEN gets ERROR ``split``.

    Raises ``ValueError`` for out-of-range settings, or no ``identity`` / ``authorized``
    without ``insecure_anonymous``.
    """

    def __init__(self, target, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 8,
                 max_wait_ms: float = 100.0, max_sessions: int = 64,
                 handshake_timeout_s: float = 10.0, max_connections: int = 128,
                 idle_timeout_s: float = 300.0, max_frame_bytes: int = P.MAX_REQUEST_BYTES,
                 max_pending: int = 4, max_queue: int = 256, health_token: str | None = None,
                 identity: Identity | None = None, authorized: TrustStore | None = None,
                 max_handshakes: int | None = None, insecure_anonymous: bool = False,
                 split=None):
        if not insecure_anonymous and (not isinstance(identity, Identity)
                                       or not isinstance(authorized, TrustStore)):
            raise ValueError("the cloud service needs its identity and its authorized devices "
                             "(insecure_anonymous=True is for the benchmark only)")
        if max_handshakes is None:
            max_handshakes = min(32, max_connections)
        if not 1 <= max_handshakes <= max_connections:
            raise ValueError(f"max_handshakes must be in 1..max_connections ({max_connections}), "
                             f"got {max_handshakes}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not (handshake_timeout_s > 0 and idle_timeout_s > 0):
            raise ValueError(f"handshake_timeout_s and idle_timeout_s must be > 0, got "
                             f"{handshake_timeout_s} and {idle_timeout_s}")
        if not P.MAX_FIRST_MESSAGE_BYTES <= max_frame_bytes <= P.MAX_MESSAGE_BYTES:
            raise ValueError(f"max_frame_bytes must be in {P.MAX_FIRST_MESSAGE_BYTES}.."
                             f"{P.MAX_MESSAGE_BYTES}, got {max_frame_bytes}")
        if max_pending < 1 or max_queue < 1:
            raise ValueError(f"max_pending and max_queue must be >= 1, got {max_pending} and "
                             f"{max_queue}")
        self.target = target
        self.split = split
        self.host = host
        self.requested_port = int(port)
        self.port: int | None = None  # the bound port, once listening
        self.max_batch = int(max_batch)
        self.max_wait_ms = float(max_wait_ms)
        self.max_sessions = int(max_sessions)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.max_connections = int(max_connections)
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_frame_bytes = int(max_frame_bytes)
        self.max_pending = int(max_pending)
        self.max_queue = int(max_queue)
        self._health_token = health_token.encode() if health_token else None
        self.identity = identity
        self.authorized = authorized
        self.max_handshakes = int(max_handshakes)
        self.insecure_anonymous = bool(insecure_anonymous)
        self._handshaking = 0  # event loop: connections accepted and not yet authenticated

        self._queue: queue.Queue = queue.Queue()
        self._queued = 0  # event loop: counted items queued and not answered
        self._waiting: set[_Conn] = set()  # event loop: connections waiting for a queue slot
        self._pending: collections.deque = collections.deque()  # worker-only: deferred items
        self._lock = threading.Lock()  # guards the counters and _live
        self._live: set[_Session] = set()  # sessions holding (or about to hold) a cache slot
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_evt: asyncio.Event | None = None
        self._stop_requested = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        self._started_at: float | None = None
        self._c = collections.Counter()  # counters, see stats()
        self._batch_hist: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------------------ status

    _COUNTERS = ("sessions_total", "connections_total", "jobs_dropped", "frames_rejected",
                 "protocol_errors", "busy_refusals", "health_probes", "health_auth_failures",
                 "connections_refused", "idle_closed", "handshake_timeouts", "frames_oversized",
                 "backpressure_waits", "queued_max", "limit_refusals", "batch_waits",
                 "batch_wait_timeouts", "auth_failures", "handshakes_refused",
                 "devices_authenticated", "split_sessions_total", "split_refusals",
                 "split_batches", "split_jobs", "split_head_jobs", "split_mask_jobs",
                 "split_bytes_in", "split_bytes_out", "prefill_chunks", "prefill_interleaved_batches",
                 "integrity_closes")

    def stats(self) -> dict:
        """Counters since start: ``sessions_open`` (holding a cache slot now),
        ``sessions_total``, ``connections_open``, ``connections_total``, ``batches``
        (``target.step`` calls), ``jobs`` (VERIFY/FUSE run), ``jobs_dropped`` (session
        closed before its turn), ``mean_batch_size`` (jobs / batches), ``max_batch_size``,
        ``batch_sizes`` ({size: count}), ``frames_rejected`` (frames that failed to open),
        ``protocol_errors`` (plaintexts that failed to parse, misplaced messages),
        ``integrity_closes`` (connections closed because an authentic frame arrived after a
        gap: a genuine frame of the device was altered or dropped in transit),
        ``busy_refusals``, ``auth_failures`` (IDENTIFY missing, unknown or not verifying),
        ``handshakes_refused`` (a hello of the other authentication mode),
        ``devices_authenticated``, ``health_probes``, ``health_auth_failures`` (probes with a wrong
        token), ``bytes_in`` / ``bytes_out`` (bytes on the sockets of closed connections
        plus open ones, length prefixes included); the limits' counters:
        ``connections_refused`` (over ``max_connections`` or ``max_handshakes``), ``idle_closed`` (connections
        closed by ``idle_timeout_s``), ``handshake_timeouts``, ``frames_oversized``
        (announced over the frame cap), ``backpressure_waits`` (a connection not read
        because its or the total queue was full), ``queued`` / ``queued_max`` (requests
        waiting for the worker now / at most so far), ``limit_refusals`` (ERROR ``limit`` answers), ``batch_waits`` (times the
        batcher blocked for a job that could still join), ``batch_wait_timeouts`` (of those,
        ended by ``max_wait_ms`` with nothing), ``batch_wait_ms`` (time spent so, ms) and the
        target's ``forward_tokens_max`` (the most token rows one forward pass fed; None if
        the target does not count); split inference: ``split_sessions_total``,
        ``split_refusals`` (split OPENs answered ERROR ``split``), ``split_batches`` /
        ``split_jobs`` (middle forwards' ``step`` calls, MID jobs run), ``split_head_jobs``,
        ``split_mask_jobs``, ``split_bytes_in`` / ``split_bytes_out`` (activation and
        partial-logit payload bytes of MID / HEAD in and MIDOUT / LOGITS out), and the split
        target's ``split_rebuild_rows`` (window rows fed again: re-sent or KV dropped)."""
        with self._lock:
            c = dict(self._c)
            hist = dict(sorted(self._batch_hist.items()))
            live = len(self._live)
        conns = list(self._conns)
        batches = c.get("batches", 0)
        jobs = c.get("jobs", 0)
        out = {
            "sessions_open": live,
            "connections_open": len(conns),
            "batches": batches,
            "jobs": jobs,
            "mean_batch_size": (jobs / batches) if batches else 0.0,
            "max_batch_size": max(hist) if hist else 0,
            "batch_sizes": {str(k): v for k, v in hist.items()},
            "bytes_in": c.get("bytes_in", 0) + sum(x.bytes_in for x in conns),
            "bytes_out": c.get("bytes_out", 0) + sum(x.bytes_out for x in conns),
            "queued": self._queued,
            "batch_wait_ms": round(c.get("batch_wait_us", 0) / 1000.0, 3),
            "forward_tokens_max": getattr(self.target, "forward_tokens_max", None),
            "split_rebuild_rows": getattr(self.split, "rebuild_rows", None),
        }
        out.update({k: c.get(k, 0) for k in self._COUNTERS})
        return out

    def health(self, authenticated: bool = False) -> dict:
        """The health answer. For anyone: ``status`` (``ok`` / ``stopping``), ``model``,
        ``context_len``, ``sessions_open``, ``connections_open``, ``queue_depth`` (requests
        waiting for the worker), ``uptime_s`` (seconds) and ``authenticated``. With
        ``authenticated`` (a probe carrying the health token) also ``fingerprint``,
        ``pid``, the limits (``max_batch``, ``max_wait_ms``, ``max_sessions``,
        ``max_connections``, ``max_handshakes``, ``authentication`` (``sigma-i`` or
        ``anonymous``), ``idle_timeout_s``, ``handshake_timeout_s``, ``max_frame_bytes``, ``max_pending``, ``max_queue``, the target's ``max_draft`` and
        ``max_batch_tokens``) and every :meth:`stats` counter."""
        with self._lock:
            live = len(self._live)
        out = {
            "status": "stopping" if self._stop_requested else "ok",
            "model": str(getattr(self.target, "name", "?")),
            "context_len": int(getattr(self.target, "context_len", 0)),
            "sessions_open": live,
            "connections_open": len(self._conns),
            "queue_depth": self._queue.qsize() + len(self._pending),
            "uptime_s": round(time.monotonic() - self._started_at, 3) if self._started_at else 0.0,
            "authenticated": bool(authenticated),
        }
        if authenticated:
            out.update({
                "fingerprint": str(getattr(self.target, "fingerprint", "?")),
                "pid": os.getpid(),
                "max_batch": self.max_batch, "max_wait_ms": self.max_wait_ms,
                "max_sessions": self.max_sessions, "max_connections": self.max_connections,
                "max_handshakes": self.max_handshakes,
                "authentication": "anonymous" if self.insecure_anonymous else "sigma-i",
                "idle_timeout_s": self.idle_timeout_s,
                "handshake_timeout_s": self.handshake_timeout_s,
                "max_frame_bytes": self.max_frame_bytes, "max_pending": self.max_pending,
                "max_queue": self.max_queue,
                "max_draft": getattr(self.target, "max_draft", None),
                "max_batch_tokens": getattr(self.target, "max_batch_tokens", None),
                "prefill_chunk": getattr(self.target, "prefill_chunk", None),
                "row_padding": (self.target.padding.summary() if hasattr(self.target, "padding")
                                else None),
                "split": self.split is not None,
            })
            out.update(self.stats())
        return out

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._c[key] += n

    # --------------------------------------------------------------------- run / stop

    def start_in_thread(self, timeout_s: float = 10.0) -> int:
        """Serve from a background thread; returns the bound port once listening.
        Raises ``TimeoutError`` if not listening within ``timeout_s`` seconds, or the
        startup error (e.g. ``OSError`` for a port in use)."""
        if self._thread is not None:
            raise RuntimeError("service already started")
        ready = threading.Event()
        errors: list[BaseException] = []

        def run():
            try:
                asyncio.run(self._serve(ready.set, install_signals=False))
            except BaseException as exc:  # noqa: BLE001 - reported to the starter
                errors.append(exc)
                log.exception("cloud service thread failed")
                ready.set()

        self._thread = threading.Thread(target=run, name="edgefuse-cloud-loop", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"cloud service not listening after {timeout_s} s")
        if errors:
            raise errors[0]
        return self.port

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the calling (main) thread until SIGINT/SIGTERM or :meth:`stop`;
        ``on_ready`` is called once listening. Shuts down gracefully."""
        asyncio.run(self._serve(on_ready or (lambda: None), install_signals=True))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful shutdown: stop accepting, close every connection (a device waiting for
        an answer sees the connection drop), close every session, finish the worker.
        Idempotent; callable from any thread but the event loop's. Waits up to
        ``timeout_s`` seconds."""
        self._stop_requested = True
        loop, evt = self._loop, self._stop_evt
        if loop is not None and evt is not None:
            try:
                loop.call_soon_threadsafe(evt.set)
            except RuntimeError:  # loop already closed
                pass
            self._stopped.wait(timeout_s)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    async def _serve(self, on_ready: Callable[[], None], install_signals: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_evt = asyncio.Event()
        if self._stop_requested:
            self._stop_evt.set()
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        server = await asyncio.start_server(self._handle, self.host, self.requested_port)
        self.port = server.sockets[0].getsockname()[1]
        self._started_at = time.monotonic()
        self._worker = threading.Thread(target=self._work, name="edgefuse-cloud-worker", daemon=True)
        self._worker.start()
        log.info("cloud service for %s listening on %s:%d (max_batch=%d, max_wait_ms=%g, "
                 "max_sessions=%d, max_connections=%d, idle_timeout_s=%g, max_frame_bytes=%d)",
                 getattr(self.target, "name", "?"), self.host, self.port, self.max_batch,
                 self.max_wait_ms, self.max_sessions, self.max_connections, self.idle_timeout_s,
                 self.max_frame_bytes)
        reaper = asyncio.create_task(self._reap_idle())
        try:
            on_ready()
            await self._stop_evt.wait()
        finally:
            reaper.cancel()
            await self._shutdown(server)

    async def _reap_idle(self) -> None:
        """Close every connection idle for ``idle_timeout_s`` (no valid message in, no answer
        out, no request waiting for the worker); checks a few times per timeout."""
        every = min(self.idle_timeout_s / 4, 1.0)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for conn in list(self._conns):
                if (conn.secure is not None and not conn.closed and conn.pending == 0
                        and now - conn.last_active >= self.idle_timeout_s):
                    conn.idle = True
                    log.info("connection %d from %s: idle for %.1f s; closing", conn.id,
                             conn.peer, now - conn.last_active)
                    conn.writer.close()  # its handler reads EOF and frees the session

    def _on_signal(self, sig: int) -> None:
        log.info("cloud service: %s received, shutting down", signal.Signals(sig).name)
        self._stop_requested = True
        self._stop_evt.set()

    async def _shutdown(self, server: asyncio.AbstractServer) -> None:
        self._stop_requested = True
        server.close()
        await server.wait_closed()
        for conn in list(self._conns):
            conn.writer.close()  # the handler's read sees EOF and frees its session
        tasks = set(self._tasks)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=5.0)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        self._queue.put(_STOP)
        if self._worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._worker.join, 30.0)
            if self._worker.is_alive():
                log.error("cloud worker did not finish within 30 s")
        s = self.stats()
        log.info("cloud service stopped: %d sessions, %d batches, %d jobs (mean batch %.2f), "
                 "%d frames rejected, %d B in, %d B out", s["sessions_total"], s["batches"],
                 s["jobs"], s["mean_batch_size"], s["frames_rejected"], s["bytes_in"], s["bytes_out"])
        self._stopped.set()

    # ------------------------------------------------------------------ connections

    async def _read(self, reader: asyncio.StreamReader, conn: _Conn, limit: int) -> bytes:
        """One framed message body of at most ``limit`` bytes; the length is checked from the
        prefix before any of the body is read. Raises :class:`MessageTooLarge`,
        :class:`PeerClosed`."""
        try:
            (n,) = _PREFIX.unpack(await reader.readexactly(P.LENGTH_PREFIX_BYTES))
            conn.bytes_in += P.LENGTH_PREFIX_BYTES
            if n > limit:
                self._count("frames_oversized")
                raise MessageTooLarge(f"peer announced a {n}-byte message; this service accepts "
                                      f"at most {limit} bytes here")
            body = await reader.readexactly(n) if n else b""
        except asyncio.IncompleteReadError as exc:
            where = "between messages" if not exc.partial else "mid-message"
            raise PeerClosed(f"connection closed by peer ({where})") from None
        conn.bytes_in += n
        return body

    async def _room(self, conn: _Conn) -> None:
        """Wait until ``conn`` may queue one more request (``max_pending`` of its own,
        ``max_queue`` in all): until then its socket is not read."""
        if conn.pending < self.max_pending and self._queued < self.max_queue:
            return
        self._count("backpressure_waits")
        self._waiting.add(conn)
        try:
            while not (conn.pending < self.max_pending and self._queued < self.max_queue):
                conn.room.clear()
                await conn.room.wait()
        finally:
            self._waiting.discard(conn)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         conn: _Conn):
        """The connection's first messages: answer a health probe (returns None), or do the
        handshake (:mod:`edgefuse.cloud.wire`) and return the :class:`SecureSession` once the
        device's IDENTIFY verified; None for a refused hello or device (refused with ERROR
        ``unauthorized`` where a key exists to seal it). Raises :class:`PeerClosed`,
        :class:`MessageTooLarge`, :class:`edgefuse.cloud.protocol.ProtocolError` (not a hello),
        :class:`HandshakeError` (a bad ephemeral key)."""
        first = await self._read(reader, conn, P.MAX_FIRST_MESSAGE_BYTES)
        if is_health_probe(first):
            conn.kind = "health probe"
            self._count("health_probes")
            token = health_probe_token(first)
            ok = self._health_token is not None and hmac.compare_digest(token, self._health_token)
            if token and not ok:
                self._count("health_auth_failures")
            conn.bytes_out += write_message(writer, encode_health(self.health(ok)))
            await writer.drain()
            return None
        anonymous = hello_is_anonymous(first)
        if anonymous != self.insecure_anonymous:
            self._count("handshakes_refused")
            log.warning("connection %d from %s: %s hello refused: this service speaks only the "
                        "%s handshake; closing", conn.id, conn.peer,
                        "an anonymous" if anonymous else "an authenticated",
                        "anonymous" if self.insecure_anonymous else "authenticated (SIGMA-I)")
            return None
        peer_key, sid = decode_hello(first)
        own = generate_keypair()
        if anonymous:
            secure = derive_session(own, peer_key, sid, initiator=False)
            conn.bytes_out += write_message(writer, encode_welcome(own.public_bytes()))
            return secure
        welcome = encode_signed_welcome(self.identity, first, own.public_bytes())
        th = session_transcript(first, welcome)
        secure = derive_session(own, peer_key, sid, initiator=False, transcript=th)
        conn.bytes_out += write_message(writer, welcome)
        await writer.drain()
        body = await self._read(reader, conn, P.MAX_FIRST_MESSAGE_BYTES)
        conn.secure = secure  # to seal the ERROR of a refusal
        try:
            plain = secure.open(body)
        except FrameError as exc:
            conn.frames_rejected += 1
            self._count("frames_rejected")
            return await self._refuse(conn, f"the first frame does not open "
                                            f"({type(exc).__name__}: {exc})", send=False)
        try:
            msg = P.decode(plain)
        except P.ProtocolError as exc:
            return await self._refuse(conn, f"bad IDENTIFY: {exc}")
        if not isinstance(msg, P.Identify):
            return await self._refuse(conn, f"{P.message_type(plain)} before IDENTIFY: this cloud "
                                            "serves authenticated devices only")
        try:
            conn.device = check_identify(msg, th, self.authorized)
        except IdentityError as exc:
            return await self._refuse(conn, str(exc))
        self._count("devices_authenticated")
        log.info("connection %d from %s: device %s authenticated (session id %s)", conn.id,
                 conn.peer, conn.device, sid.hex()[:8])
        return secure

    async def _refuse(self, conn: _Conn, why: str, send: bool = True) -> None:
        """Refuse an unauthenticated connection: count it, log ``why``, answer ERROR
        ``unauthorized`` (``send``; a frame that did not open gets no answer) and return None
        (the caller closes the connection)."""
        self._count("auth_failures")
        log.warning("connection %d from %s: unauthorized: %s; closing", conn.id, conn.peer, why)
        if send:
            conn.send(P.Error("unauthorized", why))
            await conn.writer.drain()
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (len(self._conns) >= self.max_connections
                or self._handshaking >= self.max_handshakes):  # before anything is read or computed
            self._count("connections_refused")
            log.warning("connection from %s refused: %d connections open (max %d), %d not yet "
                        "authenticated (max %d)", writer.get_extra_info("peername"),
                        len(self._conns), self.max_connections, self._handshaking,
                        self.max_handshakes)
            writer.close()
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        conn = _Conn(next(self._ids), writer.get_extra_info("peername"), writer)
        self._conns.add(conn)
        self._count("connections_total")
        self._handshaking += 1
        try:
            try:
                secure = await asyncio.wait_for(self._handshake(reader, writer, conn),
                                                self.handshake_timeout_s)
            except asyncio.TimeoutError:
                self._count("handshake_timeouts")
                log.warning("connection %d from %s: handshake not done within %g s; closing",
                            conn.id, conn.peer, self.handshake_timeout_s)
                return
            finally:
                self._handshaking -= 1
            if secure is None:
                return
            conn.secure = secure
            conn.last_active = time.monotonic()
            while True:
                await self._room(conn)
                body = await self._read(reader, conn, conn.frame_limit or self.max_frame_bytes)
                try:
                    plain = secure.open(body)
                except ReorderError as exc:  # an authentic frame after a gap: frames were lost
                    conn.frames_rejected += 1
                    self._count("frames_rejected")
                    self._count("integrity_closes")
                    log.warning("connection %d: %s; closing", conn.id, exc)
                    conn.send(P.Error("integrity", "frames of this connection were altered or dropped "
                                                   "in transit; closing it (open a new one)"))
                    await writer.drain()
                    return
                except FrameError as exc:
                    conn.frames_rejected += 1
                    self._count("frames_rejected")
                    log.warning("connection %d: rejected frame (%s): %s", conn.id,
                                type(exc).__name__, exc)
                    continue
                conn.messages_in += 1
                conn.last_active = time.monotonic()
                try:
                    msg = P.decode(plain)
                except P.ProtocolError as exc:
                    self._count("protocol_errors")
                    log.warning("connection %d: bad %s message: %s", conn.id,
                                P.message_type(plain), exc)
                    conn.send(P.Error("protocol", str(exc)))
                else:
                    self._dispatch(conn, msg)
                await writer.drain()
        except PeerClosed as exc:
            log.debug("connection %d: %s", conn.id, exc)
        except (P.ProtocolError, HandshakeError) as exc:
            log.warning("connection %d from %s: %s; closing", conn.id, conn.peer, exc)
        except OSError as exc:
            log.info("connection %d: %s", conn.id, exc)
        finally:
            conn.closed = True
            if conn.idle:
                self._count("idle_closed")
            sess, conn.current = conn.current, None
            if sess is not None:
                sess.closed = True
                self._queue.put(_Item("close", sess))
            self._conns.discard(conn)
            with self._lock:
                self._c["bytes_in"] += conn.bytes_in
                self._c["bytes_out"] += conn.bytes_out
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - already gone
                pass
            level = logging.DEBUG if conn.kind == "health probe" else logging.INFO
            log.log(level, "%s %d closed: %d B in, %d B out, %d messages in, %d out, "
                    "%d frames rejected", conn.kind, conn.id, conn.bytes_in, conn.bytes_out,
                    conn.messages_in, conn.messages_out, conn.frames_rejected)
            self._tasks.discard(task)

    def _enqueue(self, conn: _Conn, item: _Item) -> None:
        """Queue a request for the worker; it holds one of ``conn``'s slots until answered."""
        item.t, item.counted = time.monotonic(), True
        conn.pending += 1
        self._queued += 1
        with self._lock:
            self._c["queued_max"] = max(self._c["queued_max"], self._queued)
        self._queue.put(item)

    def _answer(self, sess: _Session, msg: P.Message | None, clear: bool = False) -> None:
        """A counted request of ``sess`` is done (event loop): free its slot, send ``msg``
        unless the session is closed (``clear``: an OPEN that failed, sent anyway, and the
        connection has no session any more)."""
        conn = sess.conn
        conn.pending -= 1
        self._queued -= 1
        conn.last_active = time.monotonic()
        if clear:
            if conn.current is sess:
                conn.current = None
            if msg is not None:
                conn.send(msg)
        elif msg is not None and not sess.closed:
            conn.send(msg)
        conn.room.set()
        if self._queued < self.max_queue:
            for other in list(self._waiting):
                other.room.set()

    def _dispatch(self, conn: _Conn, msg: P.Message) -> None:
        """Route one decoded request (event-loop thread). A split session takes MID / HEAD /
        MASK and a plain one VERIFY / FUSE, each the other's with ERROR ``protocol``."""
        if isinstance(msg, P.Open):
            if conn.current is not None:
                self._count("protocol_errors")
                conn.send(P.Error("protocol", "a session is already open on this connection; "
                                              "CLOSE it first"))
                return
            if msg.split is not None and self.split is None:
                self._count("split_refusals")
                conn.send(P.Error("split", "this cloud serves no split inference"))
                return
            with self._lock:
                if len(self._live) >= self.max_sessions:
                    self._c["busy_refusals"] += 1
                    busy = True
                else:
                    busy = False
                    sess = _Session(next(self._ids), conn)
                    self._live.add(sess)
                    self._c["sessions_total"] += 1
            if busy:
                log.warning("connection %d: OPEN refused, %d sessions open (max %d)", conn.id,
                            self.max_sessions, self.max_sessions)
                conn.send(P.Error("busy", f"the cloud has {self.max_sessions} sessions open "
                                          f"(its maximum); retry later"))
                return
            conn.current = sess
            if msg.split is not None:
                sess.split = True
                # a MID of max_context rows must fit: the cap follows the session's encoding
                conn.frame_limit = max(self.max_frame_bytes, int(self.split.frame_limit(msg.split)))
            self._enqueue(conn, _Item("open", sess, msg))
        elif isinstance(msg, (P.Verify, P.Fuse, P.Auth, P.Mid, P.Head, P.Mask)):
            name = type(msg).__name__.upper()
            if conn.current is None:
                self._count("protocol_errors")
                conn.send(P.Error("protocol", f"{name} before OPEN: no "
                                              f"session is open on this connection"))
                return
            split_msg = isinstance(msg, (P.Mid, P.Head, P.Mask))
            if not isinstance(msg, P.Auth) and split_msg != conn.current.split:
                self._count("protocol_errors")
                conn.send(P.Error("protocol", f"{name} in a {'split' if conn.current.split else 'plain'}"
                                              f" session (split sessions take MID / HEAD / "
                                              f"MASK, plain ones VERIFY / FUSE)"))
                return
            kind = ("auth" if isinstance(msg, P.Auth) else "mid" if isinstance(msg, P.Mid)
                    else "head" if isinstance(msg, P.Head) else "mask" if isinstance(msg, P.Mask)
                    else "job")
            self._enqueue(conn, _Item(kind, conn.current, msg))
        elif isinstance(msg, P.Close):
            sess, conn.current = conn.current, None
            conn.frame_limit = None
            if sess is not None:
                sess.closed = True
                self._queue.put(_Item("close", sess))
        elif isinstance(msg, P.Identify):
            self._count("protocol_errors")
            conn.send(P.Error("protocol", "IDENTIFY is the handshake's: only as the first frame"))
        else:
            self._count("protocol_errors")
            conn.send(P.Error("protocol", f"{type(msg).__name__.upper()} is a cloud→device "
                                          f"message"))

    # ----------------------------------------------------------------------- worker

    def _post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the event loop (from the worker)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: nobody to answer
            pass

    def _reply(self, item: _Item, msg: P.Message | None, clear: bool = False) -> None:
        """Answer a counted item once (worker): ``msg`` (None: nothing to send) goes out on
        the event loop, which frees the item's queue slot."""
        if item.answered or not item.counted:
            return
        item.answered = True
        item.sess.answered_at = time.monotonic()
        if isinstance(msg, P.Error) and msg.code == "limit":
            self._count("limit_refusals")
        self._post(self._answer, item.sess, msg, clear)

    def _next_item(self, deadline: float | None):
        """The next item: deferred ones first; then the queue (blocking when ``deadline`` is
        None, else until the deadline; past it, only what is already queued)."""
        if self._pending:
            return self._pending.popleft()
        try:
            if deadline is None:
                return self._queue.get()
            remaining = deadline - time.monotonic()
            return self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _work(self) -> None:
        while True:
            item = self._next_item(None)
            if item is _STOP:
                break
            try:
                if item.kind in ("job", "mid"):
                    self._run_batch(item)
                elif item.kind == "open":
                    self._open(item)
                elif item.kind == "auth":
                    self._authorize(item)
                elif item.kind in ("head", "mask"):
                    self._split_single(item)
                else:
                    self._free(item.sess)
            except Exception as exc:  # noqa: BLE001 - keep serving the other sessions
                log.exception("cloud worker: unexpected error on a %s item", item.kind)
                self._reply(item, P.Error("internal", f"{type(exc).__name__}: {exc}"))
        with self._lock:
            left = list(self._live)
        for sess in left:
            sess.closed = True
            self._free(sess)

    def _open(self, item: _Item) -> None:
        sess = item.sess
        if sess.closed:
            self._free(sess)
            self._reply(item, None)
            return
        t0 = time.perf_counter()
        runner = self.split if sess.split else self.target
        try:
            sess.target = runner.open(item.msg)
            chunks = self._prefill_chunked(runner, sess)
        except Exception as exc:  # noqa: BLE001
            from edgefuse.cloud.target import SessionError

            if isinstance(exc, SessionError):
                if exc.code == "split":
                    self._count("split_refusals")
                err = P.Error(exc.code, str(exc))
                log.info("session %d (connection %d): OPEN refused [%s]: %s", sess.id,
                         sess.conn.id, exc.code, exc)
            else:
                err = P.Error("internal", f"target.open failed: {type(exc).__name__}: {exc}")
                log.exception("session %d: target.open failed", sess.id)
            sess.failed = True
            if sess.target is not None:  # opened, then a prefill chunk failed: nothing is served
                try:
                    runner.close(sess.target)
                except Exception:  # noqa: BLE001
                    log.exception("session %d: target.close failed", sess.id)
                sess.target = None
            with self._lock:
                self._live.discard(sess)
            if sess.split:
                self._post(self._reset_frame_limit, sess)
            self._reply(item, err, clear=True)
            return
        if sess.closed:  # disconnected during the prefill
            self._free(sess)
            self._reply(item, None)
            return
        log.info("session %d (connection %d, device %s) open: %d prompt tokens, prefill %.1f ms%s%s",
                 sess.id, sess.conn.id, sess.conn.device or "anonymous", len(item.msg.prompt),
                 (time.perf_counter() - t0) * 1e3, f", split {item.msg.split}" if sess.split else "",
                 f", {chunks} chunks" if chunks > 1 else "")
        if sess.split:
            self._count("split_sessions_total")
        self._reply(item, P.Opened(str(runner.name), str(runner.fingerprint),
                                   int(runner.context_len), item.msg.split))

    def _prefill_chunked(self, runner, sess: _Session) -> int:
        """A chunked prefill (``runner.prefill_chunk`` > 0, :meth:`Target.prefill_step`):
        between chunks, one batch of the decode jobs waiting runs. Every item waiting (the
        deferred ones first, then the queue) is taken in order; a job runs now only if it is
        its session's first waiting item (its OPEN, AUTH or an earlier job are not overtaken)
        and not this session's own (its answer must follow OPENED); everything else goes back,
        in order, to wait for after this OPEN. Split MID jobs wait too. Returns the chunks."""
        step = getattr(runner, "prefill_step", None)
        chunks = 0
        while step is not None and not sess.closed and runner.prefill_left(sess.target) > 0:
            left = step(sess.target)
            chunks += 1
            self._count("prefill_chunks")
            if left <= 0:
                break
            waiting = list(self._pending)
            self._pending.clear()
            while True:
                try:
                    waiting.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            seen, batch, rest = {sess}, [], []
            for it in waiting:
                first = it is not _STOP and it.sess not in seen
                if it is not _STOP:
                    seen.add(it.sess)
                if first and it.kind == "job" and len(batch) < self.max_batch:
                    self._take(it)
                    batch.append(it)
                else:
                    rest.append(it)
            self._pending.extend(rest)
            if batch:
                self._count("prefill_interleaved_batches")
                try:
                    self._step(batch)
                finally:
                    for it in batch:  # whatever went wrong, every job frees its slot
                        self._reply(it, None)
        return chunks

    def _reset_frame_limit(self, sess: _Session) -> None:
        """A split OPEN failed (event loop): its connection's frame cap is the service's again."""
        if sess.conn.current is None or sess.conn.current is sess:
            sess.conn.frame_limit = None

    def _ready(self, item: _Item) -> bool:
        """Whether ``item``'s session can run it (worker); if not, it is answered here: nothing
        for a closed session, ERROR protocol for one whose OPEN failed."""
        sess = item.sess
        if sess.closed:
            self._reply(item, None)
            return False
        if sess.target is None:  # its OPEN failed
            self._count("protocol_errors")
            self._reply(item, P.Error("protocol", "no open session (OPEN failed)"))
            return False
        return True

    def _split_single(self, item: _Item) -> None:
        """Run one HEAD or MASK of a split session (worker) and answer it."""
        sess = item.sess
        if not self._ready(item):
            return
        from edgefuse.cloud.target import SessionError

        try:
            if item.kind == "head":
                reply = self.split.head(sess.target, item.msg)
                self._count("split_head_jobs")
                self._count("split_bytes_in", len(item.msg.acts))
                self._count("split_bytes_out", len(reply.payload))
            else:
                reply = self.split.set_mask(sess.target, item.msg)
                self._count("split_mask_jobs")
        except SessionError as exc:
            reply = P.Error(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001
            log.exception("session %d: split %s failed", sess.id, item.kind)
            reply = P.Error("internal", f"split {item.kind} failed: {type(exc).__name__}: {exc}")
        sess.jobs += 1
        self._reply(item, reply)

    def _authorize(self, item: _Item) -> None:
        """Apply an AUTH (evicting at once), then answer AUTHED with the tokens held."""
        sess = item.sess
        if not self._ready(item):
            return
        from edgefuse.cloud.target import SessionError

        try:
            runner = self.split if sess.split else self.target
            reply = P.Authed(int(runner.authorize(sess.target, item.msg.auth)))
        except SessionError as exc:
            reply = P.Error(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001
            log.exception("session %d: target.authorize failed", sess.id)
            reply = P.Error("internal", f"target.authorize failed: {type(exc).__name__}: {exc}")
        log.info("session %d (connection %d): cache tuple %s", sess.id, sess.conn.id, item.msg.auth)
        self._reply(item, reply)

    def _free(self, sess: _Session) -> None:
        ts, sess.target = sess.target, None
        if ts is not None:
            try:
                (self.split if sess.split else self.target).close(ts)
            except Exception:  # noqa: BLE001
                log.exception("session %d: target.close failed", sess.id)
        with self._lock:
            was_live = sess in self._live
            self._live.discard(sess)
        if was_live:
            c = sess.conn
            log.info("session %d (connection %d) closed after %d jobs: %d B in, %d B out so far",
                     sess.id, c.id, sess.jobs, c.bytes_in, c.bytes_out)

    def _could_join(self, in_batch: set, blocked: set, split: bool = False) -> bool:
        """Whether a session not yet in the batch may still send a job the batch can take:
        open, of the batch's kind (``split``: MID jobs, else VERIFY / FUSE), not deferred, and
        answered within about its own round (twice its last gap between an answer and its
        next request, plus ``max_wait_ms``; a session with no gap yet: three times
        ``max_wait_ms``). An idle session is not waited for."""
        wait_s = self.max_wait_ms / 1000.0
        now = time.monotonic()
        with self._lock:
            live = list(self._live)
        for sess in live:
            if sess in in_batch or sess in blocked or sess.closed or sess.target is None \
                    or sess.answered_at is None or sess.split != split:
                continue
            gap = sess.gap if sess.gap is not None else wait_s
            if now - sess.answered_at <= 2 * gap + wait_s:
                return True
        return False

    def _take(self, item: _Item) -> None:
        """A job enters a batch (worker): note its session's gap since its last answer."""
        sess = item.sess
        if sess.answered_at is not None:
            sess.gap = max(item.t - sess.answered_at, 0.0)

    def _run_batch(self, first: _Item) -> None:
        """Batch ``first`` with queued jobs of its own kind (VERIFY / FUSE, or MID: never
        mixed in one forward) of other sessions, then run them."""
        batch, in_batch, blocked, deferred = [first], {first.sess}, set(), []
        self._take(first)
        t_start = time.monotonic()
        deadline = t_start + self.max_wait_ms / 1000.0
        while len(batch) < self.max_batch:
            with self._lock:
                if len(in_batch) >= len(self._live):
                    break  # every open session is in: nobody else can add a job
            wait = self._could_join(in_batch, blocked, first.kind == "mid")
            if wait and not self._pending and self._queue.empty():
                self._count("batch_waits")
                t0 = time.perf_counter()
                item = self._next_item(deadline)
                self._count("batch_wait_us", int((time.perf_counter() - t0) * 1e6))
                if item is None:
                    self._count("batch_wait_timeouts")
            else:  # only what is already queued: nothing else could join in time
                item = self._next_item(deadline if wait else 0.0)
            if item is None:
                break
            if item is _STOP:
                deferred.append(item)
                break
            if item.kind != first.kind or item.sess in in_batch or item.sess in blocked:
                deferred.append(item)  # keep this session's order: it waits for the next batch
                blocked.add(item.sess)
                continue
            self._take(item)
            batch.append(item)
            in_batch.add(item.sess)
        self._pending.extendleft(reversed(deferred))
        try:
            self._step(batch)
        finally:
            for item in batch:  # whatever went wrong, every job frees its slot
                self._reply(item, None)

    def _step(self, batch: list[_Item]) -> None:
        """Run one batch's live jobs in one ``target.step`` and answer each."""
        run = []
        for item in batch:
            if item.sess.closed:
                self._count("jobs_dropped")
                self._reply(item, None)
            elif item.sess.target is None:  # its OPEN failed
                self._count("protocol_errors")
                self._reply(item, P.Error("protocol", "no open session (OPEN failed)"))
            else:
                run.append(item)
        if not run:
            return
        jobs = [(item.sess.target, item.msg) for item in run]
        mid = run[0].kind == "mid"
        t0 = time.perf_counter()
        try:
            replies = list((self.split if mid else self.target).step(jobs))
            if len(replies) != len(jobs):
                raise RuntimeError(f"target.step answered {len(replies)} of {len(jobs)} jobs")
        except Exception as exc:  # noqa: BLE001
            from edgefuse.cloud.target import SessionError

            if isinstance(exc, SessionError):
                err = P.Error(exc.code, str(exc))
            else:
                log.exception("target.step failed on a batch of %d", len(jobs))
                err = P.Error("internal", f"target.step failed: {type(exc).__name__}: {exc}")
            replies = [err] * len(jobs)
        ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self._c["batches"] += 1
            self._c["jobs"] += len(run)
            self._batch_hist[len(run)] += 1
            if mid:
                self._c["split_batches"] += 1
                self._c["split_jobs"] += len(run)
                self._c["split_bytes_in"] += sum(len(i.msg.acts) for i in run)
                self._c["split_bytes_out"] += sum(len(r.acts) for r in replies
                                                  if isinstance(r, P.MidOut))
        log.debug("batch of %d (%s) in %.1f ms", len(run),
                  ",".join(type(i.msg).__name__ for i in run), ms)
        for item, reply in zip(run, replies):
            item.sess.jobs += 1
            self._reply(item, reply)


# ------------------------------------------------------------------------ foreground / CLI

def serve(model: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, max_batch: int = 8,
          max_wait_ms: float = 100.0, max_sessions: int = 64, threads: int | None = None,
          max_context: int = 2048, port_file: str | None = None, max_connections: int = 128,
          idle_timeout_s: float = 300.0, handshake_timeout_s: float = 10.0,
          max_frame_bytes: int = P.MAX_REQUEST_BYTES, max_pending: int = 4, max_queue: int = 256,
          max_draft: int = 16, max_batch_tokens: int = 8192, max_handshakes: int | None = None,
          identity_path: str | os.PathLike | None = None,
          authorized_path: str | os.PathLike | None = None,
          insecure_anonymous: bool = False, split_policy: dict | None = None,
          prefill_chunk: int = 0, backend: str = "embedded", vllm_python: str | None = None,
          vllm_url: str | None = None, vllm_args: list[str] | None = None,
          row_padding: str | int = "auto") -> None:
    """Load ``model`` (an :mod:`edgefuse.models` name), build a :class:`edgefuse.cloud.target.Target`
    and serve until SIGINT/SIGTERM. ``threads``: torch CPU threads (None = torch default).
    ``port_file``: once listening, the bound port is written there (atomically). The limits
    are :class:`CloudService`'s and the target's (``max_draft``, ``max_batch_tokens``,
    ``prefill_chunk``); the
    health token is read from ``$EDGEFUSE_CLOUD_HEALTH_TOKEN`` (unset: none).
    ``identity_path`` / ``authorized_path``: the service's identity key and its authorized
    devices (:func:`load_service_keys`; both required unless ``insecure_anonymous``), loaded
    before the model. ``split_policy``: serve split inference under this
    ``cloud.service.split`` mapping (:meth:`edgefuse.cloud.split_target.SplitPolicy.from_config`:
    ``allowed``, ``head_split``, ``acts``); None: split OPENs get ERROR ``split``.
    ``backend``: ``embedded`` (the model in this process) or ``vllm``
    (:class:`edgefuse.cloud.vllm_target.VllmTarget`: the server at ``vllm_url``, or one this
    process starts with ``vllm_python`` over the model's folder, passing ``vllm_args`` such
    as ``--tensor-parallel-size 2``, and stops on exit; no split inference).
    ``row_padding``: how the embedded target pads a forward's rows
    (:func:`edgefuse.cloud.rows.row_padding_for`: ``auto`` measures this machine's costs
    once, cached beside the models; ``none``; an int m). Raises :class:`edgefuse.transport.identity.IdentityError` for keys that
    cannot be loaded, ``ModelSpecError`` / ``ModelFetchError`` for a model that cannot be
    loaded, ``ValueError`` for an out-of-range limit and ``OSError`` when the port cannot be
    bound."""
    import torch

    from edgefuse.cloud.rows import check_row_padding, row_padding_for
    from edgefuse.cloud.target import Target
    from edgefuse.models import cache_dir, load_model

    from edgefuse.cloud.split_target import SplitPolicy, SplitTarget

    policy = SplitPolicy.from_config(split_policy) if split_policy is not None else None
    identity = authorized = None
    if insecure_anonymous:
        log.warning("cloud service: ANONYMOUS handshake only (--insecure-anonymous): no device "
                    "or service is authenticated; for the benchmark's comparison only")
    else:
        identity, authorized = load_service_keys(identity_path, authorized_path)
        log.info("cloud identity %s; %d authorized devices", identity.fingerprint,
                 len(authorized.names()))
    if threads:
        torch.set_num_threads(int(threads))
    if backend not in BACKENDS:
        raise ValueError(f"unknown cloud backend {backend!r}; choose from {', '.join(BACKENDS)}")
    row_padding = check_row_padding(row_padding)
    t0 = time.perf_counter()
    engine = None
    if backend == "vllm":
        target, engine = _vllm_target(model, threads, max_context, max_draft, max_batch_tokens,
                                      vllm_python, vllm_url, vllm_args)
        model_obj = tok = None
        if policy is not None:
            log.warning("the vLLM backend serves no split inference: split OPENs get ERROR split")
            policy = None
    else:
        model_obj, tok = load_model(model)
        t1 = time.perf_counter()
        padding = row_padding_for(row_padding, model_obj, model, cache_dir())
        log.info("row padding %s in %.1f s: %s", padding.source, time.perf_counter() - t1,
                 padding.summary()["pad_to"] or "none")
        target = Target(model_obj, tok, model, max_context=max_context, max_draft=max_draft,
                        max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
                        row_padding=padding)
    log.info("model %s ready on %s in %.1f s (fingerprint %s, context %d)", model, backend,
             time.perf_counter() - t0, target.fingerprint, target.context_len)
    split = None
    if policy is not None:
        split = SplitTarget(model_obj, tok, model, policy, max_context=max_context,
                            max_batch_tokens=max_batch_tokens, row_padding=target.padding)
        log.info("split inference served: allowed %s, head split %s, acts %s", policy.allowed,
                 policy.head_split, ",".join(policy.acts))
    svc = CloudService(target, host, port, max_batch=max_batch, max_wait_ms=max_wait_ms,
                       max_sessions=max_sessions, max_connections=max_connections,
                       idle_timeout_s=idle_timeout_s, handshake_timeout_s=handshake_timeout_s,
                       max_frame_bytes=max_frame_bytes, max_pending=max_pending,
                       max_queue=max_queue, health_token=os.environ.get(HEALTH_TOKEN_ENV) or None,
                       identity=identity, authorized=authorized, max_handshakes=max_handshakes,
                       insecure_anonymous=insecure_anonymous, split=split)

    def ready():
        if port_file:
            tmp = Path(f"{port_file}.tmp")
            tmp.write_text(str(svc.port))
            os.replace(tmp, port_file)

    try:
        svc.serve_forever(on_ready=ready)
    finally:
        if engine is not None:
            engine.terminate()
            try:
                engine.wait(30)
            except subprocess.TimeoutExpired:
                engine.kill()


BACKENDS = ("embedded", "vllm")


def _vllm_target(model: str, threads, max_context: int, max_draft: int, max_batch_tokens: int,
                 python: str | None, url: str | None, args: list[str] | None):
    """``(VllmTarget, the vLLM process this started or None)`` for :func:`serve`.

    Raises ``ValueError`` when neither a server URL nor a vLLM interpreter is given, or the
    model has no folder a vLLM server can load (a tiny test model)."""
    import socket

    from edgefuse.cloud.vllm_target import VllmTarget, start_vllm_server, vllm_python_ok
    from edgefuse.models import get_spec, load_tokenizer, model_config, resolve_path

    tok, config = load_tokenizer(model), model_config(model)
    proc = None
    if url is None:
        why = vllm_python_ok(python)
        if why:
            raise ValueError(f"the vLLM backend needs --vllm-url or --vllm-python: {why}")
        spec = get_spec(model)
        if spec.tiny:
            raise ValueError(f"{model} is built in code: a vLLM server needs a model folder")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log.info("starting a vLLM server for %s with %s", model, python)
        proc, url = start_vllm_server(python, resolve_path(spec), model, port, threads=int(threads or 1),
                                      max_context=max_context, extra=list(args or []), timeout_s=1800)
    try:
        return VllmTarget(url, model, tok, config, model, max_context, max_draft=max_draft,
                          max_batch_tokens=max_batch_tokens), proc
    except Exception:
        if proc is not None:
            proc.kill()
        raise


def load_service_keys(identity_path: str | os.PathLike | None,
                      authorized_path: str | os.PathLike | None) -> tuple[Identity, TrustStore]:
    """The service's identity (an existing key file; never created here) and its authorized
    devices (an existing, non-empty store as :func:`edgefuse.transport.identity.provision`
    writes: ``<keys root>/cloud/identity.key`` and ``authorized_devices.json``).
    Raises :class:`IdentityError` for a path not given, a missing or malformed file, or a
    store that authorizes no device."""
    if identity_path is None or authorized_path is None:
        raise IdentityError("the cloud service needs --identity and --authorized-devices "
                            f"(e.g. <keys root>/cloud/{IDENTITY_FILE} and {AUTHORIZED_FILE})")
    identity = load_identity(identity_path)
    if not Path(authorized_path).exists():
        raise IdentityError(f"no authorized devices at {authorized_path} (provision the devices "
                            "first)")
    authorized = TrustStore.load(authorized_path)
    if not authorized.names():
        raise IdentityError(f"{authorized_path} authorizes no device")
    return identity, authorized


def default_service_keys(root: str | os.PathLike) -> tuple[Path, Path]:
    """``(identity path, authorized-devices path)`` of the cloud under keys root ``root``."""
    return cloud_dir(root) / IDENTITY_FILE, cloud_dir(root) / AUTHORIZED_FILE


LIMITS = {"max_handshakes": int, "max_connections": int, "idle_timeout_s": float,
          "handshake_timeout_s": float, "max_frame_bytes": int, "max_pending": int, "max_queue": int, "max_draft": int,
          "max_batch_tokens": int, "prefill_chunk": int,
          "row_padding": str}  # cloud.service.* keys passed through start_service_process


def service_limits(svc_cfg) -> dict:
    """The :data:`LIMITS` keyword arguments of :func:`start_service_process` from a
    ``cloud.service`` config node (a key it lacks keeps its default)."""
    return {k: cast(svc_cfg[k]) for k, cast in LIMITS.items() if k in svc_cfg}


def _log_tail(path: Path | None, nbytes: int = 4000) -> str:
    if path is None or not path.exists():
        return "(no log)"
    data = path.read_bytes()[-nbytes:]
    return data.decode(errors="replace")


def start_service_process(model: str, host: str = "127.0.0.1", port: int = 0, *,
                          max_batch: int = 8, max_wait_ms: float = 100.0, max_sessions: int = 64,
                          threads: int | None = 1, max_context: int = 2048,
                          log_path: str | os.PathLike | None = None, timeout_s: float = 120.0,
                          log_level: str = "INFO", python: str = sys.executable,
                          env: dict | None = None,
                          cache_dir: str | os.PathLike | None = None,
                          max_connections: int = 128, idle_timeout_s: float = 300.0,
                          handshake_timeout_s: float = 10.0,
                          max_frame_bytes: int = P.MAX_REQUEST_BYTES, max_pending: int = 4,
                          max_queue: int = 256, max_draft: int = 16,
                          max_batch_tokens: int = 8192, max_handshakes: int | None = None,
                          identity_path: str | os.PathLike | None = None,
                          authorized_path: str | os.PathLike | None = None,
                          insecure_anonymous: bool = False,
                          split_policy: dict | None = None,
                          prefill_chunk: int = 0, backend: str = "embedded",
                          vllm_python: str | None = None, vllm_url: str | None = None,
                          vllm_args: list[str] | None = None,
                          row_padding: str | int = "auto") -> tuple[subprocess.Popen, int]:
    """Start ``edgefuse cloud serve`` as a child process and wait until it answers a health
    check; returns ``(process, bound port)``. ``port=0`` picks a free port. The child's
    stdout+stderr go to ``log_path`` (appended; default: a temporary file), available as
    ``process.log_path``. The limits go to the child as ``--`` options (see
    :class:`CloudService`); a fresh random health token goes in its environment (never on its
    command line) and is ``process.health_token``: pass it to
    :func:`edgefuse.cloud.link.cloud_health` for the full counters.

    Raises :class:`ServiceStartError` (with the log tail) if the process exits first or does
    not answer within ``timeout_s`` seconds (the process is then stopped). ``cache_dir``: the
    model cache the child loads from (``None``: its own default resolution).
    ``identity_path`` / ``authorized_path``: the service's keys (``--identity`` /
    ``--authorized-devices``; None: the child's defaults under its keys root);
    ``insecure_anonymous``: ``--insecure-anonymous`` (the benchmark's "auth off" only);
    ``split_policy``: ``--split-policy JSON`` (see :func:`serve`; None: no split inference)."""
    from edgefuse.cloud.link import cloud_health
    from edgefuse.cloud.rows import check_row_padding

    workdir = Path(tempfile.mkdtemp(prefix="edgefuse-cloud-"))
    port_file = workdir / "port"
    log_file = Path(log_path) if log_path is not None else workdir / "service.log"
    cmd = [python, "-m", "edgefuse.cli", "cloud", "serve", "--model", model, "--host", host,
           "--port", str(port), "--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms),
           "--max-sessions", str(max_sessions), "--max-context", str(max_context),
           "--max-connections", str(max_connections), "--idle-timeout-s", str(idle_timeout_s),
           "--handshake-timeout-s", str(handshake_timeout_s),
           "--max-frame-bytes", str(max_frame_bytes), "--max-pending", str(max_pending),
           "--max-queue", str(max_queue), "--max-draft", str(max_draft),
           "--max-batch-tokens", str(max_batch_tokens), "--prefill-chunk", str(prefill_chunk),
           "--row-padding", check_row_padding(row_padding),
           "--port-file", str(port_file), "--log-level", log_level]
    if threads:
        cmd += ["--threads", str(threads)]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    if max_handshakes is not None:
        cmd += ["--max-handshakes", str(max_handshakes)]
    if identity_path is not None:
        cmd += ["--identity", str(identity_path)]
    if authorized_path is not None:
        cmd += ["--authorized-devices", str(authorized_path)]
    if insecure_anonymous:
        cmd += ["--insecure-anonymous"]
    if backend != "embedded":
        cmd += ["--backend", backend]
        if vllm_python:
            cmd += ["--vllm-python", str(vllm_python)]
        if vllm_url:
            cmd += ["--vllm-url", str(vllm_url)]
        for a in vllm_args or []:
            cmd += [f"--vllm-arg={a}"]
    if split_policy is not None:
        from edgefuse.cloud.split_target import SplitPolicy

        policy = SplitPolicy.from_config(split_policy)  # a bad policy fails here, not in the child
        cmd += ["--split-policy", json.dumps(policy.to_config(), separators=(",", ":"))]
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    token = secrets.token_urlsafe(24)
    child_env[HEALTH_TOKEN_ENV] = token
    with open(log_file, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(_REPO_ROOT), env=child_env)
    proc.log_path = log_file
    proc.health_token = token
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    deadline = time.monotonic() + timeout_s
    bound = None
    while True:
        rc = proc.poll()
        if rc is not None:
            raise ServiceStartError(f"cloud service ({model}) exited with code {rc} before "
                                    f"answering its health check; log {log_file}:\n"
                                    f"{_log_tail(log_file)}")
        if bound is None and port_file.exists():
            bound = int(port_file.read_text())
        if bound is not None:
            try:
                cloud_health(probe_host, bound, timeout_s=2.0)
                log.info("cloud service %s started (pid %d, port %d, log %s)", model, proc.pid,
                         bound, log_file)
                return proc, bound
            except OSError:
                pass
        if time.monotonic() > deadline:
            stop_service_process(proc)
            raise ServiceStartError(f"cloud service ({model}) did not answer a health check "
                                    f"within {timeout_s} s; log {log_file}:\n{_log_tail(log_file)}")
        time.sleep(0.05)


def stop_service_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGTERM the service process, wait up to ``timeout_s`` seconds for its graceful
    shutdown, SIGKILL it after that; returns its exit code (0 after a graceful stop)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("cloud service pid %d ignored SIGTERM for %g s; killing it", proc.pid,
                        timeout_s)
            proc.kill()
            proc.wait()
    return proc.returncode
