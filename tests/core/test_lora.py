"""LoRA state I/O, wire packing and PEFT folders on tiny random-weight models."""

import json

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors import safe_open

from edgefuse.lora import (
    MalformedUpdateError,
    adapter_nbytes,
    attach_lora,
    get_adapter_state,
    lora_scaling,
    pack_adapter,
    save_peft_adapter,
    set_adapter_state,
    unpack_adapter,
)
from edgefuse.models import tiny_model

TARGETS = ("q_proj", "v_proj")
IDS = torch.tensor([[1, 5, 7, 9, 11, 13, 2, 4]])


def peft_tiny(arch="llama", rank=4, alpha=8.0, seed=0):
    model, _ = tiny_model(arch)
    return attach_lora(model, rank, alpha, 0.0, TARGETS, seed)


def perturbed(state, seed=0):
    rng = np.random.default_rng(seed)
    return {k: (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in state.items()}


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_state_keys_and_shapes():
    state = get_adapter_state(peft_tiny(rank=4))
    assert len(state) == 3 * 2 * 2  # 3 layers × (q, v) × (A, B)
    a = state["model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = state["model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (64, 4)  # A [r, in], B [out, r]
    assert state["model.layers.2.self_attn.v_proj.lora_B.weight"].shape == (32, 4)  # 2 kv × 16
    assert all(v.dtype == np.float32 for v in state.values())
    assert not b.any()  # peft init: B = 0


def test_lora_scaling():
    assert lora_scaling(8, 16) == 2.0
    with pytest.raises(ValueError):
        lora_scaling(0, 16)


def test_same_seed_same_a():
    s1, s2 = get_adapter_state(peft_tiny(seed=3)), get_adapter_state(peft_tiny(seed=3))
    s3 = get_adapter_state(peft_tiny(seed=4))
    key = "model.layers.1.self_attn.v_proj.lora_A.weight"
    np.testing.assert_array_equal(s1[key], s2[key])
    assert not np.array_equal(s1[key], s3[key])


def test_get_set_round_trip_changes_output():
    model = peft_tiny()
    base = logits(model)  # B = 0: the adapter changes nothing yet
    state = perturbed(get_adapter_state(model))
    set_adapter_state(model, state)
    tuned = logits(model)
    assert not torch.allclose(base, tuned, atol=1e-4)

    fresh = peft_tiny(seed=9)
    set_adapter_state(fresh, state)
    torch.testing.assert_close(logits(fresh), tuned, rtol=0, atol=1e-6)
    back = get_adapter_state(fresh)
    assert all(np.array_equal(back[k], state[k]) for k in state)


def test_set_state_rejects_before_writing():
    model = peft_tiny()
    before = get_adapter_state(model)
    state = perturbed(before)
    key = "model.layers.0.self_attn.q_proj.lora_B.weight"
    missing = {k: v for k, v in state.items() if k != key}
    with pytest.raises(ValueError, match=f"missing adapter key {key}"):
        set_adapter_state(model, missing)
    with pytest.raises(ValueError, match="unexpected adapter key model.extra.lora_A.weight"):
        extra = np.zeros((4, 64), np.float32)
        set_adapter_state(model, {**state, "model.extra.lora_A.weight": extra})
    with pytest.raises(ValueError, match=rf"{key}: shape \(64, 3\), model has \(64, 4\)"):
        set_adapter_state(model, {**state, key: np.zeros((64, 3), np.float32)})
    after = get_adapter_state(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # untouched


# ---------------------------------------------------------------- packing


def test_pack_unpack_round_trip():
    state = perturbed(get_adapter_state(peft_tiny("qwen2", rank=3)))
    arrays, index_json = pack_adapter(state)
    assert set(arrays) == {"lora_A", "lora_B"}
    assert all(a.ndim == 1 and a.dtype == np.float32 for a in arrays.values())
    assert adapter_nbytes(arrays) == sum(4 * v.size for v in state.values())
    index = json.loads(index_json)
    assert [e["key"] for e in index] == sorted(state)
    back = unpack_adapter(arrays, index_json)
    assert set(back) == set(state)
    for k, v in state.items():
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], v)


def tampered(mutate):
    arrays, index_json = pack_adapter(perturbed(get_adapter_state(peft_tiny())))
    index = json.loads(index_json)
    arrays = dict(arrays)
    mutate(arrays, index)
    return arrays, json.dumps(index)


@pytest.mark.parametrize("mutate, message", [
    (lambda a, i: i[0].update(offset=10**9), "out of bounds"),
    (lambda a, i: i[0].update(offset=-1), "bad shape/offset/size"),
    (lambda a, i: i[0].update(size=i[0]["size"] - 1), "!= prod"),
    (lambda a, i: i[0].update(shape=[i[0]["shape"][0] - 1, i[0]["shape"][1]],
                              size=i[0]["size"] - i[0]["shape"][1]), "gap or overlap"),
    (lambda a, i: i.pop(), "add up to"),
    (lambda a, i: a.update(lora_B=np.append(a["lora_B"], np.float32(0))), "add up to"),
    (lambda a, i: i[2].update(offset=0), "gap or overlap"),
    (lambda a, i: i[2].update(key=i[0]["key"]), "repeated key"),
    (lambda a, i: i[0].update(part="lora_B"), "is not in part"),
    (lambda a, i: i[0].pop("size"), "lacks"),
    (lambda a, i: a.pop("lora_A"), "missing packed part 'lora_A'"),
    (lambda a, i: a.update(lora_A=a["lora_A"].astype(np.int32)), "1-D float array"),
    (lambda a, i: a.update(lora_A=a["lora_A"].reshape(1, -1)), "1-D float array"),
])
def test_unpack_rejects_tampering(mutate, message):
    arrays, index_json = tampered(mutate)
    with pytest.raises(MalformedUpdateError, match=message):
        unpack_adapter(arrays, index_json)


def test_unpack_rejects_bad_json():
    arrays, _ = pack_adapter(get_adapter_state(peft_tiny()))
    with pytest.raises(MalformedUpdateError, match="not valid JSON"):
        unpack_adapter(arrays, "[{not json")
    with pytest.raises(MalformedUpdateError, match="JSON list"):
        unpack_adapter(arrays, '{"key": 1}')


# ---------------------------------------------------------------- PEFT folders


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_save_peft_adapter_loads_with_from_pretrained(arch, tmp_path):
    model = peft_tiny(arch, rank=4, alpha=16.0)
    state = perturbed(get_adapter_state(model))
    set_adapter_state(model, state)
    out = save_peft_adapter(state, tmp_path / "adapter", "tiny-" + arch, 4, 16.0, TARGETS)
    assert out == (tmp_path / "adapter").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temp folder left
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 16.0)
    assert config["base_model_name_or_path"] == "tiny-" + arch

    # The file keys are the ones peft itself writes.
    model.save_pretrained(tmp_path / "peft_ref")
    with safe_open(out / "adapter_model.safetensors", "np") as ours, \
            safe_open(tmp_path / "peft_ref" / "adapter_model.safetensors", "np") as ref:
        assert set(ours.keys()) == set(ref.keys())

    base, _ = tiny_model(arch)
    loaded = PeftModel.from_pretrained(base, out)
    loaded.eval()
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=1e-6)


def test_save_peft_adapter_replaces_existing_and_validates(tmp_path):
    state = get_adapter_state(peft_tiny())
    save_peft_adapter(state, tmp_path / "a", "tiny", 4, 8.0, TARGETS)
    (tmp_path / "a" / "stale.txt").write_text("old")
    save_peft_adapter(state, tmp_path / "a", "tiny", 4, 8.0, TARGETS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert not (tmp_path / "a" / "stale.txt").exists()
    with pytest.raises(ValueError, match="does not match rank 8"):
        save_peft_adapter(state, tmp_path / "b", "tiny", 8, 8.0, TARGETS)
    with pytest.raises(ValueError, match="not matched by target_modules"):
        save_peft_adapter(state, tmp_path / "b", "tiny", 4, 8.0, ["q_proj"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
