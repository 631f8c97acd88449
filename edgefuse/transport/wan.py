"""An emulated WAN link (kernel netem is not available here).

Per frame of ``nbytes`` bytes the link delays the sender by::

    delay_s = max(0, rtt/2 + N(0, jitter)) / 1000          # one-way latency, ms → s
            + nbytes · 8 / (bandwidth_mbps · 1e6)          # serialization, 1 Mbps = 1e6 bit/s
            + lost_attempts · rtt / 1000                   # each loss: one retransmission RTT

where each attempt is lost independently with probability ``loss`` (so ``lost_attempts`` is
geometric). Jitter and loss come from a ``random.Random(seed)`` owned by the link, so two
links with the same profile produce the same delays in the same order.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WanProfile:
    """Link conditions: ``rtt_ms`` round trip (ms), ``bandwidth_mbps`` (10^6 bit/s;
    ``math.inf`` = unlimited), ``jitter_ms`` standard deviation of the one-way latency (ms),
    ``loss`` per-attempt loss probability in [0, 1), ``seed`` for jitter and loss.
    Raises ``ValueError`` for out-of-range values."""

    rtt_ms: float
    bandwidth_mbps: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise ValueError(f"rtt_ms must be finite and >= 0, got {self.rtt_ms}")
        if not self.bandwidth_mbps > 0:  # also rejects NaN
            raise ValueError(f"bandwidth_mbps must be > 0 (math.inf = unlimited), got {self.bandwidth_mbps}")
        if not (math.isfinite(self.jitter_ms) and self.jitter_ms >= 0):
            raise ValueError(f"jitter_ms must be finite and >= 0, got {self.jitter_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")

    @classmethod
    def from_name(cls, name: str) -> WanProfile:
        """The preset called ``name``; raises ``ValueError`` listing the presets if unknown."""
        try:
            return PRESETS[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown WAN preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            ) from None


PRESETS: dict[str, WanProfile] = {
    "none": WanProfile(rtt_ms=0.0, bandwidth_mbps=math.inf),  # no delay at all
    "lan": WanProfile(rtt_ms=1.0, bandwidth_mbps=1000.0),  # gigabit LAN
    "wan20": WanProfile(rtt_ms=20.0, bandwidth_mbps=100.0),  # nearby cloud region
    "wan80": WanProfile(rtt_ms=80.0, bandwidth_mbps=100.0),  # distant cloud region
}


class WanLink:
    """One direction of an emulated link with running totals.

    ``bytes`` / ``frames`` / ``delay_s_total`` (seconds) / ``retransmissions`` add up every
    frame passed to :meth:`delay_s` (and so to :meth:`send_delay` / :meth:`asend_delay`).
    """

    def __init__(self, profile: WanProfile):
        self.profile = profile
        self._rng = random.Random(profile.seed)
        self._lock = threading.Lock()
        self.bytes = 0
        self.frames = 0
        self.delay_s_total = 0.0
        self.retransmissions = 0

    def delay_s(self, nbytes: int) -> float:
        """Seconds one frame of ``nbytes`` bytes takes (see the module formula); draws jitter
        and loss from the link's seeded generator and adds the frame to the totals.
        Raises ``ValueError`` for negative ``nbytes``."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        p = self.profile
        with self._lock:
            latency_ms = p.rtt_ms / 2
            if p.jitter_ms > 0:
                latency_ms += self._rng.gauss(0.0, p.jitter_ms)
            lost = 0
            if p.loss > 0:
                while self._rng.random() < p.loss:
                    lost += 1
            delay = max(0.0, latency_ms) / 1000 + nbytes * 8 / (p.bandwidth_mbps * 1e6)
            delay += lost * p.rtt_ms / 1000
            self.bytes += nbytes
            self.frames += 1
            self.retransmissions += lost
            self.delay_s_total += delay
            return delay

    def send_delay(self, nbytes: int) -> float:
        """Block (``time.sleep``) for one frame's delay; returns it in seconds."""
        d = self.delay_s(nbytes)
        if d > 0:
            time.sleep(d)
        return d

    async def asend_delay(self, nbytes: int) -> float:
        """``asyncio.sleep`` for one frame's delay; returns it in seconds."""
        d = self.delay_s(nbytes)
        if d > 0:
            await asyncio.sleep(d)
        return d
