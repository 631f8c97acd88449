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
  it stops waiting as soon as every open session has a job in the batch, so a lone session
  never waits and N sessions in step stay batched together),
  runs ``target.step(jobs)`` once and routes each answer back to its connection
  (``loop.call_soon_threadsafe``). Per-session order is kept: a session's later requests wait
  for its earlier ones. A job whose session has closed meanwhile is dropped.
- A frame that fails to open (tampered, replayed, reordered, truncated) is logged and counted
  (``frames_rejected``) and otherwise ignored: the session is unchanged and the next genuine
  frame works. A plaintext that does not parse gets ERROR ``protocol``; the session goes on.
  :class:`edgefuse.cloud.target.SessionError` becomes ERROR with its code; any other failure of the
  target becomes ERROR ``internal``.
- ``max_sessions``: an OPEN beyond it gets ERROR ``busy`` (the connection stays usable; the
  device may retry or close).

Run it in-process (:meth:`CloudService.start_in_thread` / :meth:`CloudService.stop`), in the
foreground until SIGINT/SIGTERM (:meth:`CloudService.serve_forever`, used by
``edgefuse cloud serve``), or as a child process
(:func:`start_service_process` / :func:`stop_service_process`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from edgefuse.cloud import protocol as P
from edgefuse.cloud.wire import (PeerClosed, aread_message, decode_hello, encode_health, encode_welcome,
                        is_health_probe, write_message)
from edgefuse.transport.crypto import FrameError, HandshakeError, derive_session, generate_keypair

log = logging.getLogger("edgefuse.cloud")

DEFAULT_PORT = 39200
_STOP = object()  # the worker's stop sentinel
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
        self.current: _Session | None = None
        self.closed = False
        self.bytes_in = self.bytes_out = 0
        self.messages_in = self.messages_out = 0
        self.frames_rejected = 0

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


@dataclass
class _Item:
    kind: str  # "open" | "close" | "auth" | "job"
    sess: _Session
    msg: Any = None


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
        handshake_timeout_s: a connection that sends no first message within this many
            seconds is closed.

    Raises ``ValueError`` for out-of-range settings.
    """

    def __init__(self, target, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 8,
                 max_wait_ms: float = 100.0, max_sessions: int = 64,
                 handshake_timeout_s: float = 10.0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.target = target
        self.host = host
        self.requested_port = int(port)
        self.port: int | None = None  # the bound port, once listening
        self.max_batch = int(max_batch)
        self.max_wait_ms = float(max_wait_ms)
        self.max_sessions = int(max_sessions)
        self.handshake_timeout_s = float(handshake_timeout_s)

        self._queue: queue.Queue = queue.Queue()
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

    def stats(self) -> dict:
        """Counters since start: ``sessions_open`` (holding a cache slot now),
        ``sessions_total``, ``connections_open``, ``connections_total``, ``batches``
        (``target.step`` calls), ``jobs`` (VERIFY/FUSE run), ``jobs_dropped`` (session
        closed before its turn), ``mean_batch_size`` (jobs / batches), ``max_batch_size``,
        ``batch_sizes`` ({size: count}), ``frames_rejected`` (frames that failed to open),
        ``protocol_errors`` (plaintexts that failed to parse, misplaced messages),
        ``busy_refusals``, ``health_probes``, ``bytes_in`` / ``bytes_out`` (bytes on the
        sockets of closed connections plus open ones, length prefixes included)."""
        with self._lock:
            c = dict(self._c)
            hist = dict(sorted(self._batch_hist.items()))
            live = len(self._live)
        conns = list(self._conns)
        batches = c.get("batches", 0)
        jobs = c.get("jobs", 0)
        return {
            "sessions_open": live,
            "sessions_total": c.get("sessions_total", 0),
            "connections_open": len(conns),
            "connections_total": c.get("connections_total", 0),
            "batches": batches,
            "jobs": jobs,
            "jobs_dropped": c.get("jobs_dropped", 0),
            "mean_batch_size": (jobs / batches) if batches else 0.0,
            "max_batch_size": max(hist) if hist else 0,
            "batch_sizes": {str(k): v for k, v in hist.items()},
            "frames_rejected": c.get("frames_rejected", 0),
            "protocol_errors": c.get("protocol_errors", 0),
            "busy_refusals": c.get("busy_refusals", 0),
            "health_probes": c.get("health_probes", 0),
            "bytes_in": c.get("bytes_in", 0) + sum(x.bytes_in for x in conns),
            "bytes_out": c.get("bytes_out", 0) + sum(x.bytes_out for x in conns),
        }

    def health(self) -> dict:
        """The health answer: ``status`` (``ok`` / ``stopping``), ``model``,
        ``fingerprint``, ``context_len``, ``sessions_open``, ``queue_depth`` (requests
        waiting for the worker), ``batches``, ``uptime_s`` (seconds), the settings
        (``max_batch``, ``max_wait_ms``, ``max_sessions``) and every :meth:`stats` counter."""
        out = {
            "status": "stopping" if self._stop_requested else "ok",
            "model": str(getattr(self.target, "name", "?")),
            "fingerprint": str(getattr(self.target, "fingerprint", "?")),
            "context_len": int(getattr(self.target, "context_len", 0)),
            "queue_depth": self._queue.qsize() + len(self._pending),
            "uptime_s": round(time.monotonic() - self._started_at, 3) if self._started_at else 0.0,
            "max_batch": self.max_batch,
            "max_wait_ms": self.max_wait_ms,
            "max_sessions": self.max_sessions,
            "pid": os.getpid(),
        }
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
                 "max_sessions=%d)", getattr(self.target, "name", "?"), self.host, self.port,
                 self.max_batch, self.max_wait_ms, self.max_sessions)
        try:
            on_ready()
            await self._stop_evt.wait()
        finally:
            await self._shutdown(server)

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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        conn = _Conn(next(self._ids), writer.get_extra_info("peername"), writer)
        self._conns.add(conn)
        self._count("connections_total")
        kind = "connection"
        try:
            try:
                first = await asyncio.wait_for(aread_message(reader), self.handshake_timeout_s)
            except asyncio.TimeoutError:
                log.warning("connection %d from %s: no hello within %g s; closing", conn.id,
                            conn.peer, self.handshake_timeout_s)
                return
            conn.bytes_in += len(first) + P.LENGTH_PREFIX_BYTES
            if is_health_probe(first):
                kind = "health probe"
                self._count("health_probes")
                conn.bytes_out += write_message(writer, encode_health(self.health()))
                await writer.drain()
                return
            peer_key, sid = decode_hello(first)
            own = generate_keypair()
            secure = derive_session(own, peer_key, sid, initiator=False)
            conn.bytes_out += write_message(writer, encode_welcome(own.public_bytes()))
            conn.secure = secure
            log.debug("connection %d from %s: handshake done (session id %s)", conn.id,
                      conn.peer, sid.hex())
            while True:
                body = await aread_message(reader)
                conn.bytes_in += len(body) + P.LENGTH_PREFIX_BYTES
                try:
                    plain = secure.open(body)
                except FrameError as exc:
                    conn.frames_rejected += 1
                    self._count("frames_rejected")
                    log.warning("connection %d: rejected frame (%s): %s", conn.id,
                                type(exc).__name__, exc)
                    continue
                conn.messages_in += 1
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
            level = logging.DEBUG if kind == "health probe" else logging.INFO
            log.log(level, "%s %d closed: %d B in, %d B out, %d messages in, %d out, "
                    "%d frames rejected", kind, conn.id, conn.bytes_in, conn.bytes_out,
                    conn.messages_in, conn.messages_out, conn.frames_rejected)
            self._tasks.discard(task)

    def _dispatch(self, conn: _Conn, msg: P.Message) -> None:
        """Route one decoded request (event-loop thread)."""
        if isinstance(msg, P.Open):
            if conn.current is not None:
                self._count("protocol_errors")
                conn.send(P.Error("protocol", "a session is already open on this connection; "
                                              "CLOSE it first"))
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
            self._queue.put(_Item("open", sess, msg))
        elif isinstance(msg, (P.Verify, P.Fuse, P.Auth)):
            if conn.current is None:
                self._count("protocol_errors")
                conn.send(P.Error("protocol", f"{type(msg).__name__.upper()} before OPEN: no "
                                              f"session is open on this connection"))
                return
            self._queue.put(_Item("auth" if isinstance(msg, P.Auth) else "job", conn.current, msg))
        elif isinstance(msg, P.Close):
            sess, conn.current = conn.current, None
            if sess is not None:
                sess.closed = True
                self._queue.put(_Item("close", sess))
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

    @staticmethod
    def _deliver(sess: _Session, msg: P.Message) -> None:
        if not sess.closed:
            sess.conn.send(msg)

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
                if item.kind == "job":
                    self._run_batch(item)
                elif item.kind == "open":
                    self._open(item)
                elif item.kind == "auth":
                    self._authorize(item)
                else:
                    self._free(item.sess)
            except Exception:  # noqa: BLE001 - keep serving the other sessions
                log.exception("cloud worker: unexpected error on a %s item", item.kind)
        with self._lock:
            left = list(self._live)
        for sess in left:
            sess.closed = True
            self._free(sess)

    def _open(self, item: _Item) -> None:
        sess = item.sess
        if sess.closed:
            self._free(sess)
            return
        t0 = time.perf_counter()
        try:
            sess.target = self.target.open(item.msg)
        except Exception as exc:  # noqa: BLE001
            from edgefuse.cloud.target import SessionError

            if isinstance(exc, SessionError):
                err = P.Error(exc.code, str(exc))
                log.info("session %d (connection %d): OPEN refused [%s]: %s", sess.id,
                         sess.conn.id, exc.code, exc)
            else:
                err = P.Error("internal", f"target.open failed: {type(exc).__name__}: {exc}")
                log.exception("session %d: target.open failed", sess.id)
            sess.failed = True
            with self._lock:
                self._live.discard(sess)
            self._post(self._open_failed, sess, err)
            return
        if sess.closed:  # disconnected during the prefill
            self._free(sess)
            return
        log.info("session %d (connection %d) open: %d prompt tokens, prefill %.1f ms",
                 sess.id, sess.conn.id, len(item.msg.prompt), (time.perf_counter() - t0) * 1e3)
        opened = P.Opened(str(self.target.name), str(self.target.fingerprint),
                          int(self.target.context_len))
        self._post(self._deliver, sess, opened)

    def _authorize(self, item: _Item) -> None:
        """Apply an AUTH (evicting at once), then answer AUTHED with the tokens held."""
        sess = item.sess
        if sess.closed:
            return
        if sess.target is None:  # its OPEN failed
            self._count("protocol_errors")
            self._post(sess.conn.send, P.Error("protocol", "no open session (OPEN failed)"))
            return
        from edgefuse.cloud.target import SessionError

        try:
            reply = P.Authed(int(self.target.authorize(sess.target, item.msg.auth)))
        except SessionError as exc:
            reply = P.Error(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001
            log.exception("session %d: target.authorize failed", sess.id)
            reply = P.Error("internal", f"target.authorize failed: {type(exc).__name__}: {exc}")
        log.info("session %d (connection %d): cache tuple %s", sess.id, sess.conn.id, item.msg.auth)
        self._post(self._deliver, sess, reply)

    @staticmethod
    def _open_failed(sess: _Session, err: P.Error) -> None:
        if sess.conn.current is sess:
            sess.conn.current = None
        sess.conn.send(err)

    def _free(self, sess: _Session) -> None:
        ts, sess.target = sess.target, None
        if ts is not None:
            try:
                self.target.close(ts)
            except Exception:  # noqa: BLE001
                log.exception("session %d: target.close failed", sess.id)
        with self._lock:
            was_live = sess in self._live
            self._live.discard(sess)
        if was_live:
            c = sess.conn
            log.info("session %d (connection %d) closed after %d jobs: %d B in, %d B out so far",
                     sess.id, c.id, sess.jobs, c.bytes_in, c.bytes_out)

    def _run_batch(self, first: _Item) -> None:
        batch, in_batch, blocked, deferred = [first], {first.sess}, set(), []
        deadline = time.monotonic() + self.max_wait_ms / 1000.0
        while len(batch) < self.max_batch:
            with self._lock:
                if len(in_batch) >= len(self._live):
                    break  # every open session is in: nobody else can add a job
            item = self._next_item(deadline)
            if item is None:
                break
            if item is _STOP:
                deferred.append(item)
                break
            if item.kind != "job" or item.sess in in_batch or item.sess in blocked:
                deferred.append(item)  # keep this session's order: it waits for the next batch
                blocked.add(item.sess)
                continue
            batch.append(item)
            in_batch.add(item.sess)
        self._pending.extendleft(reversed(deferred))

        run = []
        for item in batch:
            if item.sess.closed:
                self._count("jobs_dropped")
            elif item.sess.target is None:  # its OPEN failed
                self._count("protocol_errors")
                self._post(item.sess.conn.send, P.Error("protocol", "no open session (OPEN failed)"))
            else:
                run.append(item)
        if not run:
            return
        jobs = [(item.sess.target, item.msg) for item in run]
        t0 = time.perf_counter()
        try:
            replies = list(self.target.step(jobs))
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
        log.debug("batch of %d (%s) in %.1f ms", len(run),
                  ",".join(type(i.msg).__name__ for i in run), ms)
        for item, reply in zip(run, replies):
            item.sess.jobs += 1
            self._post(self._deliver, item.sess, reply)


# ------------------------------------------------------------------------ foreground / CLI

def serve(model: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, max_batch: int = 8,
          max_wait_ms: float = 100.0, max_sessions: int = 64, threads: int | None = None,
          max_context: int = 2048, port_file: str | None = None) -> None:
    """Load ``model`` (an :mod:`edgefuse.models` name), build a :class:`edgefuse.cloud.target.Target`
    and serve until SIGINT/SIGTERM. ``threads``: torch CPU threads (None = torch default).
    ``port_file``: once listening, the bound port is written there (atomically).
    Raises ``ModelSpecError`` / ``ModelFetchError`` for a model that cannot be loaded and
    ``OSError`` when the port cannot be bound."""
    import torch

    from edgefuse.cloud.target import Target
    from edgefuse.models import load_model

    if threads:
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    model_obj, tok = load_model(model)
    target = Target(model_obj, tok, model, max_context=max_context)
    log.info("model %s loaded in %.1f s (fingerprint %s, context %d)", model,
             time.perf_counter() - t0, target.fingerprint, target.context_len)
    svc = CloudService(target, host, port, max_batch=max_batch, max_wait_ms=max_wait_ms,
                       max_sessions=max_sessions)

    def ready():
        if port_file:
            tmp = Path(f"{port_file}.tmp")
            tmp.write_text(str(svc.port))
            os.replace(tmp, port_file)

    svc.serve_forever(on_ready=ready)


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
                          cache_dir: str | os.PathLike | None = None) -> tuple[subprocess.Popen, int]:
    """Start ``edgefuse cloud serve`` as a child process and wait until it answers a health
    check; returns ``(process, bound port)``. ``port=0`` picks a free port. The child's
    stdout+stderr go to ``log_path`` (appended; default: a temporary file), available as
    ``process.log_path``.

    Raises :class:`ServiceStartError` (with the log tail) if the process exits first or does
    not answer within ``timeout_s`` seconds (the process is then stopped). ``cache_dir``: the
    model cache the child loads from (``None``: its own default resolution)."""
    from edgefuse.cloud.link import cloud_health

    workdir = Path(tempfile.mkdtemp(prefix="edgefuse-cloud-"))
    port_file = workdir / "port"
    log_file = Path(log_path) if log_path is not None else workdir / "service.log"
    cmd = [python, "-m", "edgefuse.cli", "cloud", "serve", "--model", model, "--host", host,
           "--port", str(port), "--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms),
           "--max-sessions", str(max_sessions), "--max-context", str(max_context),
           "--port-file", str(port_file), "--log-level", log_level]
    if threads:
        cmd += ["--threads", str(threads)]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_file, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(_REPO_ROOT), env=child_env)
    proc.log_path = log_file
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
