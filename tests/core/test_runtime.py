"""Device runtimes: profiles, the ONNX export and its cache, and the runtime interface
(prefill + steps + rollback) of the PyTorch and ONNX Runtime implementations on tiny models
of each architecture, exported in the test."""

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_genai")

from edgefuse.cloud.decoding import EdgeLM, OnnxEdgeLM  # noqa: E402
from edgefuse.export import export_folder, export_key, export_onnx, is_exported  # noqa: E402
from edgefuse.lora import attach_lora, get_adapter_state, merged_state_dict, set_adapter_state  # noqa: E402
from edgefuse.models import tiny_model  # noqa: E402
from edgefuse.runtime import DeviceProfile, OnnxDecoder, ProfileError  # noqa: E402

TINY = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-gemma3": "gemma3_text"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def exported(root):
    """fp32 exports of the three tiny models (base weights)."""
    return {name: export_onnx(name, "fp32", root=root) for name in TINY}


def _prompt(tok, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, len(tok) - 1, (n,), generator=g).tolist()


@pytest.mark.parametrize("name", list(TINY))
def test_fp32_onnx_logits_match_pytorch(exported, name):
    """Full-forward parity, on a prompt longer than Gemma 3's 16-token sliding window."""
    model, tok = tiny_model(TINY[name])
    ids = _prompt(tok)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    dec = OnnxDecoder(exported[name].folder)
    logits, present = dec.forward(ids, dec.empty())
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() < 1e-4
    assert dec.length(present) == len(ids)


@pytest.mark.parametrize("name", list(TINY))
def test_runtime_conformance_prefill_steps_rollback(exported, name):
    """Both implementations, driven through prefill, single steps, a rollback and a re-feed of
    *other* tokens (a stale cache would show), give the next-token logits of one full forward
    of the sequence they hold at every point."""
    model, tok = tiny_model(TINY[name])
    ids = _prompt(tok, 30, seed=1)
    alt = ids[:14] + _prompt(tok, 8, seed=9)  # the same prefix, then other tokens
    assert alt[14:19] != ids[14:19]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
        ref_alt = model(input_ids=torch.tensor([alt])).logits[0]
    for lm in (EdgeLM(model, tok), OnnxEdgeLM(OnnxDecoder(exported[name].folder), tok)):
        lm.start(ids[:10])
        got = {("ids", 9): lm.logits()}
        for i in range(10, 20):
            lm.push(ids[i])
            got[("ids", i)] = lm.logits()
        lm.rollback(14)  # drop 6 cached tokens, then feed 5 others at once
        assert lm.tokens == ids[:14]
        lm.sync(alt[:19])
        got[("alt", 18)] = lm.logits()
        lm.rollback(12)
        lm.push(alt[12])
        got[("alt", 12)] = lm.logits()
        for (seq, i), row in got.items():
            want = (ref if seq == "ids" else ref_alt)[i]
            assert torch.allclose(row, want, atol=1e-4), (type(lm).__name__, seq, i)


def test_greedy_decoding_identical(exported):
    """A greedy continuation on the ONNX runtime equals PyTorch's, token for token."""
    model, tok = tiny_model("llama")
    ids = _prompt(tok, 12, seed=2)
    outs = []
    for lm in (EdgeLM(model, tok), OnnxEdgeLM(OnnxDecoder(exported["tiny-llama"].folder), tok)):
        lm.start(ids)
        for _ in range(16):
            lm.push(int(lm.logits().argmax()))
        outs.append(lm.tokens[len(ids):])
    assert outs[0] == outs[1]


def test_export_cache_keyed_by_adapter(root, exported):
    """The same adapter reuses its export; a changed adapter re-exports into another folder,
    and that export computes the merged model's logits."""
    model, tok = tiny_model("llama")
    peft = attach_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], seed=0)
    state = get_adapter_state(peft)
    state = {k: (np.random.default_rng(0).normal(size=v.shape) * 0.2).astype(np.float32)
             for k, v in state.items()}
    set_adapter_state(peft, state)
    first = export_onnx("tiny-llama", "fp32", model=peft, tok=tok, root=root)
    assert not first.reused and first.adapter != "base" and first.export_s > 0
    again = export_onnx("tiny-llama", "fp32", model=peft, tok=tok, root=root)
    assert again.reused and again.folder == first.folder and again.export_s == 0
    ids = _prompt(tok, 20, seed=3)
    with torch.no_grad():
        ref = peft(input_ids=torch.tensor([ids])).logits[0].numpy()
        base = exported["tiny-llama"]
        base_logits, _ = OnnxDecoder(base.folder).forward(ids, OnnxDecoder(base.folder).empty())
    dec = OnnxDecoder(first.folder)
    logits, _ = dec.forward(ids, dec.empty())
    assert np.abs(logits - ref).max() < 1e-4
    assert np.abs(base_logits - ref).max() > 1e-3  # the adapter matters
    state2 = {k: v * 2 for k, v in state.items()}
    set_adapter_state(peft, state2)
    second = export_onnx("tiny-llama", "fp32", model=peft, tok=tok, root=root)
    assert not second.reused and second.folder != first.folder and is_exported(first.folder)


def test_merged_state_dict_leaves_model_unmerged():
    model, tok = tiny_model("qwen2")
    peft = attach_lora(model, rank=2, alpha=4, dropout=0.0, target_modules=["q_proj"], seed=0)
    state = {k: np.full(v.shape, 0.1, np.float32) for k, v in get_adapter_state(peft).items()}
    set_adapter_state(peft, state)
    ids = torch.tensor([_prompt(tok, 8)])
    with torch.no_grad():
        before = peft(input_ids=ids).logits
    merged = merged_state_dict(peft)
    key = "model.layers.0.self_attn.q_proj.weight"
    base_w = peft.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    delta = (4 / 2) * torch.full((base_w.shape[0], 2), 0.1) @ torch.full((2, base_w.shape[1]), 0.1)
    assert torch.allclose(merged[key], base_w + delta, atol=1e-6)
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    with torch.no_grad():
        assert torch.equal(peft(input_ids=ids).logits, before)


def test_int8_export_runs_and_is_smaller(root, exported):
    q = export_onnx("tiny-qwen2", "int8", root=root)
    dec = OnnxDecoder(q.folder)
    model, tok = tiny_model("qwen2")
    ids = _prompt(tok, 16)
    logits, _ = dec.forward(ids, dec.empty())
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert logits.shape == ref.shape and np.isfinite(logits).all()
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max()  # close, not equal
    assert q.folder == export_folder("tiny-qwen2", "int8", export_key("tiny-qwen2", root=root)[1], root)
    size = lambda f: sum(p.stat().st_size for p in f.iterdir())  # noqa: E731
    assert size(q.folder) < size(exported["tiny-qwen2"].folder)


def test_onnx_decoder_refuses_bad_input(exported):
    dec = OnnxDecoder(exported["tiny-llama"].folder)
    with pytest.raises(ValueError, match="vocabulary"):
        dec.forward([dec.vocab_size], dec.empty())
    with pytest.raises(ValueError, match="at least one"):
        dec.forward([], dec.empty())
    with pytest.raises(ValueError, match="KV cache of"):
        dec.forward([1], dec.empty()[:2])


def test_profiles_refused_clearly(tmp_path):
    assert DeviceProfile.of(None, {}).profile == "cpu"
    entry = {"model": "x", "device": {"profile": "edge", "quant": "int4"}}
    assert DeviceProfile.of(entry, {}) == DeviceProfile("edge", "int4")
    # the device's own node config wins over the server's entry
    assert DeviceProfile.of(entry, {"device-profile": "cpu"}).profile == "cpu"
    with pytest.raises(ProfileError, match="unknown device profile 'npu'"):
        DeviceProfile.of({"device": {"profile": "npu"}})
    with pytest.raises(ProfileError, match="unknown quantization 'int3'"):
        DeviceProfile.of(None, {"device-quant": "int3"})
    with pytest.raises(ProfileError, match="unknown device key"):
        DeviceProfile.of({"device": {"profil": "edge"}})
    with pytest.raises(ProfileError, match="mapping"):
        DeviceProfile.of({"device": "edge"})
    # gpu on a machine without CUDA: falls back, or is refused when fallback is off
    assert DeviceProfile("gpu").torch_device(cuda_available=False) == "cpu"
    assert DeviceProfile("gpu").torch_device(cuda_available=True) == "cuda"
    with pytest.raises(ProfileError, match="no CUDA device"):
        DeviceProfile("gpu", fallback=False).torch_device(cuda_available=False)
    with pytest.raises(ProfileError, match="not an ONNX export"):
        OnnxDecoder(tmp_path)
    with pytest.raises(ProfileError, match="unknown quantization"):
        export_onnx("tiny-llama", "int2", root=tmp_path)


def test_edge_refused_in_one_line_without_onnx_runtime(monkeypatch):
    import sys

    from edgefuse.runtime import check_edge

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    with pytest.raises(ProfileError, match="device profile edge needs onnxruntime"):
        check_edge()
    with pytest.raises(ProfileError, match="needs onnxruntime"):
        OnnxDecoder("anywhere")


def test_a_bad_device_entry_is_refused_before_any_round():
    from edgefuse.config import ConfigError, compose

    with pytest.raises(ConfigError, match=r"federation.clients\[0\].device: unknown device profile 'tpu'"):
        compose("tiny", ["+federation.clients.0.device={profile: tpu}"])
    cfg = compose("tiny", ["+federation.clients.3.device={profile: edge, quant: int4}"])
    assert DeviceProfile.of(cfg.federation.clients[3]) == DeviceProfile("edge", "int4")


def test_export_key_follows_the_lora_config_and_the_model_config(root):
    """The same LoRA weights at another alpha, or the same weights under another RoPE base,
    are other graphs: other cache ids (so no stale export is reused)."""
    model, tok = tiny_model("llama")
    a = attach_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj"], seed=0)
    m2, _ = tiny_model("llama")
    b = attach_lora(m2, rank=4, alpha=64, dropout=0.0, target_modules=["q_proj"], seed=0)
    set_adapter_state(b, get_adapter_state(a))
    (ad_a, key_a), (ad_b, key_b) = export_key("tiny-llama", a), export_key("tiny-llama", b)
    assert ad_a == ad_b and key_a != key_b  # same weights, other scaling
    p1, _ = tiny_model("llama")
    p2, _ = tiny_model("llama")
    p2.config.rope_theta = 1234.0
    assert export_key("tiny-llama", p1)[1] != export_key("tiny-llama", p2)[1]
    assert export_key("tiny-llama", p1) == export_key("tiny-llama", tiny_model("llama")[0])


def test_a_damaged_export_is_rebuilt_and_a_corrupt_one_refused_in_one_line(tmp_path):
    ex = export_onnx("tiny-llama", "fp32", root=tmp_path)
    data = ex.folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])  # truncated: no longer what the metadata lists
    assert not is_exported(ex.folder)
    again = export_onnx("tiny-llama", "fp32", root=tmp_path)
    assert not again.reused and is_exported(again.folder)
    (again.folder / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(ProfileError, match="ONNX Runtime cannot load this export.*--force"):
        OnnxDecoder(again.folder)


def test_old_exports_are_pruned(tmp_path):
    """Each new adapter is a new export; only the newest two of a model and quantization stay."""
    model, tok = tiny_model("llama")
    peft = attach_lora(model, rank=2, alpha=4, dropout=0.0, target_modules=["q_proj"], seed=0)
    state = get_adapter_state(peft)
    folders = []
    for i in range(3):
        set_adapter_state(peft, {k: v + 0.01 * (i + 1) for k, v in state.items()})
        folders.append(export_onnx("tiny-llama", "int8", model=peft, tok=tok, root=tmp_path).folder)
    base = export_onnx("tiny-llama", "int8", root=tmp_path).folder  # base exports are never pruned
    left = sorted(p.name for p in folders[0].parent.iterdir())
    assert left == sorted([f.name for f in folders[1:]] + [base.name]) and not folders[0].exists()


def test_onnx_decoder_checks_the_cache_layout_and_the_context(exported):
    dec = OnnxDecoder(exported["tiny-llama"].folder)
    past = dec.empty()
    with pytest.raises(ValueError, match="integers"):
        dec.forward([1.7, 2.2], past)
    bad = [np.zeros((1, dec.kv_heads, 0, dec.head_size + 1), np.float32) for _ in past]
    with pytest.raises(ValueError, match="KV cache array"):
        dec.forward([1], bad)
    with pytest.raises(ValueError, match="KV cache array"):
        dec.forward([1], [p.astype(np.float64) for p in past])
    with pytest.raises(ValueError, match="context length"):
        dec.forward([1] * (dec.context_length + 1), past)


def test_node_config_keys_are_checked():
    with pytest.raises(ProfileError, match="unknown node config key"):
        DeviceProfile.of(None, {"device-fallbak": "false"})
    assert DeviceProfile.of(None, {"device-profile": "gpu", "device-fallback": "false"}).fallback is False
    assert DeviceProfile.of(None, {"device-dir": "/x", "partition-id": 0}).profile == "cpu"
    with pytest.raises(ProfileError, match="no CUDA"):
        DeviceProfile("gpu", fallback=False).check(cuda_available=False)
    assert DeviceProfile("gpu").check(cuda_available=False).profile == "gpu"  # falls back later
