"""95 % intervals for the figures the phases report (accuracy, agreement, ROUGE-L, deltas).

Every accuracy or agreement in ``results.json`` is a mean over ``n`` evaluated items; with
the small ``n`` of the main job (tens of questions) the interval is as wide as the gaps
between modes, so a row carries ``n`` and its interval, and two modes are compared on the
same items (paired), never as two independent means.

* :func:`wilson_interval` — a proportion ``k / n`` (MMLU accuracy, GSM8K exact match, the
  share of generations identical to the target): Wilson's score interval (Wilson 1927,
  "Probable inference, the law of succession, and statistical inference", JASA 22), which
  stays inside [0, 1] and is sound at ``k = 0`` or ``k = n``, unlike the normal
  approximation.
* :func:`bootstrap_mean_interval` — a mean of bounded per-item scores (ROUGE-L, token
  agreement): the percentile bootstrap (Efron & Tibshirani 1993, ch. 13).
* :func:`paired_difference` — mode A minus mode B on the same items: the mean per-item
  difference with a percentile bootstrap over items (pairs resampled together).

Resampling is seeded, so the same inputs give the same interval. Pure numpy and the
standard library; no Flower, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np

DEFAULT_RESAMPLES = 2000


@dataclass(frozen=True)
class Estimate:
    """A mean over ``n`` items with a two-sided interval at ``confidence``.

    ``low``/``high`` are ``None`` when ``n == 0`` (nothing to estimate; ``value`` is
    ``None`` then too)."""

    value: float | None
    n: int
    low: float | None
    high: float | None
    confidence: float = 0.95

    def to_dict(self, prefix: str = "") -> dict:
        """``{prefix, prefix_n, prefix_ci95_low, prefix_ci95_high}`` (the key of ``value`` is
        ``prefix`` itself; with ``prefix=""``: ``value``, ``n``, ``ci95_low``, ``ci95_high``).
        The ``ci95`` in the names assumes ``confidence == 0.95`` (raises ``ValueError`` else)."""
        if not math.isclose(self.confidence, 0.95):
            raise ValueError(f"to_dict names the interval ci95, this one is at {self.confidence}")
        p = f"{prefix}_" if prefix else ""
        return {prefix or "value": self.value, f"{p}n": self.n,
                f"{p}ci95_low": self.low, f"{p}ci95_high": self.high}


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n``.

    ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``p = successes/n`` and
    ``z`` the normal quantile of ``0.5 + confidence/2`` (1.95996 for 95 %).

    Returns:
        ``(low, high)`` within [0, 1]; e.g. ``wilson_interval(20, 40)`` ≈ (0.352, 0.648).

    Raises:
        ValueError: ``n < 1``, ``successes`` outside ``0..n``, or ``confidence`` outside (0, 1).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in 0..{n}, got {successes}")
    z = _z(confidence)
    p = successes / n
    z2n = z * z / n
    centre = (p + z2n / 2.0) / (1.0 + z2n)
    half = z * math.sqrt(p * (1.0 - p) / n + z2n / (4.0 * n)) / (1.0 + z2n)
    # at k = 0 (k = n) the low (high) end is 0 (1) exactly; float rounding leaves ~1e-17
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def proportion(outcomes: Sequence[bool | int | float], confidence: float = 0.95) -> Estimate:
    """The share of true outcomes (each 0/1 or bool) with its Wilson interval.

    Raises:
        ValueError: an outcome other than 0/1/True/False.
    """
    vals = [float(x) for x in outcomes]
    if any(v not in (0.0, 1.0) for v in vals):
        raise ValueError("proportion needs 0/1 outcomes; use bootstrap_mean_interval for scores")
    if not vals:
        return Estimate(None, 0, None, None, confidence)
    k = int(sum(vals))
    low, high = wilson_interval(k, len(vals), confidence)
    return Estimate(k / len(vals), len(vals), low, high, confidence)


def _percentiles(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    _z(confidence)  # range check
    a = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(samples, [a, 1.0 - a])
    return float(lo), float(hi)


def bootstrap_mean_interval(values: Sequence[float], confidence: float = 0.95,
                            n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Estimate:
    """The mean of ``values`` with a percentile-bootstrap interval.

    ``n_resamples`` resamples of ``len(values)`` items drawn with replacement
    (``numpy.random.default_rng(seed)``); the interval is their means' ``(1-c)/2`` and
    ``(1+c)/2`` quantiles. One value gives a zero-width interval.

    Raises:
        ValueError: a non-finite value, ``n_resamples < 1`` or ``confidence`` outside (0, 1).
    """
    x = np.asarray(list(values), dtype=np.float64)
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if x.size and not np.all(np.isfinite(x)):
        raise ValueError("values must be finite")
    if x.size == 0:
        _z(confidence)
        return Estimate(None, 0, None, None, confidence)
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_resamples, x.size))
    low, high = _percentiles(x[idx].mean(axis=1), confidence)
    return Estimate(float(x.mean()), int(x.size), low, high, confidence)


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95,
                      n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Estimate:
    """Mean of ``a[i] - b[i]`` over items scored by both modes, with a paired bootstrap
    interval (items resampled, each keeping its pair): an interval that excludes 0 says the
    modes differ on these items at that confidence.

    Raises:
        ValueError: ``a`` and ``b`` of different lengths (they must be the same items, in
            the same order), or as :func:`bootstrap_mean_interval`.
    """
    a_, b_ = list(a), list(b)
    if len(a_) != len(b_):
        raise ValueError(f"paired scores need the same items: {len(a_)} vs {len(b_)}")
    diff = np.asarray(a_, dtype=np.float64) - np.asarray(b_, dtype=np.float64)
    return bootstrap_mean_interval(diff, confidence, n_resamples, seed)


__all__ = ["Estimate", "wilson_interval", "proportion", "bootstrap_mean_interval",
           "paired_difference", "DEFAULT_RESAMPLES"]
