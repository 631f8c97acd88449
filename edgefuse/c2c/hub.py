"""The server's fuser service: train, version and register the fusers of a run (no Flower).

The server holds public copies of the open-weight edge SLMs. After a round it knows every
client's adapter (it aggregated them), so for each ordered pair (sharer → receiver) among
one *representative* client per base model it can rebuild both models exactly as the
clients hold them and train the pair's :class:`edgefuse.c2c.fuser.C2CFuser` on the public split
(:mod:`edgefuse.c2c.train`). What happens to a pair at an update (:meth:`FuserService.update`):

- ``cached``: the registry already holds this exact version (same specs, adapter hashes and
  fuser config), e.g. from an earlier run with a persistent ``c2c.registry_dir``: reused.
- ``carried_over``: the pair was trained earlier in this run and neither side's adapter
  changed by more than ``c2c.train.retrain_threshold`` (:func:`edgefuse.c2c.registry.needs_retrain`):
  the same weights are registered under the new version, the card saying where from.
- ``trained``: otherwise; warm-started from the pair's previous weights when there are some.

Public rows: the ``fuser_train`` slice of the public split trains the fusers and the
``fuser_val`` slice scores them (card ``scores``); the evaluation rows are another slice
(:func:`edgefuse.eval.splits.public_slices` owns the budget).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from logging import INFO

import numpy as np
import torch

from edgefuse.config import ConfigError, lora_targets, positive_int
from edgefuse.eval.splits import PublicSlices, check_training_data, fuser_training_rows, public_slices
from edgefuse.lora import attach_lora, set_adapter_state
from edgefuse.models import load_model

from .fuser import C2CFuser, FuserConfig, kv_spec_from_config
from .registry import (FuserCard, FuserRegistry, FuserVersion, FuserVersionError, ModelVersion,
                       adapter_change, adapter_hash, config_hash)
from .examples import build_pair_examples
from .prefill import PrefillStore, Prefiller
from .train import CheckpointMismatchError, evaluate_pair, train_fuser

MODES = ("alone", "t2t", "c2c", "co_c2c", "multi", "c2c_zero", "c2c_shuffled")  # c2c.eval.modes


def _log(msg: str, *args) -> None:
    from flwr.common.logger import log

    log(INFO, msg, *args)


@dataclass
class Side:
    """One model of a pair as the server holds it: the spec name, the representative
    client's partition-id, and that client's LoRA adapter (``None``: the base model)."""

    model: str
    partition_id: int
    state: dict[str, np.ndarray] | None
    rank: int
    alpha: float

    def version(self) -> ModelVersion:
        return ModelVersion(self.model, adapter_hash(self.state))


def pair_list(spec, models: list[str]) -> list[tuple[str, str]]:
    """Ordered ``(sharer, receiver)`` pairs from the ``c2c.pairs`` setting.

    Args:
        spec: ``"all"`` (every ordered pair of distinct ``models``) or a list of
            ``"sharer->receiver"`` strings.
        models: the base models present in the federation.

    Raises:
        ConfigError: a malformed entry, a model not in the federation, or a self-pair.
    """
    if spec == "all" or spec is None:
        return [(s, r) for r in models for s in models if s != r]
    pairs = []
    for item in spec:
        parts = [p.strip() for p in str(item).split("->")]
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"c2c.pairs entry {item!r} must look like 'sharer->receiver'")
        s, r = parts
        for name in (s, r):
            if name not in models:
                raise ConfigError(f"c2c.pairs entry {item!r}: {name!r} is not a model of this "
                                  f"federation ({', '.join(models)})")
        if s == r:
            raise ConfigError(f"c2c.pairs entry {item!r} pairs a model with itself")
        pairs.append((s, r))
    return pairs


def check_config(cfg) -> None:
    """Check the ``c2c`` section at compose time (nothing when ``c2c.enabled`` is false).

    Raises:
        ConfigError: a non-positive step / example / token count, an unknown ``c2c.train.at``,
            evaluation mode or WAN preset, a bad ``c2c.pairs`` entry, ``c2c.train.examples``
            other than ``data.public_slices.fuser_train``, or more Dolly evaluation rows per
            category than ``data.public_slices.eval_per_category``.
    """
    c2c = cfg.get("c2c")
    if c2c is None or not c2c.get("enabled"):
        return
    from omegaconf import OmegaConf

    from edgefuse.transport.wan import WanProfile

    for key in ("c2c.train.steps", "c2c.train.batch_size", "c2c.train.examples",
                "c2c.train.max_seq_len", "c2c.eval.max_new_tokens", "c2c.eval.max_prompt_tokens",
                "c2c.eval.batch_queries"):
        positive_int(OmegaConf.select(cfg, key), key)
    check_training_data(cfg)  # c2c.train.data, data.public_fraction, data.public_slices
    slices = (cfg.get("data") or {}).get("public_slices") or {}
    if slices.get("fuser_train") != c2c.train.examples:
        raise ConfigError(f"c2c.train.examples={c2c.train.examples} but data.public_slices.fuser_train="
                          f"{slices.get('fuser_train')}: the fusers train on that slice, set both "
                          "(by default the slice follows c2c.train.examples)")
    if int(c2c.eval.get("dolly_per_category", 0)) > int(slices.get("eval_per_category") or 0):
        raise ConfigError(f"c2c.eval.dolly_per_category={c2c.eval.dolly_per_category} is more than the "
                          f"evaluation slice holds per category (data.public_slices.eval_per_category="
                          f"{slices.get('eval_per_category')})")
    if str(c2c.train.at) not in ("final", "every_round"):
        raise ConfigError(f"c2c.train.at must be 'final' or 'every_round', got {c2c.train.at!r}")
    unknown = sorted(set(map(str, c2c.eval.modes)) - set(MODES))
    if unknown:
        raise ConfigError(f"c2c.eval.modes has unknown modes {unknown}: use {', '.join(MODES)}")
    try:
        WanProfile.from_name(str(c2c.eval.wan))
    except ValueError as e:
        raise ConfigError(f"c2c.eval.wan: {e}") from None
    pair_list(c2c.pairs if isinstance(c2c.pairs, str) else list(c2c.pairs),
              list(dict.fromkeys(str(c.model) for c in cfg.federation.clients)))
    check_train_runtime(c2c.train)


def check_train_runtime(t) -> None:
    """Check how fusers train: ``threads`` (``auto`` or >= 1), ``device``, ``amp``,
    ``micro_batch`` (>= 1), ``length_group`` (>= 0), ``prefill_dtype``.

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    from .prefill import DTYPES

    if str(t.get("threads", "auto")) != "auto":
        positive_int(t.get("threads"), "c2c.train.threads")
    train_device({**t, "device": "cpu"} if str(t.get("device", "auto")) == "cuda" else t)
    if str(t.get("amp", "auto")) not in ("auto", "true", "false", "True", "False"):
        raise ConfigError(f"c2c.train.amp must be auto, true or false, got {t.get('amp')!r}")
    positive_int(t.get("micro_batch", 8), "c2c.train.micro_batch")
    group = t.get("length_group", 0)
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ConfigError(f"c2c.train.length_group must be an integer >= 0, got {group!r}")
    if str(t.get("prefill_dtype", "float32")) not in DTYPES:
        raise ConfigError(f"c2c.train.prefill_dtype must be one of {', '.join(DTYPES)}, "
                          f"got {t.get('prefill_dtype')!r}")


def fuser_config(cfg) -> FuserConfig:
    """The :class:`FuserConfig` of ``cfg.c2c.fuser``; ``ConfigError`` for a bad value."""
    from omegaconf import OmegaConf

    try:
        return FuserConfig.from_dict(OmegaConf.to_container(cfg.c2c.fuser, resolve=True))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"c2c.fuser: {e}") from None


def load_public_copy(cfg, side: Side, device: torch.device | str = "cpu"):
    """The server's copy of a client's model: base weights + that client's adapter, frozen,
    in eval mode, on ``device``. Returns ``(model, tokenizer)``."""
    model, tok = load_model(side.model, root=cfg.paths.cache_dir)
    if side.state is not None:
        model = attach_lora(model, rank=side.rank, alpha=side.alpha, dropout=0.0,
                            target_modules=lora_targets(cfg, side.model), seed=int(cfg.seed))
        set_adapter_state(model, side.state)
    model.eval()
    model.requires_grad_(False)
    return model.to(device), tok


class FuserService:
    """Trains and registers the fusers of one run; remembers what each pair was trained with.

    Attributes:
        registry: where versions are saved (:class:`edgefuse.c2c.registry.FuserRegistry`).
        rows: one dict per pair of the last :meth:`update` (results.json ``fusers``).

    Args:
        slices: the public split's slices (default: :func:`edgefuse.eval.splits.public_slices`
            of ``cfg``, computed on first use); fusers train on ``fuser_train`` and are
            scored on ``fuser_val``.
    """

    def __init__(self, cfg, registry: FuserRegistry, slices: PublicSlices | None = None):
        self.cfg, self.registry = cfg, registry
        self.fcfg = fuser_config(cfg)
        self.fcfg_dict = self.fcfg.to_dict()
        self._slices = slices
        self._rows: dict[str, list[dict]] = {}
        self._trained: dict[tuple[str, str], tuple[FuserVersion, dict, dict | None, dict | None]] = {}
        self.rows: list[dict] = []

    def public(self, name: str) -> list[dict]:
        """The rows of public slice ``name``, loaded once: ``fuser_train`` is every source of
        ``c2c.train.data`` (:func:`edgefuse.eval.splits.fuser_training_rows`), ``fuser_val``
        the slice."""
        if name not in self._rows:
            if self._slices is None:
                self._slices = public_slices(self.cfg.data, int(self.cfg.seed))
            self._rows[name] = (fuser_training_rows(self.cfg, int(self.cfg.seed), slices=self._slices)
                                if name == "fuser_train" else self._slices.rows(name))
        return self._rows[name]

    def fuser_config(self, control: str = "none") -> FuserConfig:
        """The run's fuser config, with ``sharer_control=control``."""
        return replace(self.fcfg, sharer_control=control)

    def version(self, sharer: Side, receiver: Side, control: str = "none") -> FuserVersion:
        """The registry version of the pair's fuser (a control's config hashes differently)."""
        return FuserVersion(sharer.version(), receiver.version(),
                            config_hash(self.fuser_config(control).to_dict()))

    def controls(self) -> list[str]:
        """The fusers trained per pair: ``none`` (the real one), then ``zero`` and ``shuffled``
        when ``c2c.eval.controls`` is true and ``c2c`` is evaluated."""
        ev = self.cfg.c2c.eval
        on = bool(ev.get("controls", False)) and "c2c" in list(ev.modes)
        return ["none", "zero", "shuffled"] if on else ["none"]

    def prefill_store(self) -> PrefillStore:
        """The prompt-cache store (:mod:`edgefuse.c2c.prefill`): ``c2c.train.prefill_dir``,
        else ``<registry>/.prefill``, in ``c2c.train.prefill_dtype``."""
        t = self.cfg.c2c.train
        root = t.get("prefill_dir") or (self.registry.root / ".prefill")
        return PrefillStore(root, str(t.get("prefill_dtype", "float32")))

    def update(self, sides: dict[str, Side], pairs: list[tuple[str, str]], round_idx: int) -> list[dict]:
        """Bring the fuser of every pair up to date with ``sides`` (see the module docstring).

        Args:
            sides: model name -> :class:`Side` of its representative client.
            pairs: ``(sharer, receiver)`` model names.
            round_idx: the round whose adapters these are (for the cards and rows).

        Returns:
            One row per pair: ``sharer``, ``receiver``, ``params``, ``bytes``, ``version``,
            ``train_steps``, ``action``, ``train_seconds``, ``val_loss`` (fused),
            ``alone_val_loss``, ``round``, ``control`` (``none``; with the controls on, each
            pair also gets a ``zero`` and a ``shuffled`` row, trained with the same budget);
            ``action == "failed"`` with a ``reason`` for a fuser that could not be trained
            (the others go on).
        """
        t = self.cfg.c2c.train
        models: dict[str, tuple] = {}

        device = train_device(t)

        def get(name: str):
            if name not in models:
                models[name] = load_public_copy(self.cfg, sides[name], device)
            return models[name]

        threads = torch.get_num_threads()
        torch.set_num_threads(train_threads(t))
        rows = []
        store = self.prefill_store()
        try:
            for (s_name, r_name), control in ((p, c) for p in pairs for c in self.controls()):
                sharer, receiver = sides[s_name], sides[r_name]
                version = self.version(sharer, receiver, control)
                row = {"sharer": s_name, "receiver": r_name, "control": control, "version": version.id,
                       "round": round_idx, "train_seconds": 0.0}
                prev = self._trained.get((s_name, r_name, control))
                try:
                    card = self._existing(version)
                    if card is not None:
                        row.update(action="cached", train_steps=card.train_steps)
                    elif prev is not None and self._small_change(prev, sharer, receiver):
                        card = self._carry_over(prev, version, sharer, receiver, control)
                        row.update(action="carried_over", train_steps=card.train_steps)
                    else:
                        card, secs = self._train(version, sharer, receiver, get, prev, control, store)
                        row.update(action="trained", train_steps=card.train_steps, train_seconds=secs)
                except Exception as e:  # one pair failing must not cost the others
                    _log("c2c: fuser %s -> %s (control %s) failed: %s: %s", s_name, r_name, control,
                         type(e).__name__, e)
                    row.update(action="failed", reason=f"{type(e).__name__}: {e}", train_steps=0,
                               params=None, bytes=None, val_loss=None, alone_val_loss=None)
                    rows.append(row)
                    continue
                self._trained[(s_name, r_name, control)] = (version, self.registry.load_state(version)[0],
                                                            sharer.state, receiver.state)
                row.update(params=card.params, bytes=card.bytes,
                           val_loss=card.scores.get("val_loss"),
                           alone_val_loss=card.scores.get("alone_val_loss"))
                _log("c2c: fuser %s -> %s %s%s (version %s, %d params, val loss %s vs alone %s)",
                     s_name, r_name, row["action"], "" if control == "none" else f" (control {control})",
                     version.id, card.params, _fmt(row["val_loss"]), _fmt(row["alone_val_loss"]))
                rows.append(row)
        finally:
            torch.set_num_threads(threads)
            models.clear()
            gc.collect()
        self.rows = rows
        return rows

    # -- the three actions ------------------------------------------------------------
    def _existing(self, version: FuserVersion) -> FuserCard | None:
        try:
            return self.registry.load_state(version)[2]
        except FuserVersionError:
            return None  # absent, or corrupted: train it again

    def _small_change(self, prev, sharer: Side, receiver: Side) -> bool:
        thr = float(self.cfg.c2c.train.retrain_threshold)
        _, _, s_old, r_old = prev
        return adapter_change(s_old, sharer.state) <= thr and adapter_change(r_old, receiver.state) <= thr

    def _carry_over(self, prev, version: FuserVersion, sharer: Side, receiver: Side,
                    control: str = "none") -> FuserCard:
        old_version, state, s_old, r_old = prev
        old_card = self.registry.load_state(old_version)[2]
        fcfg = self.fuser_config(control)
        fuser = C2CFuser(kv_spec(self.cfg, receiver.model), kv_spec(self.cfg, sharer.model), fcfg)
        fuser.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        note = (f"carried over from {old_version.id}: adapter change sharer "
                f"{adapter_change(s_old, sharer.state):.4f}, receiver "
                f"{adapter_change(r_old, receiver.state):.4f} <= retrain threshold "
                f"{float(self.cfg.c2c.train.retrain_threshold)}")
        card = FuserCard.for_version(version, train_steps=old_card.train_steps,
                                     train_examples=old_card.train_examples,
                                     data=f"{old_card.data}; {note}", scores=old_card.scores,
                                     trained_on=old_card.trained_on or None)
        self.registry.save(fuser, fcfg.to_dict(), version, card, make_latest=control == "none")
        return self.registry.load_state(version)[2]

    def _train(self, version: FuserVersion, sharer: Side, receiver: Side, get, prev,
               control: str = "none", store: PrefillStore | None = None):
        t = self.cfg.c2c.train
        r_model, r_tok = get(receiver.model)
        s_model, s_tok = get(sharer.model)
        train_rows, val_rows = self.public("fuser_train"), self.public("fuser_val")
        max_len = int(t.max_seq_len)
        build = store.pair_examples if store is not None else (
            lambda rows, a, b, n: build_pair_examples(rows, a, b, n))
        examples, val = build(train_rows, r_tok, s_tok, max_len), build(val_rows, r_tok, s_tok, max_len)
        fcfg = self.fuser_config(control)
        fuser = C2CFuser(kv_spec_from_config(r_model.config), kv_spec_from_config(s_model.config), fcfg)
        fuser.to(_device(r_model))
        if prev is not None:  # warm start from the pair's previous weights
            fuser.load_state_dict({k: torch.as_tensor(v) for k, v in prev[1].items()})
        prefills = {"receiver_prefill": Prefiller(r_model, _model_key(receiver), store),
                    "sharer_prefill": Prefiller(s_model, _model_key(sharer), store)}
        amp = use_amp(t, _device(r_model))
        ckpt = self.registry.root / ".checkpoints" / f"{sharer.model}__to__{receiver.model}" / version.id
        run = dict(steps=int(t.steps), batch_size=int(t.batch_size), lr=float(t.lr), seed=int(self.cfg.seed),
                   checkpoint_dir=ckpt, checkpoint_every=max(1, int(t.steps) // 3),
                   progress=True, micro_batch=int(t.get("micro_batch", 8)),
                   length_group=int(t.get("length_group", 0)), amp=amp, **prefills)
        try:
            stats = train_fuser(fuser, r_model, s_model, examples, **run)
        except CheckpointMismatchError as e:  # left by an interrupted run with other settings
            _log("c2c: %s: training afresh", e)
            stats = train_fuser(fuser, r_model, s_model, examples, resume=False, **run)
        scores = {"val_loss": None, "alone_val_loss": None, "train_last_loss": stats["last_loss"],
                  "train_examples_per_s": stats["examples_per_s"]}
        if val:
            scores["val_loss"] = evaluate_pair(fuser, r_model, s_model, val, gate="on", amp=amp,
                                               seed=int(self.cfg.seed), **prefills)["loss"]
            scores["alone_val_loss"] = evaluate_pair(fuser, r_model, s_model, val, gate="off", amp=amp,
                                                     **prefills)["loss"]
        sources = sorted({str(r.get("source", "dolly_public")) for r in train_rows})
        what = "" if control == "none" else f"; control: {control} sharer (not the prompt's own cache)"
        card = FuserCard.for_version(
            version, train_steps=int(t.steps), train_examples=len(examples),
            data=(f"public training data held by no client ({', '.join(sources)}): {len(examples)} "
                  f"training prompts, {len(val)} validation prompts, max_seq_len {max_len}{what}"),
            scores=scores)
        fuser.to("cpu")
        self.registry.save(fuser, fcfg.to_dict(), version, card, make_latest=control == "none")
        _remove_tree(ckpt)
        return self.registry.load_state(version)[2], stats["seconds"]


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _model_key(side: Side) -> str:
    """A model version's name in the prefill store: ``<spec>@<adapter hash>``."""
    return f"{side.model}@{adapter_hash(side.state)}"


def train_threads(t) -> int:
    """``c2c.train.threads``: a count, or ``auto`` (every core the process may use)."""
    import os

    value = t.get("threads", "auto")
    if str(value) == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, int(value))


def train_device(t) -> torch.device:
    """``c2c.train.device``: ``auto`` (CUDA when torch sees one, else the CPU), ``cpu``, ``cuda``.

    Raises:
        ConfigError: ``cuda`` asked for and not available, or an unknown value.
    """
    value = str(t.get("device", "auto"))
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if value == "cuda" and not torch.cuda.is_available():
        raise ConfigError("c2c.train.device=cuda but torch sees no CUDA device: use auto or cpu")
    if value not in ("cpu", "cuda"):
        raise ConfigError(f"c2c.train.device must be auto, cpu or cuda, got {value!r}")
    return torch.device(value)


def use_amp(t, device: torch.device) -> bool:
    """bfloat16 autocast for the receiver's forward: ``c2c.train.amp`` ``auto`` means on CUDA
    with bfloat16 support (the fuser's weights, the caches and the loss stay float32)."""
    value = str(t.get("amp", "auto"))
    if value == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return value in ("true", "True") and device.type == "cuda"


def train_multi_gate(cfg, service: FuserService, sides: dict[str, Side], receiver: str,
                     sharers: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    """Train the several-sharers gate (:class:`edgefuse.c2c.multi.MultiSharerGate`) of ``receiver``
    with the registered pair fusers of ``sharers`` frozen, ``c2c.train.gate_steps`` steps on
    the fuser training rows.

    Returns:
        ``(state, meta)``: the gate's float32 state and ``{"kwargs", "params", "loss_before",
        "loss_after", "steps"}``.
    """
    from .gate_train import build_multi_examples, evaluate_multi, train_gate
    from .multi import MultiSharerGate

    t = cfg.c2c.train
    r_model, r_tok = load_public_copy(cfg, sides[receiver])
    s_models, s_toks, fusers = [], [], []
    for name in sharers:
        m, tok = load_public_copy(cfg, sides[name])
        state, _, _ = service.registry.load_state(service.version(sides[name], sides[receiver]))
        fuser = C2CFuser(kv_spec_from_config(r_model.config), kv_spec_from_config(m.config), service.fcfg)
        fuser.load_state_dict(state)
        fuser.eval()
        s_models.append(m)
        s_toks.append(tok)
        fusers.append(fuser)
    examples = build_multi_examples(service.public("fuser_train"), r_tok, s_toks, int(t.max_seq_len))
    val = build_multi_examples(service.public("fuser_val"), r_tok, s_toks, int(t.max_seq_len))
    gate = MultiSharerGate(kv_spec_from_config(r_model.config), len(sharers))
    threads = torch.get_num_threads()
    torch.set_num_threads(train_threads(t))
    try:
        before = evaluate_multi(gate, fusers, r_model, s_models, val)["loss"] if val else None
        if int(t.gate_steps) > 0 and examples:
            train_gate(gate, fusers, r_model, s_models, examples, steps=int(t.gate_steps),
                       batch_size=int(t.batch_size), lr=float(t.lr), seed=int(cfg.seed))
        after = evaluate_multi(gate, fusers, r_model, s_models, val)["loss"] if val else None
    finally:
        torch.set_num_threads(threads)
    _log("c2c: gate of %s over %s: val loss %s -> %s (%d params)", receiver, "+".join(sharers),
         _fmt(before), _fmt(after), gate.num_parameters())
    state = {k: v.detach().float().numpy().copy() for k, v in gate.state_dict().items()}
    meta = {"kwargs": {"drop_threshold": gate.drop_threshold}, "params": gate.num_parameters(),
            "loss_before": before, "loss_after": after, "steps": int(t.gate_steps)}
    return state, meta


def kv_spec(cfg, name: str):
    """The :class:`edgefuse.c2c.fuser.KVSpec` of a model spec, from its config alone (no weights).

    Raises:
        ModelSpecError / ModelFetchError: unknown or unfetched model.
    """
    from edgefuse.models import model_config

    return kv_spec_from_config(model_config(name, cfg.paths.cache_dir))


def _remove_tree(path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


__all__ = ["Side", "FuserService", "train_multi_gate", "kv_spec", "pair_list", "fuser_config", "load_public_copy"]
