import re
from pathlib import Path

import pytest

from edgefuse.app.phases import compose as compose_checked  # core compose + each phase's checks
from edgefuse.config import ConfigError, client_entry, compose, from_json, to_json


def test_default_federation_is_heterogeneous():
    cfg = compose("default")
    models = [c.model for c in cfg.federation.clients]
    assert len(models) >= 4
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"} <= set(models)
    smol_ranks = {c.lora_rank for c in cfg.federation.clients if c.model == "smollm2-135m"}
    assert len(smol_ranks) == 2


def test_overrides_and_experiments_compose():
    cfg = compose("smoke", "training.lr=1e-4 federation.num_rounds=5")
    assert cfg.experiment.name == "smoke"
    assert cfg.training.lr == pytest.approx(1e-4)
    assert cfg.federation.num_rounds == 5
    assert cfg.training.steps_per_round == 4  # from experiment/smoke.yaml
    # an explicit experiment override wins over the positional one
    assert compose("default", "experiment=tiny").experiment.name == "tiny"


def test_quoted_override_values_survive():
    cfg = compose("tiny", "data.mirror='/tmp/a b'")
    assert cfg.data.mirror == "/tmp/a b"


@pytest.mark.parametrize("overrides", ["experiment=nope", "training.no_such_key=1",
                                       "federation=nope", "training.lr=="])
def test_bad_overrides_raise_config_error(overrides):
    with pytest.raises(ConfigError):
        compose("default", overrides)


def test_invalid_values_are_rejected():
    with pytest.raises(ConfigError, match="lora_rank"):
        compose("tiny", "federation.clients.0.lora_rank=0")
    with pytest.raises(ConfigError, match="steps_per_round"):
        compose("tiny", "training.steps_per_round=0")
    with pytest.raises(ConfigError, match="num_rounds must be an integer"):
        compose("tiny", "federation.num_rounds=abc")
    with pytest.raises(ConfigError, match="training.lr"):
        compose("tiny", "training.lr=-1")


def test_json_round_trip_and_client_entry():
    cfg = compose("tiny")
    back = from_json(to_json(cfg))
    assert back == cfg
    assert client_entry(back, 2).model == "tiny-qwen2"
    with pytest.raises(ConfigError, match="partition-id 9"):
        client_entry(back, 9)


@pytest.mark.parametrize("override, message", [
    ("c2c.eval.modes=[alone,bogus]", "unknown modes ['bogus']"),
    ("c2c.eval.wan=moon", "unknown WAN preset 'moon'"),
    ('c2c.pairs=["tiny-llama->nope"]', "'nope' is not a model of this federation"),
    ('c2c.pairs=["tiny-llama->tiny-llama"]', "pairs a model with itself"),
    ("c2c.train.steps=0", "c2c.train.steps must be an integer >= 1"),
])
def test_bad_c2c_settings_fail_at_compose_time(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_checked("tiny", [override])


@pytest.mark.parametrize("override", [
    "privacy.max_update_norm=abc", "privacy.cloud_auth.flag_cache=maybe", "privacy.cloud_auth.l_cache=2.5",
    "privacy.redact.spacy_model=not_a_spacy_model", "privacy.redact.score_threshold=7",
    "privacy.rephrase.max_new_tokens=0", "privacy.probe.ridge=-1", "privacy.probe.task_n=abc"])
def test_bad_privacy_settings_fail_at_compose_time(override):
    with pytest.raises(ConfigError, match="privacy"):
        compose_checked("tiny", override)


def test_public_slices_follow_the_phase_settings():
    cfg = compose("tiny")
    ps = cfg.data.public_slices
    assert ps.fuser_train == cfg.c2c.train.examples == 8
    assert ps.attack_train == cfg.privacy.probe.attack_train_prompts == 12
    assert (ps.fuser_val, ps.eval_per_category, ps.draft_corpus) == (8, 10, None)
    assert compose("c2c").data.public_slices.fuser_train == 250
    smoke = compose("smoke")  # c2c disabled: the slice keeps its default size
    assert smoke.data.public_slices.fuser_train == 160


@pytest.mark.parametrize("override, message", [
    ("data.public_slices.fuser_train=5", "c2c.train.examples=8 but data.public_slices.fuser_train=5"),
    ("c2c.eval.dolly_per_category=11", "c2c.eval.dolly_per_category=11 is more than the evaluation slice"),
    ("data.public_slices.attack_train=3", "privacy.probe.attack_train_prompts=12 is more than the attack_train"),
])
def test_public_slice_budget_checked_at_compose_time(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_checked("tiny", [override])


def test_resolve_paths_order(tmp_path, monkeypatch):
    """Flag > config > environment > ../shared/data beside the checkout > hub; 'hub' stops."""
    from omegaconf import OmegaConf

    from edgefuse import data
    from edgefuse.config import resolve_paths

    checkout, beside = tmp_path / "checkout", tmp_path / "shared" / "data"
    (beside / "dolly").mkdir(parents=True)
    env_dir, cfg_dir, flag_dir = (tmp_path / n for n in ("env", "cfg", "flag"))
    monkeypatch.setattr(data, "PROJECT_ROOT", checkout)
    for var in ("EDGEFUSE_DATA_MIRROR", "EDGEFUSE_CACHE", "EDGEFUSE_OUTPUTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    p = resolve_paths()
    assert (p.data_mirror, p.outputs_root) == (beside, tmp_path / "outputs")
    assert p.cache_dir == (Path.home() / ".cache" / "edgefuse").resolve()
    monkeypatch.setenv("EDGEFUSE_DATA_MIRROR", str(env_dir))
    monkeypatch.setenv("EDGEFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EDGEFUSE_OUTPUTS", "runs")
    p = resolve_paths()
    assert (p.data_mirror, p.cache_dir, p.outputs_root) == (env_dir, tmp_path / "cache", tmp_path / "runs")
    cfg = OmegaConf.create({"data": {"mirror": str(cfg_dir)}, "paths": {"cache_dir": "c2"},
                            "outputs": {"root": "o2"}})
    p = resolve_paths(cfg)
    assert (p.data_mirror, p.cache_dir, p.outputs_root) == (cfg_dir, tmp_path / "c2", tmp_path / "o2")
    assert (cfg.data.mirror, cfg.paths.cache_dir, cfg.outputs.root) == \
        (str(cfg_dir), str(tmp_path / "c2"), str(tmp_path / "o2"))  # written back
    assert resolve_paths(cfg, data_mirror=str(flag_dir)).data_mirror == flag_dir
    # "hub" at any level: the hub, without looking further; the config then holds null
    assert resolve_paths(data_mirror="hub").data_mirror is None
    monkeypatch.setenv("EDGEFUSE_DATA_MIRROR", "hub")
    hub = OmegaConf.create({"data": {"mirror": None}})
    assert resolve_paths(hub).data_mirror is None and hub.data.mirror is None
    monkeypatch.delenv("EDGEFUSE_DATA_MIRROR")
    (beside / "dolly").rmdir()
    assert resolve_paths().data_mirror is None  # nothing beside the checkout: the hub


def test_compose_resolves_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEFUSE_DATA_MIRROR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    cfg = compose("tiny", "outputs.root=runs")
    assert cfg.data.mirror == str(tmp_path) and cfg.outputs.root == str(tmp_path / "runs")
    assert cfg.paths.cache_dir and cfg.paths.cache_dir.startswith("/")
    assert compose("tiny", "data.mirror=hub").data.mirror is None


def test_device_setting_resolves_and_refuses_what_torch_cannot_use(monkeypatch):
    import torch

    from edgefuse.config import resolve_device

    assert compose("tiny").device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="device=cuda but torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="device=cuda but torch sees no CUDA device"):
        compose("tiny", "device=cuda")
    with pytest.raises(ConfigError, match="device must be auto, cpu or cuda, got 'tpu'"):
        compose("tiny", "device=tpu")
    assert compose("tiny", "device=cpu").device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device("CUDA") == "cuda"
    assert resolve_device("cpu") == "cpu"


def test_lora_training_moves_to_the_device_and_back(monkeypatch):
    """The local handler trains and evaluates on the resolved device, then hands the model
    back on the CPU (the other handlers share it); here ``cuda`` is faked by recording."""
    import torch

    from edgefuse.app.handlers import local

    moves = []
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(model, "to", lambda device: moves.append(str(device)) or model)
    monkeypatch.setattr(local, "resolve_device", lambda setting: {"auto": "cuda", "cpu": "cpu"}[setting])
    with local.on_device(model, "auto") as m:
        assert m is model and moves == ["cuda"]
    assert moves == ["cuda", "cpu"]
    with pytest.raises(ValueError), local.on_device(model, "auto"):
        raise ValueError("training failed")
    assert moves[-1] == "cpu"  # back on the CPU after a failure too
    moves.clear()
    with local.on_device(model, "cpu"):
        pass
    assert moves == []
