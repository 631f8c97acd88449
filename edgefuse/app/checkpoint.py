"""Resume a federated run: the server's state saved after every round and every phase.

After each round (and each completed phase) the ServerApp writes one checkpoint file into
``<run>/checkpoint/``; a run started again on the same output folder continues after the
last completed step (:func:`latest`, :func:`restore`). A checkpoint holds what the next
round and the phases need and nothing the clients keep: per model group the global LoRA
state, every client's state at its own rank, the global rank and alpha and the aggregation
info; the module shapes updates are checked against; the results so far (scrubbed of text
as results.json is); the run's outbound-audit totals; the server process's RNG states
(Python, numpy, torch). Nodes are not saved: node ids change when the federation restarts,
so the clients are identified again (``query.info``). The clients' training is seeded by
``(seed + partition id, round)`` (:func:`edgefuse.training.train_steps`), so a resumed round
trains exactly as it would have without the restart.

File format (``ckpt-r<round>-p<phases done>.bin``)::

    b"EFCKPT01" | HMAC-SHA256(key, magic + body) (32 bytes) | body

``body`` is a safetensors file (no pickle: loading cannot run code) whose metadata
``edgefuse`` is the JSON of everything but the arrays. The key is 32 random bytes in
``<paths.cache_dir>/checkpoint.key`` (made on first use, mode 0600), outside the output
folder: whoever can write the output folder but not read the key cannot forge a checkpoint.
Files are written atomically (:func:`edgefuse.io.atomic_write_bytes`); the newest
:data:`KEEP` are kept.

A file that is truncated, altered, forged or malformed is ignored with a warning and the
previous one is used (:func:`latest`); a valid checkpoint of another config (a different
experiment, overrides or federation) refuses the run (:class:`CheckpointMismatch`), so a
folder is never continued with settings it was not started with.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import re
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common.logger import log
from omegaconf import DictConfig, OmegaConf

from edgefuse.aggregation import ClientUpdate, GroupResult, MalformedUpdateError, validate_update
from edgefuse.app.strategy import GroupedLoRA
from edgefuse.io import atomic_write_bytes, to_jsonable
from edgefuse.results import RunRecorder
from edgefuse.results.recorder import redact_results

FOLDER = "checkpoint"
MAGIC = b"EFCKPT01"
KEY_NAME = "checkpoint.key"
KEEP = 2  # newest files kept: the last one and one to fall back to
FORMAT = 1
# Config keys a checkpoint does not pin: the outputs root only picks the folder (resolved
# against the working directory), which is fixed once the run continues in it.
UNPINNED = ("outputs.root",)
_NAME = re.compile(r"^ckpt-r(\d{3,})-p(\d+)\.bin$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (truncated, altered, forged or malformed)."""


class CheckpointMismatch(RuntimeError):
    """The run folder holds a checkpoint of another config: the run is refused."""


@dataclass
class Checkpoint:
    """The server state after round ``round`` and the phases ``phases_done``.

    Attributes:
        round: the last completed round (1-based).
        phases_done: names of the phases whose ``run`` completed, in run order.
        groups: model -> :class:`~edgefuse.aggregation.GroupResult` (states: key -> float32
            array, ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``).
        shapes: model -> module -> ``(out_features, in_features)``.
        results: the results so far (text scrubbed unless ``privacy.debug_text``).
        audit: the outbound-audit totals (:class:`~edgefuse.app.phases.privacy.AuditTally`).
        rng: ``{"python": random.getstate(), "numpy": np.random.get_state(), "torch":
            uint8 array}`` of the server process.
    """

    round: int
    phases_done: list[str]
    groups: dict[str, GroupResult]
    shapes: dict[str, dict[str, tuple[int, int]]]
    results: dict
    audit: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- config


def pinned_config(cfg: DictConfig) -> dict:
    """The resolved config a checkpoint is tied to (``cfg`` less :data:`UNPINNED`)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key in UNPINNED:
        *parents, last = key.split(".")
        node = plain
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return plain


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}{i}."))
        return out or {prefix[:-1]: []}
    return {prefix[:-1]: obj}


def config_diff(saved: dict, current: dict, limit: int = 3) -> str:
    """The first ``limit`` keys where two plain configs differ, as ``key: saved -> current``."""
    a, b = _flat(saved), _flat(current)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
    shown = ", ".join(f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


# --------------------------------------------------------------------------- key


def load_key(cfg: DictConfig) -> bytes:
    """The checkpoint MAC key, ``<paths.cache_dir>/checkpoint.key``: 32 random bytes, made
    with mode 0600 on first use.

    Raises:
        CheckpointError: the key file exists but is not 32 bytes.
    """
    path = Path(str(cfg.paths.cache_dir)).expanduser() / KEY_NAME
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another run made it first
            key = path.read_bytes()
        else:
            key = os.urandom(32)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
                f.flush()
                os.fsync(f.fileno())
    if len(key) != 32:
        raise CheckpointError(f"{path}: a checkpoint key is 32 bytes, this file has {len(key)}")
    return key


# --------------------------------------------------------------------------- capture / restore


def capture(strategy: GroupedLoRA, recorder: RunRecorder, audit: dict, round_idx: int,
            phases_done: list[str]) -> Checkpoint:
    """The live server state as a :class:`Checkpoint` (results scrubbed as results.json is)."""
    np_state = np.random.get_state()
    rng = {"python": random.getstate(),
           "numpy": (np_state[0], np.asarray(np_state[1]).copy(), *np_state[2:]),
           "torch": torch.get_rng_state().numpy().copy()}
    return Checkpoint(round=int(round_idx), phases_done=list(phases_done),
                      groups=dict(strategy.groups), shapes=dict(strategy.shapes),
                      results=json.loads(json.dumps(to_jsonable(redact_results(recorder.results)),
                                                    allow_nan=False, default=_nojson)),
                      audit=json.loads(json.dumps(audit)), rng=rng)


def restore(ckpt: Checkpoint, strategy: GroupedLoRA, recorder: RunRecorder, grid) -> None:
    """Put ``ckpt`` back into a fresh run: the strategy's groups and shapes, the recorder's
    results (:meth:`~edgefuse.results.RunRecorder.resume`) and the grid's audit totals
    (``grid.totals``). The RNG states are restored by :func:`restore_rng`, at the point
    where the saved run was when it saved them."""
    strategy.groups = dict(ckpt.groups)
    strategy.shapes = {m: dict(s) for m, s in ckpt.shapes.items()}
    recorder.resume(ckpt.results)
    if hasattr(grid, "totals"):
        grid.totals = json.loads(json.dumps(ckpt.audit))


def restore_rng(ckpt: Checkpoint) -> None:
    """Set the process's Python, numpy and torch RNG states to the saved ones."""
    if not ckpt.rng:
        return
    random.setstate(ckpt.rng["python"])
    np.random.set_state(ckpt.rng["numpy"])
    torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(ckpt.rng["torch"])))


# --------------------------------------------------------------------------- encode / decode


def _nojson(obj):
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _encode(obj: Any) -> Any:
    """JSON-able form that keeps int dict keys and tuples (``info``, RNG states)."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__items__"}:
            return {_decode(k): _decode(v) for k, v in obj["__items__"]}
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v) for v in obj["__tuple__"])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def encode(ckpt: Checkpoint, cfg: DictConfig, key: bytes) -> bytes:
    """The checkpoint file's bytes (module docstring: magic, MAC, safetensors body)."""
    from safetensors.numpy import save

    arrays: dict[str, np.ndarray] = {}
    ids: dict[int, str] = {}  # one entry per distinct state dict (FedAvg shares one)

    def put_state(state: dict) -> dict:
        if id(state) not in ids:
            ids[id(state)] = f"s{len(ids)}"
            for i, (k, v) in enumerate(state.items()):
                arrays[f"{ids[id(state)]}.{i}"] = np.ascontiguousarray(v)
        return {"id": ids[id(state)], "keys": list(state)}

    groups = {}
    for model, g in ckpt.groups.items():
        groups[model] = {"global_rank": int(g.global_rank), "global_alpha": float(g.global_alpha),
                         "info": _encode(g.info), "global_state": put_state(g.global_state),
                         "per_client": [[int(p), put_state(s)] for p, s in g.per_client.items()]}
    rng = dict(ckpt.rng)
    if rng:
        arrays["rng.torch"] = np.asarray(rng.pop("torch"), dtype=np.uint8)
        np_name, np_keys, *np_rest = rng.pop("numpy")
        arrays["rng.numpy"] = np.asarray(np_keys, dtype=np.uint32)
        rng["numpy"] = [np_name, *np_rest]
    meta = {"format": FORMAT, "config": pinned_config(cfg), "round": ckpt.round,
            "phases_done": ckpt.phases_done, "groups": groups,
            "shapes": {m: {k: list(v) for k, v in s.items()} for m, s in ckpt.shapes.items()},
            "results": ckpt.results, "audit": ckpt.audit, "rng": _encode(rng)}
    body = save(arrays, metadata={"edgefuse": json.dumps(meta)})
    return MAGIC + hmac.new(key, MAGIC + body, hashlib.sha256).digest() + body


def decode(data: bytes, cfg: DictConfig, key: bytes, name: str = "checkpoint") -> Checkpoint:
    """Verify and parse a checkpoint file's bytes for a run of ``cfg``.

    Raises:
        CheckpointError: wrong magic, short file, MAC mismatch (truncated, altered or
            forged), a body that does not parse, or content that does not fit ``cfg``
            (round, phase or model not in the config; a state whose ranks, shapes or values
            are not a valid adapter).
        CheckpointMismatch: a valid checkpoint of another config.
    """
    from safetensors.numpy import load

    head = len(MAGIC) + 32
    if len(data) < head or data[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{name}: not an edgefuse checkpoint (bad header, {len(data)} bytes)")
    body = data[head:]
    mac = hmac.new(key, MAGIC + body, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, data[len(MAGIC):head]):
        raise CheckpointError(f"{name}: MAC mismatch (truncated, altered, or made with another key)")
    try:
        arrays = load(body)
        meta = json.loads(_metadata(body)["edgefuse"])
    except Exception as e:  # an authentic file that still does not parse
        raise CheckpointError(f"{name}: unreadable body ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{name}: format {meta.get('format')!r}, this code reads {FORMAT}")
    current = pinned_config(cfg)
    if meta.get("config") != current:
        raise CheckpointMismatch(
            f"{name} was saved by a run of another config ({config_diff(meta.get('config') or {}, current)}); "
            "resume with the same experiment and overrides, or use another output folder")
    try:
        return _checked(meta, arrays, cfg, name)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{name}: malformed content ({type(e).__name__}: {e})") from e


def _metadata(body: bytes) -> dict:
    """The safetensors header's ``__metadata__`` (8-byte little-endian length, JSON)."""
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + n])["__metadata__"]


def _checked(meta: dict, arrays: dict[str, np.ndarray], cfg: DictConfig, name: str) -> Checkpoint:
    """Build the :class:`Checkpoint` from a verified file, refusing what does not fit ``cfg``."""
    from edgefuse.app.phases import PHASES

    last = int(cfg.federation.num_rounds)
    rnd = meta["round"]
    if not isinstance(rnd, int) or not 1 <= rnd <= last:
        raise CheckpointError(f"{name}: round {rnd!r} is not in 1..{last}")
    known = [p.name for p in PHASES]
    done = list(meta["phases_done"])
    if done and (rnd != last or any(p not in known for p in done)):
        raise CheckpointError(f"{name}: phases {done} done after round {rnd} of {last}")
    clients = list(cfg.federation.clients)
    ranks = {}  # model -> partition id -> rank
    for pid, c in enumerate(clients):
        ranks.setdefault(str(c.model), {})[pid] = int(c.lora_rank)
    shapes = {m: {k: tuple(int(x) for x in v) for k, v in s.items()} for m, s in meta["shapes"].items()}
    states: dict[str, dict] = {}

    def get_state(ref: dict) -> dict:
        sid = str(ref["id"])
        if sid not in states:
            states[sid] = {str(k): arrays[f"{sid}.{i}"] for i, k in enumerate(ref["keys"])}
        return states[sid]

    groups = {}
    for model, g in meta["groups"].items():
        if model not in ranks:
            raise CheckpointError(f"{name}: group {model!r} is not in federation.clients")
        if model not in shapes:
            raise CheckpointError(f"{name}: group {model!r} has no module shapes")
        rank, alpha = int(g["global_rank"]), float(g["global_alpha"])
        if rank not in ranks[model].values():
            raise CheckpointError(f"{name}: {model} global rank {rank} is no client's rank")
        _check_state(model, -1, rank, alpha, get_state(g["global_state"]), shapes[model], name)
        per_client = {}
        for pid, ref in g["per_client"]:
            if pid not in ranks[model]:
                raise CheckpointError(f"{name}: partition {pid!r} does not run {model}")
            per_client[pid] = get_state(ref)
            _check_state(model, pid, ranks[model][pid], alpha, per_client[pid], shapes[model], name)
        groups[model] = GroupResult(per_client=per_client, global_state=get_state(g["global_state"]),
                                    global_rank=rank, global_alpha=alpha, info=_decode(g["info"]))
    rng = _decode(meta.get("rng") or {})
    if rng:
        np_name, *np_rest = rng["numpy"]
        rng["numpy"] = (np_name, arrays["rng.numpy"], *np_rest)
        rng["torch"] = arrays["rng.torch"]
    results = meta["results"]
    if not isinstance(results, dict) or not isinstance(results.get("rounds"), list):
        raise CheckpointError(f"{name}: results without a rounds list")
    if [r.get("round") for r in results["rounds"]] != list(range(1, rnd + 1)):
        raise CheckpointError(f"{name}: results rounds do not run 1..{rnd}")
    return Checkpoint(round=rnd, phases_done=done, groups=groups, shapes=shapes, results=results,
                      audit=dict(meta.get("audit") or {}), rng=rng)


def _check_state(model: str, pid: int, rank: int, alpha: float, state: dict, shapes: dict,
                 name: str) -> None:
    try:
        validate_update(ClientUpdate(pid, model, rank, alpha, 1, state), model, shapes)
    except MalformedUpdateError as e:
        raise CheckpointError(f"{name}: {model} state refused: {e}") from e
    if any(v.dtype != np.float32 for v in state.values()):
        raise CheckpointError(f"{name}: {model} state is not float32")


# --------------------------------------------------------------------------- files


def files(out: str | os.PathLike) -> list[Path]:
    """The checkpoint files of a run folder, oldest first (by round, then phases done)."""
    folder = Path(out) / FOLDER
    found = []
    for p in folder.glob("ckpt-*.bin") if folder.is_dir() else []:
        if m := _NAME.match(p.name):
            found.append(((int(m[1]), int(m[2])), p))
    return [p for _, p in sorted(found)]


def save(out: str | os.PathLike, ckpt: Checkpoint, cfg: DictConfig, key: bytes | None = None) -> Path:
    """Write ``ckpt`` atomically into ``<out>/checkpoint/``; keep the newest :data:`KEEP`.

    Returns the file written."""
    key = load_key(cfg) if key is None else key
    path = Path(out) / FOLDER / f"ckpt-r{ckpt.round:03d}-p{len(ckpt.phases_done)}.bin"
    atomic_write_bytes(path, encode(ckpt, cfg, key))
    for old in files(out)[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def latest(out: str | os.PathLike, cfg: DictConfig, key: bytes | None = None) -> Checkpoint | None:
    """The newest usable checkpoint of run folder ``out`` for ``cfg``, or None (no folder or
    no usable file). Unusable files are skipped with a warning each.

    Raises:
        CheckpointMismatch: the newest authentic file is of another config.
    """
    paths = files(out)
    if not paths:
        return None
    key = load_key(cfg) if key is None else key
    for path in reversed(paths):
        try:
            return decode(path.read_bytes(), cfg, key, name=str(path))
        except (CheckpointError, OSError) as e:
            log(WARNING, "resume: ignoring %s: %s", path, e)
    return None
