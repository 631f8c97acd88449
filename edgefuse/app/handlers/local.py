"""What one client does, without Flower: its model, adapter and data, cached per process.

Flower's simulation reuses one process for several nodes, so module state is shared by
clients: the model cache holds at most ``federation.models_per_worker`` models (keyed by
spec and LoRA settings; least recently used freed first); per-client results that must survive
between messages live in the Flower ``Context.state``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

from omegaconf import DictConfig

from edgefuse import data as data_mod
from edgefuse.config import client_entry, from_json, lora_targets, resolve_device
from edgefuse.lora import (attach_lora, get_adapter_state, pack_adapter, set_adapter_state,
                           unpack_adapter, adapter_nbytes)
from edgefuse.models import load_model
from edgefuse.training import evaluate_loss, train_steps

_MODELS: "OrderedDict[tuple, dict]" = OrderedDict()  # LRU: key -> {"peft", "tok", "init", "load_s"}
_ROWS: dict = {}  # (model, partition, ...) -> (train_rows, val_rows)
_DEVICE_LOGGED: set = set()  # devices already named in the log
log = logging.getLogger(__name__)


def _lora_key(cfg: DictConfig, entry: DictConfig) -> tuple:
    return (entry.model, int(entry.lora_rank), float(cfg.training.lora_alpha),
            float(cfg.training.lora_dropout), tuple(lora_targets(cfg, entry.model)), str(cfg.paths.cache_dir), int(cfg.seed))


def _model_for(cfg: DictConfig, entry: DictConfig) -> dict:
    """The model slot for ``entry``, from the per-process LRU cache of
    ``federation.models_per_worker`` slots (the least recently used one is freed first)."""
    key = _lora_key(cfg, entry)
    if key in _MODELS:
        _MODELS.move_to_end(key)
        return _MODELS[key]
    keep = max(1, int(cfg.federation.get("models_per_worker", 1)))
    while len(_MODELS) >= keep:
        _MODELS.popitem(last=False)
        gc.collect()
    t0 = time.perf_counter()
    model, tok = load_model(entry.model, root=cfg.paths.cache_dir)
    name, rank, alpha, dropout, targets, _, seed = key
    peft = attach_lora(model, rank=rank, alpha=alpha, dropout=dropout,
                       target_modules=targets, seed=seed)
    _MODELS[key] = dict(key=key, peft=peft, tok=tok, init=get_adapter_state(peft),
                        load_s=time.perf_counter() - t0)
    return _MODELS[key]


def _rows_for(cfg: DictConfig, entry: DictConfig, tok, partition_id: int, num_partitions: int):
    key = (entry.model, partition_id, num_partitions, int(cfg.seed),
           repr(sorted(cfg.data.items())))
    if key not in _ROWS:
        train_ds, val_ds = data_mod.client_split(cfg.data, partition_id, num_partitions, int(cfg.seed))
        max_len = int(cfg.data.max_seq_len)
        _ROWS[key] = (data_mod.tokenize_dataset(train_ds, tok, max_len),
                      data_mod.tokenize_dataset(val_ds, tok, max_len))
    return _ROWS[key]


@contextmanager
def on_device(model, setting):
    """Run the block with ``model`` on the device ``setting`` resolves to
    (:func:`edgefuse.config.resolve_device`), then move it back to the CPU: the C2C, decoding
    and privacy handlers share this model and feed it CPU tensors."""
    device = resolve_device(setting)
    if device not in _DEVICE_LOGGED:
        _DEVICE_LOGGED.add(device)
        log.info("LoRA training and evaluation run on %s (device=%s)", device, setting)
    if device == "cpu":
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to("cpu")


@dataclass
class LocalClient:
    """One client's view for the message being handled."""

    cfg: DictConfig
    entry: DictConfig
    partition_id: int
    slot: dict
    train_rows: list
    val_rows: list
    load_seconds: float

    @staticmethod
    def entry_for(cfg_json: str, partition_id: int) -> DictConfig:
        """This node's federation entry (model, lora_rank); raises ConfigError if none."""
        return client_entry(from_json(cfg_json), partition_id)

    @classmethod
    def load(cls, cfg: DictConfig, partition_id: int, num_partitions: int) -> "LocalClient":
        """Load (or reuse) the model and data this partition needs.

        Raises:
            ConfigError: no federation entry for ``partition_id``.
            ModelSpecError / ModelFetchError: the model cannot be loaded.
        """
        entry = client_entry(cfg, partition_id)
        t0 = time.perf_counter()
        slot = _model_for(cfg, entry)
        train_rows, val_rows = _rows_for(cfg, entry, slot["tok"], partition_id, num_partitions)
        return cls(cfg, entry, partition_id, slot, train_rows, val_rows, time.perf_counter() - t0)

    @property
    def num_train_examples(self) -> int:
        return len(self.train_rows)

    def identity(self) -> dict:
        """What the server checks an update against: partition, model group, rank, alpha."""
        return {"partition_id": self.partition_id, "model": str(self.entry.model),
                "lora_rank": int(self.entry.lora_rank),
                "lora_alpha": float(self.cfg.training.lora_alpha)}

    def reset_adapter(self) -> None:
        """Back to the seeded initial adapter (A random, B zero): round 1 has no global."""
        set_adapter_state(self.slot["peft"], self.slot["init"])

    def set_packed_adapter(self, arrays: dict, index_json: str) -> int:
        """Apply a packed adapter from the server; return its payload bytes.

        Raises:
            MalformedUpdateError / ValueError: the payload does not fit this model.
        """
        set_adapter_state(self.slot["peft"], unpack_adapter(arrays, index_json))
        return adapter_nbytes(arrays) + len(index_json.encode())

    def packed_adapter(self) -> tuple[dict, str]:
        """The current adapter packed into flat arrays + index JSON."""
        return pack_adapter(get_adapter_state(self.slot["peft"]))

    def train(self, round_idx: int) -> dict:
        """``training.steps_per_round`` optimizer steps; see :func:`train_steps`."""
        t = self.cfg.training
        with on_device(self.slot["peft"], self.cfg.get("device", "auto")) as model:
            return train_steps(
                model, self.train_rows, self.slot["tok"].pad_token_id,
                steps=int(t.steps_per_round), batch_size=int(t.batch_size), lr=float(t.lr),
                weight_decay=float(t.weight_decay), max_grad_norm=float(t.max_grad_norm),
                seed=int(self.cfg.seed) + self.partition_id, round_idx=round_idx,
                gradient_checkpointing=bool(t.get("gradient_checkpointing", False)),
            )

    def evaluate(self) -> dict:
        """Held-out loss with the adapter currently applied."""
        with on_device(self.slot["peft"], self.cfg.get("device", "auto")) as model:
            return evaluate_loss(model, self.val_rows, self.slot["tok"].pad_token_id,
                                 int(self.cfg.training.eval_batch_size))

    def base_eval(self, context=None) -> dict:
        """Held-out loss of the base model (adapter disabled), computed once per node.

        Cached in ``context.state`` (Flower's per-node state) when a context is given.
        """
        from flwr.app import MetricRecord

        if context is not None and "base_eval" in context.state.metric_records:
            rec = context.state["base_eval"]
            return {"loss": float(rec["loss"]), "ppl": float(rec["ppl"])}
        with self.slot["peft"].disable_adapter():
            res = self.evaluate()
        if context is not None:
            context.state["base_eval"] = MetricRecord({"loss": res["loss"], "ppl": res["ppl"]})
        return res
