"""Batched forward passes for simulated devices that share one model (an emulation aid)."""

from __future__ import annotations

import threading
import time

import torch

from edgefuse.cloud.target import batched_forward


class DraftBatcher:
    """Runs the forward passes of simulated devices that share one edge model as one batched
    pass, each device keeping its own KV cache (:func:`edgefuse.cloud.target.batched_forward`).

    An emulation aid, not something a real device does: real devices compute in parallel on
    their own hardware, while N simulated devices in one process would queue behind each
    other on the host's cores. The first caller waits ``max_wait_ms`` (ms) for the others,
    then runs everyone's step at once; each caller gets its own rows back. Thread-safe."""

    def __init__(self, model, pad_id: int, max_wait_ms: float = 2.0):
        self.body = model.get_decoder()
        self.pad_id = int(pad_id)
        self.max_wait_s = max_wait_ms / 1000
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self.batches = 0
        self.rows = 0

    def run(self, layers, past: int, ids: list[int]) -> tuple[torch.Tensor, list]:
        """Feed ``ids`` after ``past`` cached positions (``layers``: ``[(k, v)]`` or None);
        returns the hidden states ``[len(ids), H]`` and the new cache layers. Re-raises the
        batch's error in every caller."""
        slot = {"req": (layers, past, list(ids)), "done": threading.Event()}
        with self._lock:
            self._pending.append(slot)
            leader = len(self._pending) == 1
        if leader:
            time.sleep(self.max_wait_s)
            with self._lock:
                batch, self._pending = self._pending, []
            try:
                outs, kvs = batched_forward(self.body, [b["req"][0] for b in batch],
                                            [b["req"][1] for b in batch], [b["req"][2] for b in batch],
                                            self.pad_id, output="last_hidden_state")
                for b, o, kv in zip(batch, outs, kvs):
                    b["out"] = (o, kv)
                self.batches += 1
                self.rows += len(batch)
            except BaseException as exc:  # every waiting device gets the error
                for b in batch:
                    b["error"] = exc
            finally:
                for b in batch:
                    b["done"].set()
        slot["done"].wait()
        if "error" in slot:
            raise slot["error"]
        return slot["out"]
