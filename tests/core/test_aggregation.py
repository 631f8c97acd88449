"""FedAvg, FlexLoRA and update validation on small hand-built states (numpy only)."""

import numpy as np
import pytest

from edgefuse.aggregation import (
    ClientUpdate,
    MalformedUpdateError,
    aggregate_group,
    fedavg,
    flexlora,
    module_shapes,
    validate_update,
)

A, B = ".lora_A.weight", ".lora_B.weight"


def f32(x):
    return np.asarray(x, dtype=np.float32)


def delta(state, module, rank, alpha):
    """s · B A of one module."""
    return alpha / rank * state[module + B].astype(np.float64) @ state[module + A]


def best_rank(w, r):
    u, s, vt = np.linalg.svd(w)
    return (u[:, :r] * s[:r]) @ vt[:r], np.sqrt((s[r:] ** 2).sum() / (s ** 2).sum())


# ---------------------------------------------------------------- fedavg


def test_fedavg_hand_values():
    out = fedavg([{"k": f32([[1, 2]])}, {"k": f32([[5, 6]])}], [1, 3])
    # (1·1 + 3·5) / 4 = 4, (1·2 + 3·6) / 4 = 5
    np.testing.assert_array_equal(out["k"], f32([[4, 5]]))
    assert out["k"].dtype == np.float32


def test_fedavg_rejects_mismatches():
    with pytest.raises(ValueError, match="shape"):
        fedavg([{"k": f32([[1, 2]])}, {"k": f32([[1, 2, 3]])}], [1, 1])
    with pytest.raises(ValueError, match="keys"):
        fedavg([{"k": f32([[1]])}, {"j": f32([[1]])}], [1, 1])
    with pytest.raises(ValueError, match="weight"):
        fedavg([{"k": f32([[1]])}], [1, 2])
    with pytest.raises(ValueError, match="not all zero"):
        fedavg([{"k": f32([[1]])}], [0])


# ---------------------------------------------------------------- equal ranks


def test_equal_ranks_is_fedavg_of_a_and_b():
    s0 = {"q" + A: f32([[1, 0]]), "q" + B: f32([[2], [0]]),
          "v" + A: f32([[0, 4]]), "v" + B: f32([[1], [1]])}
    s1 = {"q" + A: f32([[5, 4]]), "q" + B: f32([[6], [8]]),
          "v" + A: f32([[4, 0]]), "v" + B: f32([[5], [9]])}
    ups = [ClientUpdate(0, "m", 1, 2.0, 1, s0), ClientUpdate(7, "m", 1, 2.0, 3, s1)]
    res = aggregate_group(ups)
    expected = {"q" + A: f32([[4, 3]]), "q" + B: f32([[5], [6]]),
                "v" + A: f32([[3, 1]]), "v" + B: f32([[4], [7]])}
    assert res.info["method"] == "fedavg"
    assert (res.global_rank, res.global_alpha) == (1, 2.0)
    assert set(res.per_client) == {0, 7}
    for state in (res.global_state, res.per_client[0], res.per_client[7]):
        assert set(state) == set(expected)
        for k, v in expected.items():
            np.testing.assert_allclose(state[k], v, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- FlexLoRA


def random_update(rng, pid, rank, alpha, n, dims):
    state = {}
    for module, (out, inp) in dims.items():
        state[module + A] = f32(rng.normal(size=(rank, inp)))
        state[module + B] = f32(rng.normal(size=(out, rank)))
    return ClientUpdate(pid, "m", rank, alpha, n, state)


def test_flexlora_is_exact_at_full_rank_and_optimal_when_truncated():
    rng = np.random.default_rng(0)
    dims = {"q": (6, 5), "v": (7, 8)}
    ups = [random_update(rng, 0, 1, 2.0, 1, dims), random_update(rng, 1, 2, 2.0, 3, dims)]
    w = [0.25, 0.75]
    states, info = flexlora(ups, [1, 2, 3], [1.0, 4.0, 6.0])
    errors = {1: [], 2: [], 3: []}
    for module, (out, inp) in dims.items():
        dw = sum(wk * delta(u.state, module, u.rank, u.alpha) for wk, u in zip(w, ups))  # rank 3
        for state, r, alpha in zip(states, [1, 2, 3], [1.0, 4.0, 6.0]):
            assert state[module + A].shape == (r, inp) and state[module + B].shape == (out, r)
            assert state[module + A].dtype == np.float32
            want, err = best_rank(dw, r)
            np.testing.assert_allclose(delta(state, module, r, alpha), want, atol=1e-4)
            errors[r].append(err)
    assert info["method"] == "flexlora"
    assert errors[3] == pytest.approx([0, 0], abs=1e-6)  # rank(ΔW) = 3: exact
    for r in (1, 2, 3):
        assert info["truncation_error"][r] == pytest.approx(np.mean(errors[r]), abs=1e-5)
    assert 0 < info["truncation_error"][2] < info["truncation_error"][1] < 1


def test_aggregate_group_different_ranks():
    rng = np.random.default_rng(1)
    a0, b0 = f32(rng.normal(size=(1, 5))), f32(rng.normal(size=(6, 1)))
    x, y = f32(rng.normal(size=(1, 5))), f32(rng.normal(size=(6, 1)))
    # Client 1 spans client 0's direction plus one more: ΔW has rank 2 = the largest rank.
    u0 = ClientUpdate(3, "m", 1, 1.0, 2, {"q" + A: a0, "q" + B: b0})
    u1 = ClientUpdate(5, "m", 2, 4.0, 6, {"q" + A: np.vstack([a0, x]), "q" + B: np.hstack([b0, y])})
    dw = 0.25 * delta(u0.state, "q", 1, 1.0) + 0.75 * delta(u1.state, "q", 2, 4.0)
    assert np.linalg.matrix_rank(dw) == 2

    res = aggregate_group([u0, u1], method="flexlora")
    assert (res.global_rank, res.global_alpha) == (2, 4.0)
    assert res.per_client[3]["q" + A].shape == (1, 5) and res.per_client[3]["q" + B].shape == (6, 1)
    assert res.per_client[5]["q" + A].shape == (2, 5) and res.per_client[5]["q" + B].shape == (6, 2)
    np.testing.assert_allclose(delta(res.per_client[5], "q", 2, 4.0), dw, atol=1e-5)
    np.testing.assert_allclose(delta(res.global_state, "q", 2, 4.0), dw, atol=1e-5)
    want, err = best_rank(dw, 1)
    np.testing.assert_allclose(delta(res.per_client[3], "q", 1, 1.0), want, atol=1e-5)
    assert res.info["truncation_error"][1] == pytest.approx(err, abs=1e-5)
    assert res.info["truncation_error"][2] == pytest.approx(0, abs=1e-5)


def test_flexlora_zero_update_keeps_a_trainable():
    rng = np.random.default_rng(2)
    ups = [random_update(rng, 0, 2, 4.0, 1, {"q": (6, 5)}),
           random_update(rng, 1, 4, 8.0, 1, {"q": (6, 5)})]
    for u in ups:
        u.state["q" + B][:] = 0  # peft's init: B = 0, so ΔW = 0
    states, info = flexlora(ups, [2, 4], [4.0, 8.0])
    for state, r in zip(states, [2, 4]):
        np.testing.assert_array_equal(state["q" + B], np.zeros((6, r)))
        a = state["q" + A]
        np.testing.assert_allclose(a @ a.T, np.eye(r), atol=1e-5)  # orthonormal rows, not zeros
    assert info["truncation_error"] == {2: 0.0, 4: 0.0}


def test_flexlora_rejects_too_large_target_rank():
    rng = np.random.default_rng(3)
    ups = [random_update(rng, 0, 1, 1.0, 1, {"q": (6, 5)}),
           random_update(rng, 1, 2, 2.0, 1, {"q": (6, 5)})]
    with pytest.raises(ValueError, match="target rank 4 exceeds"):
        flexlora(ups, [4], [4.0])


def test_unknown_method():
    u = ClientUpdate(0, "m", 1, 1.0, 1, {"q" + A: f32([[1]]), "q" + B: f32([[1]])})
    with pytest.raises(ValueError, match="valid: flexlora"):
        aggregate_group([u], method="flora")


# ---------------------------------------------------------------- validation


def good_update():
    return ClientUpdate(4, "smollm2-135m", 2, 4.0, 10, {
        "l0.q" + A: np.ones((2, 5), np.float32), "l0.q" + B: np.ones((6, 2), np.float32),
        "l0.v" + A: np.ones((2, 5), np.float32), "l0.v" + B: np.ones((3, 2), np.float32)})


def test_module_shapes():
    assert module_shapes(good_update().state) == {"l0.q": (6, 5), "l0.v": (3, 5)}


def test_validate_accepts_good_update():
    validate_update(good_update(), "smollm2-135m", {"l0.q": (6, 5), "l0.v": (3, 5)})
    validate_update(good_update(), "smollm2-135m", None)


@pytest.mark.parametrize("tamper, message", [
    (lambda u: u.state["l0.q" + A].__setitem__((0, 0), np.nan), "l0.q.lora_A.weight contains NaN"),
    (lambda u: u.state["l0.v" + B].__setitem__((1, 1), np.inf), "l0.v.lora_B.weight contains Inf"),
    (lambda u: u.state.__setitem__("l0.q" + A, np.ones((3, 5), np.float32)), "match rank 2"),
    (lambda u: u.state.__setitem__("l0.q" + B, np.ones((6, 3), np.float32)), "match rank 2"),
    (lambda u: u.state.__setitem__("l0.q" + A, np.ones(10, np.float32)), "must be 2-D"),
    (lambda u: u.state.__setitem__("l0.q" + A, np.ones((2, 5), np.int32)), "not a float array"),
    (lambda u: setattr(u, "model", "gemma3-270m"),
     "model group 'gemma3-270m', expected 'smollm2-135m'"),
    (lambda u: u.state.pop("l0.v" + B), "l0.v has lora_A but no lora_B"),
    (lambda u: setattr(u, "num_examples", 0), "num_examples must be > 0"),
    (lambda u: setattr(u, "rank", 0), "rank and alpha must be > 0"),
    (lambda u: u.state.clear(), "empty adapter state"),
    (lambda u: u.state.__setitem__("l0.q.bias", np.ones((2, 2), np.float32)), "unexpected key"),
    (lambda u: [u.state.pop("l0.v" + A), u.state.pop("l0.v" + B)],
     r"module set differs from the reference: missing \['l0.v'\]"),
    (lambda u: u.state.update({"l1.q" + A: np.ones((2, 5), np.float32),
                               "l1.q" + B: np.ones((6, 2), np.float32)}),
     r"unexpected \['l1.q'\]"),
    (lambda u: u.state.__setitem__("l0.v" + A, np.ones((2, 7), np.float32)),
     r"l0.v is \(out, in\) = \(3, 7\), reference \(3, 5\)"),
])
def test_validate_rejects(tamper, message):
    u = good_update()
    tamper(u)
    with pytest.raises(MalformedUpdateError, match=message):
        validate_update(u, "smollm2-135m", {"l0.q": (6, 5), "l0.v": (3, 5)})


# ------------------------------------------------- the factor attack on FedAvg (A = 0, huge B)


def _honest_group(rng, n=3, rank=4, dims=None):
    """Honest clients near a shared round adapter (what the server sent): small steps."""
    dims = dims or {"q": (16, 12), "v": (16, 12)}
    sent = random_update(rng, -1, rank, 8.0, 1, dims).state
    for k in sent:  # LoRA-sized values: A ~ init scale, B small
        sent[k] = f32(sent[k] * (0.3 if k.endswith(A) else 0.01))
    ups = []
    for pid in range(n):
        st = {k: f32(v + rng.normal(scale=0.01, size=v.shape)) for k, v in sent.items()}
        ups.append(ClientUpdate(pid, "m", rank, 8.0, 10, st))
    return sent, ups


def _attacker(sent, pid=9, scale=1e4):
    """A = 0 and a huge B: its own ||s B A|| is 0, so a per-client norm bound passes it."""
    st = {k: (np.zeros_like(v) if k.endswith(A) else f32(np.full(v.shape, scale)))
          for k, v in sent.items()}
    return ClientUpdate(pid, "m", 4, 8.0, 10, st)


def test_a_zero_huge_b_passes_the_own_norm_but_blows_up_the_fedavg_aggregate():
    from edgefuse.aggregation import update_norm

    rng = np.random.default_rng(0)
    sent, ups = _honest_group(rng)
    bad = _attacker(sent)
    assert update_norm(bad.state, 4, 8.0) == 0.0
    validate_update(bad, "m", None, max_norm=1.0)  # the old check alone: passes
    honest = aggregate_group(ups)
    attacked = aggregate_group(ups + [bad])
    h = update_norm(honest.global_state, 4, 8.0)
    assert update_norm(attacked.global_state, 4, 8.0) > 1e4 * h  # the attack works unguarded


def test_the_round_reference_refuses_the_factor_attack_and_passes_honest_clients():
    rng = np.random.default_rng(1)
    sent, ups = _honest_group(rng)
    for u in ups:
        validate_update(u, "m", None, max_norm=1.0, reference=sent)
    with pytest.raises(MalformedUpdateError, match="factors are out of scale: its B with the round's A"):
        validate_update(_attacker(sent), "m", None, max_norm=1.0, reference=sent)
    # the mirror attack: a huge A and B = 0 (meets the round's non-zero B)
    mirror = {k: (f32(np.full(v.shape, 1e4)) if k.endswith(A) else np.zeros_like(v))
              for k, v in sent.items()}
    with pytest.raises(MalformedUpdateError, match="the round's B with its A"):
        validate_update(ClientUpdate(8, "m", 4, 8.0, 10, mirror), "m", None, max_norm=1.0,
                        reference=sent)


def test_the_aggregate_is_clipped_to_the_bound_and_honest_aggregates_are_untouched():
    from edgefuse.aggregation import cross_norm, update_norm

    rng = np.random.default_rng(2)
    sent, ups = _honest_group(rng)
    honest = aggregate_group(ups)
    same = aggregate_group(ups, max_norm=1.0)  # honest: within the bound, bit for bit FedAvg
    assert "clipped" not in same.info
    for k, v in honest.global_state.items():
        np.testing.assert_array_equal(same.global_state[k], v)
    attacked = aggregate_group(ups + [_attacker(sent)], max_norm=1.0)
    norm = update_norm(attacked.global_state, 4, 8.0)
    assert norm == pytest.approx(1.0, rel=1e-5)
    assert attacked.info["clipped"][4] > 1e3
    # A is kept (trainable), B scaled: the clipped state is the unclipped one times a constant
    raw = aggregate_group(ups + [_attacker(sent)])
    for k, v in attacked.global_state.items():
        if k.endswith(A):
            np.testing.assert_array_equal(v, raw.global_state[k])
    factor = 1.0 / update_norm(raw.global_state, 4, 8.0)
    np.testing.assert_allclose(attacked.global_state["q" + B], raw.global_state["q" + B] * factor,
                               rtol=1e-5)
    assert cross_norm(raw.global_state, raw.global_state, 4, 8.0) == update_norm(raw.global_state, 4, 8.0)


def test_flexlora_aggregate_is_clipped_per_rank():
    from edgefuse.aggregation import update_norm

    rng = np.random.default_rng(3)
    dims = {"q": (8, 6)}
    u0 = random_update(rng, 0, 2, 4.0, 5, dims)
    u1 = random_update(rng, 1, 4, 4.0, 5, dims)
    raw = aggregate_group([u0, u1], method="flexlora")
    n2 = update_norm(raw.per_client[0], 2, 4.0)
    n4 = update_norm(raw.per_client[1], 4, 4.0)
    bound = 0.5 * min(n2, n4)
    res = aggregate_group([u0, u1], method="flexlora", max_norm=bound)
    assert update_norm(res.per_client[0], 2, 4.0) == pytest.approx(bound, rel=1e-5)
    assert update_norm(res.per_client[1], 4, 4.0) == pytest.approx(bound, rel=1e-5)
    assert set(res.info["clipped"]) == {2, 4}


def test_unknown_equal_rank_mode_is_refused_by_the_aggregator_and_at_compose():
    from edgefuse.config import ConfigError, compose, validate

    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="unknown equal-rank aggregation 'mean'; valid: flexlora, fedavg"):
        aggregate_group([random_update(rng, 0, 2, 4.0, 1, {"q": (4, 3)})], equal_rank="mean")
    with pytest.raises(ConfigError, match="training.equal_rank must be one of flexlora, fedavg"):
        validate(compose("tiny", ["training.equal_rank=mean"]))


# ------------------------------------------------- robust aggregation (trimmed mean, median)

FIVE = [f32([[1, 2, 3], [4, 5, 6]]), f32([[2, 0, 9], [1, 1, 1]]), f32([[3, 4, -1], [0, 8, 2]]),
        f32([[10, 1, 0], [2, 2, 7]]), f32([[-5, 3, 4], [3, 6, 5]])]


def test_trimmed_mean_and_median_hand_values():
    from edgefuse.aggregation import coordinate_median, coordinate_trimmed_mean, robust_states

    x = np.stack(FIVE)  # [5, 2, 3]
    # per coordinate, sorted; k = floor(0.25 · 5) = 1 cut from each end, the middle 3 averaged:
    # (0,0) -5 [1 2 3] 10 -> 2     (0,1) 0 [1 2 3] 4 -> 2     (0,2) -1 [0 3 4] 9 -> 7/3
    # (1,0) 0 [1 2 3] 4 -> 2       (1,1) 1 [2 5 6] 8 -> 13/3  (1,2) 1 [2 5 6] 7 -> 13/3
    trimmed = [[2, 2, 7 / 3], [2, 13 / 3, 13 / 3]]
    median = [[2, 2, 3], [2, 5, 5]]  # the middle value of each sorted column above
    np.testing.assert_allclose(coordinate_trimmed_mean(x, 1), trimmed, rtol=1e-12)
    np.testing.assert_allclose(coordinate_median(x), median, rtol=1e-12)
    np.testing.assert_allclose(coordinate_trimmed_mean(x, 2), median, rtol=1e-12)  # k = 2 of 5
    np.testing.assert_allclose(coordinate_trimmed_mean(x, 0), [[2.2, 2, 3], [2, 4.4, 4.2]], rtol=1e-12)
    states = [{"k": v} for v in FIVE]
    out, k = robust_states(states, "trimmed_mean", 0.25)
    assert k == 1 and out["k"].dtype == np.float32
    np.testing.assert_allclose(out["k"], trimmed, rtol=1e-6)
    out, k = robust_states(states, "median")
    assert k == 2
    np.testing.assert_allclose(out["k"], median, rtol=1e-6)
    # an even count: the median is the mean of the two middle values, = the trimmed mean k=1
    four = np.stack(FIVE[:4])  # (0,2): -1 [0 3] 9 -> 1.5
    np.testing.assert_allclose(coordinate_median(four)[0, 2], 1.5)
    np.testing.assert_allclose(coordinate_median(four), coordinate_trimmed_mean(four, 1))
    with pytest.raises(ValueError, match="cannot cut 2 from each end of 4"):
        coordinate_trimmed_mean(four, 2)


def test_trim_count_is_floor_of_fraction_times_n_from_each_end():
    from edgefuse.aggregation import trim_count

    assert [trim_count(n, 0.25) for n in (1, 3, 4, 7, 8, 9)] == [0, 0, 1, 1, 2, 2]
    assert trim_count(100, 0.29) == 29  # 0.29 · 100 = 28.999999999999996 in floats
    assert trim_count(5, 0.4) == 2 and trim_count(5, 0.0) == 0
    for bad in (0.5, -0.1, float("nan"), "0.25"):
        with pytest.raises(ValueError, match=r"trim fraction must be in \[0, 0.5\)"):
            trim_count(4, bad)


def test_robust_rules_are_unweighted_and_recorded_in_info():
    ups = [ClientUpdate(p, "m", 1, 1.0, n, {"q" + A: v[:1, :], "q" + B: v[:, :1]})
           for p, (v, n) in enumerate(zip(FIVE, [1, 1, 1, 1, 10**6]))]
    res = aggregate_group(ups, robust="median")
    # client 4 claims a million examples: the median does not care ((0,0): median of
    # 1 2 3 10 -5 is 2; B column 0 = (1,4) (2,1) (3,0) (10,2) (-5,3) -> medians 2, 2)
    np.testing.assert_allclose(res.global_state["q" + A], [[2, 2, 3]])
    np.testing.assert_allclose(res.global_state["q" + B], [[2], [2]])
    assert res.info == {"method": "fedavg", "robust": "median", "trimmed_per_end": 2}
    res = aggregate_group(ups[:3], robust="trimmed_mean")  # floor(0.25 · 3) = 0: the plain mean
    assert res.info["trimmed_per_end"] == 0
    np.testing.assert_allclose(res.global_state["q" + A], [[2, 2, 11 / 3]], rtol=1e-6)
    assert aggregate_group(ups).info == {"method": "fedavg", "robust": "none", "trimmed_per_end": 0}
    with pytest.raises(ValueError, match="unknown robust aggregation 'krum'; valid: none, trimmed_mean, median"):
        aggregate_group(ups, robust="krum")
    with pytest.raises(ValueError, match=r"trim fraction must be in \[0, 0.5\)"):
        aggregate_group(ups, robust="trimmed_mean", trim_fraction=0.5)


def test_robust_flexlora_is_the_best_rank_r_factor_of_the_coordinate_median_of_products():
    from edgefuse.aggregation import robust_flexlora

    rng = np.random.default_rng(5)
    ups = [random_update(rng, p, r, 4.0, 1, {"q": (6, 5)}) for p, r in enumerate([1, 2, 2, 1, 2])]
    products = np.stack([delta(u.state, "q", u.rank, u.alpha) for u in ups])  # [5, 6, 5]
    for rule, want in (("median", np.median(products, axis=0)),
                       ("trimmed_mean", np.sort(products, axis=0)[1:4].mean(0))):
        states, info = robust_flexlora(ups, [1, 2], [4.0, 4.0], rule)
        assert info["trimmed_per_end"] == (2 if rule == "median" else 1)
        for state, r in zip(states, [1, 2]):
            best, err = best_rank(want, r)
            np.testing.assert_allclose(delta(state, "q", r, 4.0), best, atol=1e-4)
            assert info["truncation_error"][r] == pytest.approx(err, abs=1e-5)
    res = aggregate_group(ups, robust="median")  # different ranks: the products
    assert res.info["method"] == "flexlora" and res.info["robust"] == "median"
    best, _ = best_rank(np.median(products, axis=0), 2)
    np.testing.assert_allclose(delta(res.global_state, "q", 2, 4.0), best, atol=1e-4)


def _close_group(rng, n=4, noise=0.002):
    """Clients that took nearly the same step from the round's adapter: honest spread small."""
    dims = {"q": (16, 12), "v": (16, 12)}
    sent = {k: f32(v * (0.3 if k.endswith(A) else 0.01))
            for k, v in random_update(rng, -1, 4, 8.0, 1, dims).state.items()}
    step = {k: rng.normal(scale=0.01, size=v.shape) for k, v in sent.items()}
    ups = [ClientUpdate(p, "m", 4, 8.0, 10, {k: f32(v + step[k] + rng.normal(scale=noise, size=v.shape))
                                             for k, v in sent.items()}) for p in range(n)]
    return sent, ups


def _relative_distance(state, ref, rank=4, alpha=8.0):
    """‖ΔW(state) − ΔW(ref)‖_F / ‖ΔW(ref)‖_F over all modules."""
    mods = module_shapes(ref)
    num = sum(((delta(state, m, rank, alpha) - delta(ref, m, rank, alpha)) ** 2).sum() for m in mods)
    return float(np.sqrt(num / sum((delta(ref, m, rank, alpha) ** 2).sum() for m in mods)))


@pytest.mark.parametrize("sign", [1, -1], ids=["scaled", "sign_flipped"])
@pytest.mark.parametrize("equal_rank", ["fedavg", "flexlora"])
def test_one_malicious_client_of_four_within_the_bound_moves_fedavg_not_the_robust_rules(sign, equal_rank):
    from edgefuse.aggregation import cross_norm, update_norm

    bound = 5.0  # an honest update is ~0.3: the bound leaves a large margin to abuse
    for seed in range(3):
        sent, ups = _close_group(np.random.default_rng(seed))
        honest = aggregate_group(ups[:3], equal_rank=equal_rank).global_state  # honest-only
        st = {k: (v if k.endswith(A) else sign * v) for k, v in ups[3].state.items()}
        worst = max(update_norm(st, 4, 8.0), cross_norm(st, sent, 4, 8.0), cross_norm(sent, st, 4, 8.0))
        st = {k: (v if k.endswith(A) else f32(0.99 * bound / worst * v)) for k, v in st.items()}
        bad = ClientUpdate(3, "m", 4, 8.0, 10, st)
        validate_update(bad, "m", None, max_norm=bound, reference=sent)  # within every check
        dist = {rule: _relative_distance(
            aggregate_group(ups[:3] + [bad], max_norm=bound, equal_rank=equal_rank,
                            robust=rule).global_state, honest)
            for rule in ("none", "trimmed_mean", "median")}
        assert dist["none"] > 2.0, dist  # FedAvg: 3-5x the honest update off
        assert dist["trimmed_mean"] < 0.15 and dist["median"] < 0.15, dist  # honest spread only
    if equal_rank == "fedavg":  # each coordinate stays inside the honest clients' range
        got = aggregate_group(ups[:3] + [bad], robust="median").global_state
        for k in got:
            h = np.stack([u.state[k] for u in ups[:3]])
            assert (got[k] >= h.min(0) - 1e-7).all() and (got[k] <= h.max(0) + 1e-7).all()


def test_round_one_factor_attack_without_a_reference_is_contained_by_the_median():
    """Round 1: no adapter was sent yet, so A = 0 with a huge B passes validation (its own
    ‖ΔW‖ is 0) and FedAvg's aggregate is only clipped to the bound; the median of 4 ignores it."""
    from edgefuse.aggregation import update_norm

    sent, ups = _close_group(np.random.default_rng(7))
    bad = _attacker(sent, pid=3, scale=1e4)
    validate_update(bad, "m", None, max_norm=5.0, reference=None)
    honest = aggregate_group(ups[:3]).global_state
    fed = aggregate_group(ups[:3] + [bad], max_norm=5.0)
    assert fed.info["clipped"][4] > 1e3 and update_norm(fed.global_state, 4, 8.0) == pytest.approx(5.0, rel=1e-5)
    med = aggregate_group(ups[:3] + [bad], max_norm=5.0, robust="median")
    assert "clipped" not in med.info
    assert _relative_distance(fed.global_state, honest) > 10
    assert _relative_distance(med.global_state, honest) < 0.15


@pytest.mark.parametrize("override, message", [
    ("training.robust=mean", "training.robust must be one of none, trimmed_mean, median, got 'mean'"),
    ("training.robust=null", "training.robust must be one of none, trimmed_mean, median, got None"),
    ("training.trim_fraction=0.5", r"training.trim_fraction .* must be a number in \[0, 0.5\), got 0.5"),
    ("training.trim_fraction=-0.1", r"must be a number in \[0, 0.5\), got -0.1"),
    ("training.trim_fraction=quarter", r"must be a number in \[0, 0.5\), got 'quarter'"),
    ("training.trim_fraction=false", r"must be a number in \[0, 0.5\), got False"),  # a bool is no fraction
])
def test_robust_settings_are_refused_at_compose(override, message):
    from edgefuse.config import ConfigError, compose

    with pytest.raises(ConfigError, match=message):
        compose("tiny", [override])


def test_robust_settings_accepted_at_compose():
    from edgefuse.config import compose

    cfg = compose("tiny", ["training.robust=trimmed_mean", "training.trim_fraction=0"])
    assert (cfg.training.robust, cfg.training.trim_fraction) == ("trimmed_mean", 0)
    assert compose("tiny").training.robust == "none"
