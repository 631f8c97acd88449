"""The experiment files: `default` (the 15-minute main job) lowers budgets only, every phase
still on; `full` pins the group defaults' values of everything `default` lowers."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from edgefuse.app.phases import compose
from edgefuse.c2c.hub import pair_list
from edgefuse.config import CONF_DIR

EXPERIMENTS = Path(CONF_DIR) / "experiment"
# The group file each top-level section of an experiment overrides.
GROUP_FILES = {"federation": "federation/default.yaml", "training": "training/default.yaml",
               "data": "data/dolly.yaml", "c2c": "c2c/default.yaml", "cloud": "cloud/default.yaml",
               "privacy": "privacy/default.yaml"}


def _leaves(node, prefix=""):
    """``{dotted key: value}`` of a raw YAML mapping (lists are values)."""
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if OmegaConf.is_dict(v):
            out.update(_leaves(v, key + "."))
        else:
            out[key] = OmegaConf.to_container(v) if OmegaConf.is_list(v) else v
    return out


def _raw(name: str) -> dict:
    cfg = OmegaConf.load(EXPERIMENTS / f"{name}.yaml")
    return {k: v for k, v in _leaves(cfg).items() if not k.startswith("experiment.")}


def _group_default(key: str):
    section, rest = key.split(".", 1)
    return OmegaConf.select(OmegaConf.load(Path(CONF_DIR) / GROUP_FILES[section]), rest,
                            throw_on_missing=True)


def test_full_pins_every_budget_default_lowers_at_the_group_defaults_value():
    default, full = _raw("default"), _raw("full")
    assert set(default) <= set(full), f"not pinned in full.yaml: {sorted(set(default) - set(full))}"
    for key, value in full.items():
        group = _group_default(key)
        group = OmegaConf.to_container(group) if OmegaConf.is_list(group) else group
        assert value == group, f"full.yaml {key}={value!r}, the group default is {group!r}"
    cfg = compose("full")
    assert (cfg.federation.num_rounds, cfg.training.steps_per_round, cfg.c2c.train.steps,
            cfg.c2c.eval.mmlu_n, cfg.cloud.eval.max_new_tokens) == (3, 10, 20, 40, 32)
    assert len(pair_list(cfg.c2c.pairs, ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])) == 6


def test_default_runs_every_phase_on_the_default_federation_with_lower_budgets():
    cfg, full = compose("default"), compose("full")
    assert cfg.experiment.name == "default" and full.experiment.name == "full"
    assert cfg.c2c.enabled and cfg.cloud.enabled and cfg.privacy.enabled
    assert OmegaConf.to_container(cfg.federation.clients) == OmegaConf.to_container(full.federation.clients)
    assert list(cfg.cloud.modes) == list(full.cloud.modes)
    assert list(cfg.c2c.eval.modes) == list(full.c2c.eval.modes)
    # the several-sharers mode has a receiver with two sharers
    pairs = pair_list(list(cfg.c2c.pairs), list(dict.fromkeys(c.model for c in cfg.federation.clients)))
    receivers = [r for _, r in pairs]
    assert max(receivers.count(r) for r in receivers) >= 2
    # every count default sets is at most full's (budgets only go down)
    for key, value in _raw("default").items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                key not in ("federation.client_num_cpus", "federation.models_per_worker",
                            "cloud.service.threads"):
            assert value <= OmegaConf.select(full, key), key
    assert 0 < cfg.c2c.eval.mmlu_n and 0 < cfg.cloud.eval.gsm8k_n + cfg.cloud.eval.dolly_per_category
    assert cfg.c2c.train.examples == cfg.c2c.train.steps * cfg.c2c.train.batch_size


@pytest.mark.parametrize("name", ["smoke", "tiny", "c2c"])
def test_other_experiments_still_compose(name):
    assert compose(name).experiment.name == name
