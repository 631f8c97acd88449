"""The server's per-model-group round logic, driven with real Flower records."""

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from edgefuse.config import compose
from edgefuse.lora import pack_adapter, unpack_adapter
from edgefuse.app.strategy import GroupedLoRA, NodeInfo, NoClientSucceeded

KEY = "model.layers.0.self_attn.q_proj"


def state(a, b):
    return {f"{KEY}.lora_A.weight": np.array(a, np.float32),
            f"{KEY}.lora_B.weight": np.array(b, np.float32)}


def reply(node_id, pid, model, rank, st, n, alpha=16.0, loss=1.0):
    arrays, index = pack_adapter(st)
    content = RecordDict({
        "adapter": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        "meta": ConfigRecord({"partition_id": pid, "model": model, "lora_rank": rank,
                              "lora_alpha": alpha, "adapter_index": index}),
        "metrics": MetricRecord({"train_loss": loss, "seconds": 0.5, "num_examples": n}),
    })
    return SimpleNamespace(has_error=lambda: False, content=content,
                           metadata=SimpleNamespace(src_node_id=node_id))


def error_reply(node_id, reason):
    return SimpleNamespace(has_error=lambda: True, error=SimpleNamespace(reason=reason),
                           metadata=SimpleNamespace(src_node_id=node_id))


@pytest.fixture
def strategy():
    # hand-made states here are far larger than real adapters: no norm bound (see test_security)
    s = GroupedLoRA(compose("tiny", ["privacy.max_update_norm=null"]))
    s.nodes = {10: NodeInfo(10, 0, "tiny-llama", 1), 11: NodeInfo(11, 1, "tiny-llama", 1),
               12: NodeInfo(12, 2, "tiny-qwen2", 1)}
    return s


def test_fedavg_per_group_matches_hand_computed_values(strategy):
    replies = [reply(10, 0, "tiny-llama", 1, state([[1, 2]], [[1], [0]]), n=1),
               reply(11, 1, "tiny-llama", 1, state([[5, 6]], [[5], [4]]), n=3),
               reply(12, 2, "tiny-qwen2", 1, state([[9, 9]], [[9], [9]]), n=7)]
    rows, groups = strategy.aggregate_train(1, replies, {10: 0, 11: 0, 12: 0})
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"]
    llama = strategy.groups["tiny-llama"].global_state
    # weights 1/4 and 3/4: A = (1*[1,2] + 3*[5,6]) / 4, B likewise
    np.testing.assert_allclose(llama[f"{KEY}.lora_A.weight"], [[4.0, 5.0]])
    np.testing.assert_allclose(llama[f"{KEY}.lora_B.weight"], [[4.0], [3.0]])
    # the qwen2 group never mixes with llama
    np.testing.assert_allclose(strategy.groups["tiny-qwen2"].global_state[f"{KEY}.lora_A.weight"], [[9, 9]])
    assert {g["model"]: g["clients"] for g in groups} == {"tiny-llama": [0, 1], "tiny-qwen2": [2]}
    assert rows[0]["bytes_up"] == 4 * 4 + len(pack_adapter(state([[1, 2]], [[1], [0]]))[1].encode())


def test_next_round_messages_carry_each_clients_global(strategy):
    replies = [reply(10, 0, "tiny-llama", 1, state([[1, 2]], [[1], [0]]), n=1),
               reply(11, 1, "tiny-llama", 1, state([[5, 6]], [[5], [4]]), n=3),
               reply(12, 2, "tiny-qwen2", 1, state([[9, 9]], [[9], [9]]), n=7)]
    strategy.aggregate_train(1, replies, {})
    got, nbytes = strategy.content(2, strategy.client_state(strategy.nodes[12]))
    st = unpack_adapter({k: v.numpy() for k, v in got["adapter"].items()},
                        str(got["config"]["adapter_index"]))
    np.testing.assert_allclose(st[f"{KEY}.lora_B.weight"], [[9], [9]])
    assert nbytes == 16 + len(str(got["config"]["adapter_index"]).encode())
    assert got["config"]["round"] == 2
    # a client of a group with no global yet gets no adapter (it starts from its seeded init)
    strategy.nodes[13] = NodeInfo(13, 3, "tiny-gemma3", 1)
    assert strategy.client_state(strategy.nodes[13]) is None


def test_bad_updates_are_rejected_and_the_rest_aggregated(strategy):
    replies = [reply(10, 0, "tiny-llama", 1, state([[np.nan, 2]], [[1], [0]]), n=1),
               reply(11, 1, "tiny-llama", 1, state([[5, 6]], [[5], [4]]), n=3),
               error_reply(12, "ModelSpecError: unknown model")]
    rows, _ = strategy.aggregate_train(1, replies, {})
    assert rows[0]["status"] == "rejected" and "NaN" in rows[0]["reason"]
    assert rows[2]["status"] == "failed" and "unknown model" in rows[2]["reason"]
    # only client 1 was aggregated
    np.testing.assert_allclose(strategy.groups["tiny-llama"].global_state[f"{KEY}.lora_A.weight"], [[5, 6]])
    assert "tiny-qwen2" not in strategy.groups


def test_wrong_group_rank_or_partition_is_rejected(strategy):
    replies = [reply(10, 0, "tiny-qwen2", 1, state([[1, 2]], [[1], [0]]), n=1),  # wrong group
               reply(11, 5, "tiny-llama", 1, state([[5, 6]], [[5], [4]]), n=3),  # wrong partition
               reply(12, 2, "tiny-qwen2", 1, state([[9, 9]], [[9], [9]]), n=7)]
    rows, _ = strategy.aggregate_train(1, replies, {})
    assert rows[0]["status"] == "rejected" and "tiny-qwen2" in rows[0]["reason"]
    assert rows[1]["status"] == "rejected" and "partition" in rows[1]["reason"]
    assert rows[2]["status"] == "ok"


def test_shape_change_after_first_round_is_rejected(strategy):
    strategy.aggregate_train(1, [reply(10, 0, "tiny-llama", 1, state([[1, 2]], [[1], [0]]), n=1)], {})
    rows, _ = strategy.aggregate_train(2, [
        reply(10, 0, "tiny-llama", 1, state([[1, 2, 3]], [[1], [0]]), n=1),
        reply(12, 2, "tiny-qwen2", 1, state([[9, 9]], [[9], [9]]), n=7)], {})
    assert rows[0]["status"] == "rejected"


def test_a_round_without_any_usable_update_stops_the_run(strategy):
    with pytest.raises(NoClientSucceeded, match="no client returned a usable update"):
        strategy.aggregate_train(1, [error_reply(10, "boom"), error_reply(11, "boom")], {})
    with pytest.raises(NoClientSucceeded):
        strategy.aggregate_train(1, [], {})  # every client timed out


def test_different_ranks_use_flexlora(strategy):
    strategy.nodes[11] = NodeInfo(11, 1, "tiny-llama", 2)
    a1, b1 = [[1.0, 0.0]], [[1.0], [0.0]]
    a2, b2 = [[0.0, 1.0], [1.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]
    rows, groups = strategy.aggregate_train(1, [
        reply(10, 0, "tiny-llama", 1, state(a1, b1), n=1),
        reply(11, 1, "tiny-llama", 2, state(a2, b2), n=1),
        reply(12, 2, "tiny-qwen2", 1, state([[9, 9]], [[9], [9]]), n=7)], {})
    g = strategy.groups["tiny-llama"]
    assert groups[0]["method"] == "flexlora" and g.global_rank == 2
    # the rank-2 client's adapter reproduces the averaged ΔW exactly (ΔW has rank <= 2 here)
    s1, s2 = 16.0 / 1, 16.0 / 2
    dw = 0.5 * s1 * np.array(b1) @ np.array(a1) + 0.5 * s2 * np.array(b2) @ np.array(a2)
    st = g.per_client[1]
    np.testing.assert_allclose(s2 * st[f"{KEY}.lora_B.weight"] @ st[f"{KEY}.lora_A.weight"], dw, atol=1e-5)
    assert g.per_client[0][f"{KEY}.lora_A.weight"].shape == (1, 2)


def info_reply(node_id, rec):
    return SimpleNamespace(has_error=lambda: False, content=RecordDict({"info": ConfigRecord(rec)}),
                           metadata=SimpleNamespace(src_node_id=node_id))


def test_query_info_claims_are_checked_against_the_federation(strategy):
    """A node cannot claim a partition that is not in federation.clients or already taken,
    another model or rank than its partition runs, or a malformed key; a malformed reply is
    refused without stopping the others."""
    strategy.nodes = {}
    entry = strategy.cfg.federation.clients[0]
    model, rank = str(entry.model), int(entry.lora_rank)
    other = next(c for c in strategy.cfg.federation.clients if str(c.model) != model)
    e1 = strategy.cfg.federation.clients[1]
    model1, rank1 = str(e1.model), int(e1.lora_rank)
    assert str(other.model) != model1
    honest = {"partition_id": 0, "model": model, "lora_rank": rank, "public_key": bytes(32)}
    replies = [
        info_reply(1, honest),
        info_reply(2, {**honest}),                                      # partition 0 again
        info_reply(3, {**honest, "partition_id": -1}),                  # out of range
        info_reply(4, {**honest, "partition_id": 99}),
        info_reply(5, {**honest, "partition_id": 1, "model": str(other.model), "lora_rank": rank1}),
        info_reply(6, {**honest, "partition_id": 1, "model": model1, "lora_rank": rank1 * 16}),
        info_reply(7, {"partition_id": 2, "model": str(strategy.cfg.federation.clients[2].model),
                       "lora_rank": int(strategy.cfg.federation.clients[2].lora_rank),
                       "public_key": b"ATTACKER-KEY"}),
        info_reply(8, {"partition_id": "abc", "model": model, "lora_rank": rank}),
        SimpleNamespace(has_error=lambda: False, content=RecordDict({}),
                        metadata=SimpleNamespace(src_node_id=9)),
    ]
    errors = strategy.add_info(replies)
    assert set(strategy.nodes) == {1}
    assert strategy.nodes[1].partition_id == 0 and strategy.nodes[1].model == model
    text = "\n".join(errors)
    assert len(errors) == 8
    assert "node 2: query.info refused: partition id 0 is already node 1's" in text
    assert "node 3: query.info refused: partition id -1 is not in federation.clients" in text
    assert "node 4: query.info refused: partition id 99" in text
    assert f"node 5: query.info refused: claims {other.model} rank {rank1}, but partition 1 runs {model1}" in text
    assert f"node 6: query.info refused: claims {model1} rank {rank1 * 16}" in text
    assert "node 7: query.info refused: public key of 12 bytes" in text
    assert "node 8: malformed query.info reply (ValueError" in text
    assert "node 9: malformed query.info reply (KeyError" in text


@pytest.mark.parametrize("rule, trimmed, a_want, b_want", [
    # A per coordinate: (1 2 3 10 -5) and (2 0 4 1 3); B: (1 2 3 10 -5) and (4 1 0 2 3)
    ("trimmed_mean", 1, [[2.0, 2.0]], [[2.0], [2.0]]),   # drop 1 from each end, mean of 3
    ("median", 2, [[2.0, 2.0]], [[2.0], [2.0]]),
    ("none", 0, None, None),  # FedAvg, computed below from the capped weights
])
def test_the_robust_rule_is_applied_and_recorded_per_group(rule, trimmed, a_want, b_want):
    s = GroupedLoRA(compose("tiny", ["privacy.max_update_norm=null", f"training.robust={rule}",
                                     "training.trim_fraction=0.25"]))
    s.nodes = {20 + p: NodeInfo(20 + p, p, "tiny-llama", 1) for p in range(5)}
    a = [[1, 2], [2, 0], [3, 4], [10, 1], [-5, 3]]
    b = [[1, 4], [2, 1], [3, 0], [10, 2], [-5, 3]]
    n = [1, 1, 1, 13, 100]  # claims; the server caps them at steps × batch = 6 (tiny)
    replies = [reply(20 + p, p, "tiny-llama", 1, state([a[p]], [[b[p][0]], [b[p][1]]]), n=n[p])
               for p in range(5)]
    rows, groups = s.aggregate_train(1, replies, {})
    assert [r["status"] for r in rows] == ["ok"] * 5
    assert groups[0]["method"] == "fedavg"
    assert groups[0]["robust"] == rule and groups[0]["trimmed_per_end"] == trimmed
    assert s.groups["tiny-llama"].info["robust"] == rule
    g = s.groups["tiny-llama"].global_state
    if rule == "none":  # FedAvg with the capped weights 1, 1, 1, 6, 6
        w = np.array([1, 1, 1, 6, 6]) / 15
        a_want = [(w[:, None] * np.array(a)).sum(0).tolist()]
        b_want = (w[:, None] * np.array(b)).sum(0)[:, None].tolist()
    np.testing.assert_allclose(g[f"{KEY}.lora_A.weight"], a_want, rtol=1e-6)
    np.testing.assert_allclose(g[f"{KEY}.lora_B.weight"], b_want, rtol=1e-6)


def test_a_trimmed_mean_that_cuts_nothing_is_recorded_and_warned(monkeypatch):
    from edgefuse.app import strategy as strategy_mod

    warned = []
    monkeypatch.setattr(strategy_mod, "log", lambda level, msg, *args: warned.append(msg % args))
    s = GroupedLoRA(compose("tiny", ["privacy.max_update_norm=null", "training.robust=trimmed_mean"]))
    s.nodes = {20 + p: NodeInfo(20 + p, p, "tiny-llama", 1) for p in range(3)}
    replies = [reply(20 + p, p, "tiny-llama", 1, state([[v, 0]], [[v], [0]]), n=6 if p else 1)
               for p, v in enumerate([1.0, 2.0, 6.0])]
    _, groups = s.aggregate_train(1, replies, {})
    assert groups[0]["trimmed_per_end"] == 0
    # floor(0.25 · 3) = 0: the unweighted mean (1 + 2 + 6) / 3, not the weighted (1 + 12 + 36) / 13
    np.testing.assert_allclose(s.groups["tiny-llama"].global_state[f"{KEY}.lora_A.weight"], [[3.0, 0.0]])
    assert any("the trimmed mean of 3 update(s) at trim_fraction 0.25 cuts nothing" in w for w in warned)
