"""The server's fuser service (edgefuse.c2c.hub): train / cache / carry over / retrain, failures,
the pair list and the several-sharers gate, on the tiny config (tiny random-weight models).

Needs the Dolly mirror (the public split trains the fusers); skipped without it.
"""

import math

import numpy as np
import pytest
import torch

from edgefuse.config import ConfigError, compose, lora_targets
from edgefuse.lora import attach_lora, get_adapter_state
from edgefuse.models import get_spec, tiny_model
from edgefuse.c2c import hub as service_mod
from edgefuse.eval.splits import public_slices
from edgefuse.c2c.fuser import kv_spec_from_config
from edgefuse.c2c.multi import MultiSharerGate
from edgefuse.c2c.registry import FuserRegistry, adapter_change
from edgefuse.c2c.hub import FuserService, Side, pair_list, train_multi_gate
from tests.conftest import mirror_path

LLAMA, QWEN, GEMMA = "tiny-llama", "tiny-qwen2", "tiny-gemma3"
RANK = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    mirror = mirror_path()
    if mirror is None:
        pytest.skip("no data mirror: set EDGEFUSE_DATA_MIRROR or place ../shared/data")
    return compose("tiny", [f"data.mirror={mirror}", "c2c.train.threads=1", "c2c.fuser.bottleneck=8",
                            f"paths.cache_dir={tmp_path_factory.mktemp('cache')}"])


@pytest.fixture(scope="module")
def public(cfg):
    return public_slices(cfg.data, int(cfg.seed))


def adapter(cfg, name, seed):
    """A real LoRA state of the tiny model ``name`` with a random, non-zero lora_B."""
    model, _ = tiny_model(get_spec(name).arch)
    peft = attach_lora(model, rank=RANK, alpha=float(cfg.training.lora_alpha), dropout=0.0,
                       target_modules=lora_targets(cfg, name), seed=int(cfg.seed))
    state = get_adapter_state(peft)
    rng = np.random.default_rng(seed)
    for key in state:
        if ".lora_B." in key:
            state[key] = rng.normal(0.0, 0.05, state[key].shape).astype(np.float32)
    assert any(np.abs(v).max() > 0 for k, v in state.items() if ".lora_B." in k)
    return state


def side(cfg, name, state, pid=0):
    return Side(name, pid, state, RANK, float(cfg.training.lora_alpha))


def scaled(state, factor):
    return {k: (v * factor if ".lora_B." in k else v.copy()) for k, v in state.items()}


def no_training(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("train_fuser must not run")

    monkeypatch.setattr(service_mod, "train_fuser", boom)


def by_pair(rows):
    return {(r["sharer"], r["receiver"]): r for r in rows}


def test_update_trains_caches_carries_over_and_retrains(cfg, tmp_path, monkeypatch):
    pairs = [(QWEN, LLAMA), (LLAMA, QWEN)]
    sides = {LLAMA: side(cfg, LLAMA, adapter(cfg, LLAMA, 1)), QWEN: side(cfg, QWEN, adapter(cfg, QWEN, 2), 2)}
    reg = FuserRegistry(tmp_path / "reg")
    svc = FuserService(cfg, reg)

    # 1. first update: both pairs trained and registered
    rows = by_pair(svc.update(sides, pairs, round_idx=1))
    first = {}
    for s, r in pairs:
        row = rows[(s, r)]
        version = svc.version(sides[s], sides[r])
        assert row["action"] == "trained", row.get("reason")
        assert row["version"] == version.id and row["round"] == 1
        assert reg.latest(s, r) == version
        assert row["params"] > 0 and row["bytes"] == 4 * row["params"]
        assert row["train_steps"] == int(cfg.c2c.train.steps) and row["train_seconds"] > 0
        assert math.isfinite(row["val_loss"]) and math.isfinite(row["alone_val_loss"])
        state, _, card = reg.load_state(version)
        assert card.params == row["params"] and card.receiver_adapter_hash == sides[r].version().adapter_hash
        first[(s, r)] = (version, state)
    assert not (reg.root / ".checkpoints" / f"{QWEN}__to__{LLAMA}").exists() or \
        not any((reg.root / ".checkpoints" / f"{QWEN}__to__{LLAMA}").iterdir())

    # 2. same sides again: cached, nothing trained
    no_training(monkeypatch)
    rows = by_pair(svc.update(sides, pairs, round_idx=2))
    for p in pairs:
        assert rows[p]["action"] == "cached", rows[p].get("reason")
        assert rows[p]["train_seconds"] == 0.0 and rows[p]["version"] == first[p][0].id
        assert rows[p]["params"] == reg.load_state(first[p][0])[2].params

    # 3. a fresh service on the same registry: cached too
    svc2 = FuserService(cfg, FuserRegistry(tmp_path / "reg"))
    rows = by_pair(svc2.update(sides, pairs, round_idx=3))
    assert {p: rows[p]["action"] for p in pairs} == {p: "cached" for p in pairs}

    # 4. a tiny adapter change on the llama side: carried over, same weights, new version
    small = scaled(sides[LLAMA].state, 1.01)
    change = adapter_change(sides[LLAMA].state, small)
    assert change == pytest.approx(0.01, rel=1e-3) and change < float(cfg.c2c.train.retrain_threshold)
    sides_small = {**sides, LLAMA: side(cfg, LLAMA, small)}
    rows = by_pair(svc2.update(sides_small, pairs, round_idx=4))
    for s, r in pairs:
        row, (old_version, old_state) = rows[(s, r)], first[(s, r)]
        assert row["action"] == "carried_over", row.get("reason")
        new_version = svc2.version(sides_small[s], sides_small[r])
        assert row["version"] == new_version.id != old_version.id
        assert reg.latest(s, r) == new_version
        state, _, card = reg.load_state(new_version)
        assert f"carried over from {old_version.id}" in card.data
        assert card.train_steps == int(cfg.c2c.train.steps)
        assert state.keys() == old_state.keys()
        assert all(torch.equal(state[k], old_state[k]) for k in state)
        assert row["train_seconds"] == 0.0

    # 5. a big change: trained again (warm start), new version again
    monkeypatch.undo()
    big = scaled(sides[LLAMA].state, 3.0)
    assert adapter_change(small, big) > float(cfg.c2c.train.retrain_threshold)
    sides_big = {**sides, LLAMA: side(cfg, LLAMA, big)}
    rows = by_pair(svc2.update(sides_big, pairs, round_idx=5))
    for s, r in pairs:
        version = svc2.version(sides_big[s], sides_big[r])
        assert rows[(s, r)]["action"] == "trained", rows[(s, r)].get("reason")
        assert rows[(s, r)]["version"] == version.id and reg.latest(s, r) == version
    assert svc2.rows == list(rows.values())


def test_failed_pair_does_not_stop_the_others(cfg, public, tmp_path):
    sides = {LLAMA: side(cfg, LLAMA, adapter(cfg, LLAMA, 1)), QWEN: side(cfg, QWEN, None, 2),
             "no-such-model": Side("no-such-model", 3, None, RANK, 16.0)}
    reg = FuserRegistry(tmp_path)
    rows = FuserService(cfg, reg, slices=public).update(sides, [("no-such-model", LLAMA), (QWEN, LLAMA)], 1)
    assert [r["action"] for r in rows] == ["failed", "trained"]
    assert "ModelSpecError" in rows[0]["reason"] and "no-such-model" in rows[0]["reason"]
    assert rows[0]["params"] is None and rows[0]["train_steps"] == 0
    assert reg.latest("no-such-model", LLAMA) is None
    assert reg.latest(QWEN, LLAMA).id == rows[1]["version"] and rows[1]["params"] > 0


def test_pair_list():
    models = ["a", "b", "c"]
    every = pair_list("all", models)
    assert len(every) == 6 and len(set(every)) == 6
    assert set(every) == {(s, r) for s in models for r in models if s != r}
    assert pair_list(None, models) == every
    assert pair_list(["a->b"], models) == [("a", "b")]
    assert pair_list([" c -> a ", "a->c"], models) == [("c", "a"), ("a", "c")]
    for bad, msg in ((["a-b"], "must look like"), (["a->b->c"], "must look like"), (["->b"], "must look like"),
                     (["a->z"], "'z' is not a model"), (["a->a"], "with itself")):
        with pytest.raises(ConfigError, match=msg):
            pair_list(bad, models)


def test_train_multi_gate(cfg, public, tmp_path):
    """The gate of tiny-llama over two sharers trains on fuser_train and is scored on the
    held-out fuser_val rows; a budget at which the fusers (and so the gate) matter."""
    cfg = cfg.copy()
    cfg.c2c.train.update({"steps": 8, "lr": 3e-2, "gate_steps": 8})
    sides = {LLAMA: side(cfg, LLAMA, adapter(cfg, LLAMA, 1)), QWEN: side(cfg, QWEN, adapter(cfg, QWEN, 2), 2),
             GEMMA: side(cfg, GEMMA, adapter(cfg, GEMMA, 3), 3)}
    svc = FuserService(cfg, FuserRegistry(tmp_path), slices=public)
    rows = svc.update(sides, [(QWEN, LLAMA), (GEMMA, LLAMA)], 1)
    assert [r["action"] for r in rows] == ["trained", "trained"], [r.get("reason") for r in rows]
    state, meta = train_multi_gate(cfg, svc, sides, LLAMA, [QWEN, GEMMA])
    model, _ = tiny_model("llama")
    ref = MultiSharerGate(kv_spec_from_config(model.config), 2)
    assert {k: tuple(v.shape) for k, v in state.items()} == \
        {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert all(v.dtype == np.float32 for v in state.values())
    assert meta["params"] == ref.num_parameters() == sum(v.size for v in state.values()) > 0
    assert meta["steps"] == int(cfg.c2c.train.gate_steps) == 8
    assert meta["kwargs"] == {"drop_threshold": ref.drop_threshold}
    # scored on the held-out fuser_val rows (the gate trains on fuser_train): training lowered it
    print(f"gate held-out loss {meta['loss_before']:.5f} -> {meta['loss_after']:.5f}")
    assert math.isfinite(meta["loss_before"]) and meta["loss_before"] > 0
    assert meta["loss_after"] < meta["loss_before"] - 0.003, meta  # measured 5.860 -> 5.853


def test_fusers_train_on_the_fuser_slices(cfg, public, tmp_path, monkeypatch):
    """The service takes its rows from the public split's fuser_train / fuser_val slices."""
    seen = []
    real = service_mod.build_pair_examples

    def record(rows, *a, **kw):
        seen.append(rows)
        return real(rows, *a, **kw)

    from edgefuse.c2c import prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "build_pair_examples", record)  # built once, then kept by the store
    sides = {LLAMA: side(cfg, LLAMA, None), QWEN: side(cfg, QWEN, None, 2)}
    rows = FuserService(cfg, FuserRegistry(tmp_path)).update(sides, [(QWEN, LLAMA)], 1)
    assert rows[0]["action"] == "trained", rows[0].get("reason")
    assert len(public.fuser_train) == int(cfg.c2c.train.examples) == 8 and len(public.fuser_val) == 8
    dolly = ("instruction", "context", "response", "category")  # the training rows add their source
    assert [[{k: r[k] for k in dolly} for r in seen[0]], seen[1]] == [public.rows("fuser_train"),
                                                                     public.rows("fuser_val")]
    assert {r["source"] for r in seen[0]} == {"dolly_public"}


def test_controls_train_two_more_versions_with_the_same_budget(cfg, tmp_path):
    """c2c.eval.controls: each pair gets a zero- and a shuffled-sharer fuser, its own registry
    version (the config hash differs), trained with the real fuser's steps on the same rows,
    sharing the prompt caches; the pair's `latest` stays the real fuser."""
    from omegaconf import OmegaConf

    on = OmegaConf.merge(cfg, OmegaConf.create({"c2c": {"eval": {"controls": True}}}))
    sides = {LLAMA: side(cfg, LLAMA, adapter(cfg, LLAMA, 1)), QWEN: side(cfg, QWEN, adapter(cfg, QWEN, 2), 2)}
    reg = FuserRegistry(tmp_path / "reg")
    svc = FuserService(on, reg)
    assert svc.controls() == ["none", "zero", "shuffled"]
    assert FuserService(cfg, reg).controls() == ["none"]
    rows = svc.update(sides, [(QWEN, LLAMA)], round_idx=1)
    assert [(r["control"], r["action"]) for r in rows] == [("none", "trained"), ("zero", "trained"),
                                                           ("shuffled", "trained")], [r.get("reason") for r in rows]
    versions = [svc.version(sides[QWEN], sides[LLAMA], c) for c in ("none", "zero", "shuffled")]
    assert len({v.id for v in versions}) == 3 and [r["version"] for r in rows] == [v.id for v in versions]
    cards = [reg.load_state(v)[2] for v in versions]
    assert len({c.train_steps for c in cards}) == 1 and len({c.train_examples for c in cards}) == 1
    assert [reg.load_state(v)[1]["sharer_control"] for v in versions] == ["none", "zero", "shuffled"]
    assert "control: zero" in cards[1].data and "control" not in cards[0].data
    states = [reg.load_state(v)[0] for v in versions]
    assert any(not torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert reg.latest(QWEN, LLAMA) == versions[0]
    store = svc.prefill_store()
    assert store.root == reg.root / ".prefill" and any(store.root.rglob("*.safetensors"))
    # again: all three cached
    again = svc.update(sides, [(QWEN, LLAMA)], round_idx=2)
    assert [r["action"] for r in again] == ["cached"] * 3


@pytest.mark.parametrize("override,match", [
    ("c2c.train.threads=0", "c2c.train.threads"), ("c2c.train.threads=many", "c2c.train.threads"),
    ("c2c.train.device=tpu", "c2c.train.device"), ("c2c.train.amp=fp8", "c2c.train.amp"),
    ("c2c.train.micro_batch=0", "c2c.train.micro_batch"), ("c2c.train.length_group=-1", "length_group"),
    ("c2c.train.prefill_dtype=int4", "prefill_dtype")])
def test_training_runtime_settings_are_checked_at_compose(override, match):
    service_mod.check_config(compose("tiny"))  # the defaults pass
    with pytest.raises(ConfigError, match=match):
        service_mod.check_config(compose("tiny", [override]))


def test_training_device_auto_is_the_cpu_without_cuda(monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = OmegaConf.create({"device": "auto", "amp": "auto", "threads": 3})
    assert service_mod.train_device(t).type == "cpu" and service_mod.train_threads(t) == 3
    assert service_mod.use_amp(t, torch.device("cpu")) is False
    with pytest.raises(ConfigError, match="no CUDA device"):
        service_mod.train_device(OmegaConf.create({"device": "cuda"}))


def test_a_stale_checkpoint_of_another_schedule_is_trained_afresh(cfg, tmp_path):
    """A checkpoint left in the pair's folder by an interrupted run with another step count
    (same version: the fuser config is the same) is not resumed into this run: the pair is
    trained from step 0 and ends with exactly the fresh run's weights."""
    from edgefuse.c2c import C2CFuser
    from edgefuse.c2c.examples import build_pair_examples
    from edgefuse.c2c.train import train_fuser

    cfg = cfg.copy()
    cfg.c2c.train.update({"steps": 4})
    sides = {LLAMA: side(cfg, LLAMA, adapter(cfg, LLAMA, 1)), QWEN: side(cfg, QWEN, adapter(cfg, QWEN, 2), 2)}
    fresh = FuserService(cfg, FuserRegistry(tmp_path / "fresh"))
    assert [r["action"] for r in fresh.update(sides, [(QWEN, LLAMA)], 1)] == ["trained"]
    version = fresh.version(sides[QWEN], sides[LLAMA])
    want = fresh.registry.load_state(version)[0]

    svc = FuserService(cfg, FuserRegistry(tmp_path / "stale"))
    (r_model, r_tok), (s_model, s_tok) = (service_mod.load_public_copy(cfg, sides[n]) for n in (LLAMA, QWEN))
    examples = build_pair_examples(svc.public("fuser_train"), r_tok, s_tok, int(cfg.c2c.train.max_seq_len))
    ckpt = svc.registry.root / ".checkpoints" / f"{QWEN}__to__{LLAMA}" / version.id
    stale = C2CFuser(kv_spec_from_config(r_model.config), kv_spec_from_config(s_model.config), svc.fcfg)
    train_fuser(stale, r_model, s_model, examples, steps=12, batch_size=int(cfg.c2c.train.batch_size),
                lr=float(cfg.c2c.train.lr), seed=int(cfg.seed), checkpoint_dir=ckpt, until=2, progress=False,
                length_group=int(cfg.c2c.train.length_group))  # only the step count differs
    assert any(ckpt.iterdir())
    rows = svc.update(sides, [(QWEN, LLAMA)], 1)
    assert [r["action"] for r in rows] == ["trained"], [r.get("reason") for r in rows]
    got = svc.registry.load_state(version)[0]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_train_multi_gate_with_threads_auto(cfg, public, tmp_path):
    """c2c.train.threads=auto (the default) also sets the gate's training threads."""
    cfg = cfg.copy()
    cfg.c2c.train.update({"steps": 1, "gate_steps": 1, "threads": "auto"})
    sides = {LLAMA: side(cfg, LLAMA, None), QWEN: side(cfg, QWEN, None, 2)}
    svc = FuserService(cfg, FuserRegistry(tmp_path), slices=public)
    assert [r["action"] for r in svc.update(sides, [(QWEN, LLAMA)], 1)] == ["trained"]
    threads = torch.get_num_threads()
    state, meta = train_multi_gate(cfg, svc, sides, LLAMA, [QWEN])
    assert meta["steps"] == 1 and state and torch.get_num_threads() == threads
