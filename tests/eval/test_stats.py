"""Tests for edgefuse.eval.stats: Wilson and bootstrap 95 % intervals, paired differences."""

import math

import numpy as np
import pytest

from edgefuse.eval.stats import (Estimate, bootstrap_mean_interval, paired_difference, proportion,
                                 wilson_interval)


def test_wilson_matches_hand_computed_values():
    # 20/40: p = 0.5, z = 1.959964, z²/n = 0.096036; centre 0.5,
    # half = z·sqrt(0.25/40 + 0.096036/160) / 1.096036 = 1.959964·0.082766/1.096036 = 0.148005
    lo, hi = wilson_interval(20, 40)
    assert lo == pytest.approx(0.351995, abs=1e-6) and hi == pytest.approx(0.648005, abs=1e-6)
    # 0/10: low is 0, high = z²/n / (1 + z²/n) = 0.384138/1.384138 = 0.277533
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.277533, abs=1e-6)
    # n/n mirrors 0/n
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(1 - 0.277533, abs=1e-6)
    # 7/8 (textbook value: 0.5291, 0.9776)
    lo, hi = wilson_interval(7, 8)
    assert (round(lo, 4), round(hi, 4)) == (0.5291, 0.9776)


def test_wilson_narrows_with_n_and_widens_with_confidence():
    w40 = np.subtract(*wilson_interval(20, 40)[::-1])
    w400 = np.subtract(*wilson_interval(200, 400)[::-1])
    assert w400 < w40 / 3
    w90 = np.subtract(*wilson_interval(20, 40, confidence=0.90)[::-1])
    assert w90 < w40


@pytest.mark.parametrize("k,n,conf", [(1, 0, 0.95), (-1, 5, 0.95), (6, 5, 0.95), (1, 5, 1.0),
                                      (1, 5, 0.0)])
def test_wilson_refuses_bad_input(k, n, conf):
    with pytest.raises(ValueError):
        wilson_interval(k, n, conf)


def test_proportion_counts_and_names_fields():
    est = proportion([True, False, True, True])
    assert est.value == 0.75 and est.n == 4
    assert (est.low, est.high) == pytest.approx(wilson_interval(3, 4))
    assert est.to_dict("mmlu_acc") == {"mmlu_acc": 0.75, "mmlu_acc_n": 4,
                                       "mmlu_acc_ci95_low": est.low, "mmlu_acc_ci95_high": est.high}
    assert set(est.to_dict()) == {"value", "n", "ci95_low", "ci95_high"}
    assert proportion([]) == Estimate(None, 0, None, None)
    with pytest.raises(ValueError, match="0/1"):
        proportion([0.5, 1.0])
    with pytest.raises(ValueError, match="ci95"):
        Estimate(0.5, 4, 0.1, 0.9, confidence=0.9).to_dict()


def test_bootstrap_mean_is_seeded_and_covers_the_mean():
    vals = [0.1, 0.4, 0.35, 0.8, 0.2, 0.55, 0.3, 0.45]
    a = bootstrap_mean_interval(vals, seed=3)
    b = bootstrap_mean_interval(vals, seed=3)
    assert a == b
    assert a.value == pytest.approx(np.mean(vals)) and a.n == 8
    assert min(vals) <= a.low < a.value < a.high <= max(vals)
    # standard error of the mean ≈ 0.0744 (sd 0.2104 / sqrt(8), ddof 0): ±1.96 SE ≈ 0.29 wide
    assert 0.2 < a.high - a.low < 0.35
    one = bootstrap_mean_interval([0.4])
    assert (one.value, one.low, one.high) == (0.4, 0.4, 0.4)
    assert bootstrap_mean_interval([]).value is None
    with pytest.raises(ValueError, match="finite"):
        bootstrap_mean_interval([0.1, math.nan])
    with pytest.raises(ValueError, match="n_resamples"):
        bootstrap_mean_interval([0.1], n_resamples=0)


def test_paired_difference_sees_a_consistent_gain_that_unpaired_means_hide():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.0, 1.0, size=30)  # items of very different difficulty
    a, b = base + 0.05, base  # mode A is better by 0.05 on every item
    d = paired_difference(a, b)
    assert d.value == pytest.approx(0.05) and d.n == 30
    assert d.low == pytest.approx(0.05) and d.high == pytest.approx(0.05)  # no per-item noise
    # unpaired, the two means' intervals overlap widely
    ia, ib = bootstrap_mean_interval(a), bootstrap_mean_interval(b)
    assert ia.low < ib.high
    # binary outcomes, 30 items: A alone right on 10, B alone right on 1 (McNemar exact
    # p = 2·12/2048 = 0.012): the interval excludes 0 ...
    a01 = [1] * 10 + [0] * 1 + [1] * 5 + [0] * 14
    b01 = [0] * 10 + [1] * 1 + [1] * 5 + [0] * 14
    d01 = paired_difference(a01, b01, seed=1)
    assert d01.value == pytest.approx(9 / 30)
    assert 0.0 < d01.low < d01.value < d01.high <= 0.6
    # ... 6 against 1 (McNemar p = 0.125) is not a difference: it includes 0
    d6 = paired_difference([1] * 6 + [0] + [0] * 13, [0] * 6 + [1] + [0] * 13, seed=1)
    assert d6.low <= 0.0 < d6.value
    with pytest.raises(ValueError, match="same items"):
        paired_difference([1, 0], [1])
