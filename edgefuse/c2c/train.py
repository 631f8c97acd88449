"""Training Cache-to-Cache fusers on the server (plain PyTorch, no Flower).

The server holds public copies of the open-weight edge SLMs (with the current global LoRA
adapters applied) and a public Dolly split that no client holds. For one ordered pair
(receiver ← sharer) it trains a :class:`edgefuse.c2c.fuser.C2CFuser` while both models stay
frozen; the loss is the receiver's next-token cross-entropy on the response, given the
fused prompt cache::

    receiver prefill  p_0 .. p_{n-2}            (no grad)  ─┐
    sharer prefill    its own formatted prompt  (no grad)  ─┴─ fuser ─► fused cache
    receiver forward  [p_{n-1}, r_0 .. r_{m-1}] on the fused cache  ─► CE on r_0 .. r_{m-1}

**Why the last prompt token is not prefilled.** The first response token ``r_0`` is
predicted at the position of the last prompt token ``p_{n-1}``. If that position were part
of the (unfused) prefill, its logits would be computed before the fuser runs, and the
fused cache could not influence the prediction of ``r_0``. So the receiver prefills
``p_0 .. p_{n-2}`` (the cache the fuser changes) and feeds ``p_{n-1}`` as the first token
of the continuation, which attends to the fused cache. Decoding does the same: prefill all
but the last prompt token, fuse, then start generating from the last prompt token.

A row becomes a :class:`edgefuse.c2c.examples.PairExample` (both prompts, the alignment, the
labels) in :mod:`edgefuse.c2c.examples`, which the query-time path shares.

Labels follow the Hugging Face convention used in :mod:`edgefuse.training`: ``labels``
has the continuation's length, ``-100`` on position 0 (``p_{n-1}``, not predicted), the id
elsewhere; the loss compares ``logits[:, :-1]`` with ``labels[:, 1:]``, so the input
``[p_{n-1}, r_0 .. r_{m-2}]`` predicts ``[r_0 .. r_{m-1}]`` (the response and its EOS).

**Reproducibility and resume.** The examples of step ``s`` and the Gumbel noise of step
``s`` are functions of ``(seed, s)`` only (the global torch RNG is re-seeded inside a
forked RNG context at every step), so a run resumed from a checkpoint ends with the same
parameters as an uninterrupted run with the same seed, and the caller's RNG is untouched.

Checkpoints are ``<checkpoint_dir>/step-000005.pt`` (``torch.save`` of a dict: fuser state,
optimizer state, step, seed, batch size, step losses), written atomically (temp file,
fsync, rename), the newest ``keep_last`` kept. An unreadable or incomplete checkpoint file
is **skipped with a warning** (``UserWarning``) and the next older one is used; with none
left, training starts from step 0. A checkpoint from a different run (other seed or batch
size, length grouping, fuser config, step count, learning rate, weight decay, gradient clip
or training set, or past ``steps``) is a :class:`CheckpointMismatchError` (a ``ValueError``).
"""

from __future__ import annotations

import re
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edgefuse.data import IGNORE_INDEX
from edgefuse.io import atomic_write_bytes

from transformers import DynamicCache

from .examples import PairExample
from .fuser import control_sharer, fused_forward
from .prefill import Prefiller

CHECKPOINT_FORMAT = "edgefuse-fuser-train/1"


class CheckpointMismatchError(ValueError):
    """A checkpoint in ``checkpoint_dir`` is from another run (seed, batch size, length
    grouping, fuser config, schedule or training set): resuming it would not continue this run."""

_CKPT_RE = re.compile(r"^step-(\d+)\.pt$")


# ---------------------------------------------------------------------------- losses

def _device(model) -> torch.device:
    return next(model.parameters()).device


def _ids(ids: list[int], model) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long, device=_device(model))


def _continuation_loss(logits: torch.Tensor, labels: list[int]) -> tuple[torch.Tensor, int]:
    """Summed CE of ``logits [1, T, V]`` against ``labels`` shifted by one, and the count."""
    target = torch.tensor(labels[1:], dtype=torch.long, device=logits.device)
    loss = F.cross_entropy(logits[0, :-1].float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((target != IGNORE_INDEX).sum())


def _prefillers(receiver_model, sharer_model, receiver_prefill, sharer_prefill):
    return (receiver_prefill or Prefiller(receiver_model), sharer_prefill or Prefiller(sharer_model))


def shuffled_partners(n: int, seed: int) -> list[int]:
    """A derangement of ``range(n)`` (no item is its own partner when ``n >= 2``), a pure
    function of ``(n, seed)``: item ``p[k]`` of a random permutation ``p`` takes ``p[k+1]``'s
    sharer cache (cyclically). The shuffled-sharer control feeds item ``i`` the sharer cache
    of ``partners[i]``."""
    perm = np.random.default_rng([seed, 7]).permutation(n)
    out = [0] * n
    for k, i in enumerate(perm):
        out[int(i)] = int(perm[(k + 1) % n])
    return out


def _fuse_inputs(fuser, examples: list[PairExample], index: list[int], r_pre, s_pre, partners):
    """Per example: the receiver's prompt cache and the (control's) sharer cache + mapping."""
    control = fuser.config.sharer_control
    out = []
    for i in index:
        ex = examples[i]
        r_cache = r_pre(ex.receiver_prompt_ids)
        s_cache = s_pre(ex.sharer_prompt_ids)
        partner = None
        if control == "shuffled":
            if partners is None:
                raise ValueError("the shuffled-sharer control needs partners (shuffled_partners)")
            partner = s_pre(examples[partners[i]].sharer_prompt_ids)
        s_cache, mapping = control_sharer(control, s_cache, ex.mapping, partner)
        out.append((r_cache, s_cache, mapping))
    return out


def _stack_left_padded(caches: list, config) -> DynamicCache | None:
    """One ``[B, H, Tmax, D]`` cache from ``B`` batch-1 prompt caches, each left-padded with
    zeros; ``None`` when a sliding-window layer dropped prompt tokens (then the prompts
    cannot share one padded time axis)."""
    lengths = [c.get_seq_length() for c in caches]
    tmax = max(lengths)
    if any(layer.keys.shape[2] != t for c, t in zip(caches, lengths) for layer in c.layers):
        return None
    out = DynamicCache(config=config)
    if len(out.layers) != len(caches[0].layers):
        return None
    for i in range(len(out.layers)):
        keys = torch.cat([F.pad(c.layers[i].keys, (0, 0, tmax - t, 0)) for c, t in zip(caches, lengths)])
        values = torch.cat([F.pad(c.layers[i].values, (0, 0, tmax - t, 0)) for c, t in zip(caches, lengths)])
        out.update(keys, values, i)
    return out


def batch_losses(receiver_model, caches: list, examples: list[PairExample], amp: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response CE of each example, given its (fused) prompt cache, in one forward.

    The ``B`` caches are left-padded onto one time axis, the continuations right-padded;
    the attention mask hides the padding and each row's positions continue after its own
    prompt (``T_b + arange(C)``), so every row computes what it would alone (up to float
    rounding). A batch of one, or prompts a sliding window cut, run one at a time.

    Args:
        caches: ``B`` batch-1 prompt caches (``T_b`` tokens each), fused or not.
        examples: the ``B`` examples (their ``continuation_ids`` and ``labels``).
        amp: run the receiver under bfloat16 autocast (CUDA only; the loss stays float32).

    Returns:
        ``(loss_sums [B], tokens [B])``: summed CE (nats) and predicted tokens per example.
    """
    device = _device(receiver_model)
    stacked = _stack_left_padded(caches, receiver_model.config) if len(caches) > 1 else None
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if amp and device.type == "cuda" else nullcontext()
    if stacked is None:
        sums, counts = [], []
        for cache, ex in zip(caches, examples):
            with ctx:
                logits = fused_forward(receiver_model, cache, _ids(ex.continuation_ids, receiver_model), copy=True)
            loss, n = _continuation_loss(logits, ex.labels)
            sums.append(loss)
            counts.append(n)
        return torch.stack(sums), torch.tensor(counts, device=device)
    lengths = [c.get_seq_length() for c in caches]
    tmax, cmax = max(lengths), max(len(ex.continuation_ids) for ex in examples)
    b = len(examples)
    ids = torch.zeros(b, cmax, dtype=torch.long, device=device)
    labels = torch.full((b, cmax), IGNORE_INDEX, dtype=torch.long, device=device)
    mask = torch.zeros(b, tmax + cmax, dtype=torch.long, device=device)
    for k, (ex, t) in enumerate(zip(examples, lengths)):
        c = len(ex.continuation_ids)
        ids[k, :c] = torch.tensor(ex.continuation_ids, device=device)
        labels[k, :c] = torch.tensor(ex.labels, device=device)
        mask[k, tmax - t:tmax + c] = 1
    positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(cmax, device=device)[None, :]
    with ctx:
        logits = receiver_model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                cache=stacked, use_cache=True).logits
    target = labels[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), target, ignore_index=IGNORE_INDEX,
                         reduction="none")
    return ce.sum(dim=1), (target != IGNORE_INDEX).sum(dim=1)


def pair_loss(fuser, receiver_model, sharer_model, ex: PairExample) -> tuple[torch.Tensor, int]:
    """The receiver's mean CE per response token given the fused prompt cache (one example,
    the real sharer: the query-time computation).

    Both prefills run without gradients; the fuser (in whatever mode it is: Gumbel gates
    when training, hard gates in eval) fuses them, and :func:`edgefuse.c2c.fuser.fused_forward`
    runs the continuation, so gradients reach the fuser (and the models only if their
    parameters require grad: :func:`train_fuser` freezes them). Batch size 1.

    Returns:
        ``(loss, n_tokens)``: a scalar tensor (summed CE / ``n_tokens``) and the count.
    """
    with torch.no_grad():
        r_cache = receiver_model(_ids(ex.receiver_prompt_ids, receiver_model), use_cache=True).cache
        s_cache = sharer_model(_ids(ex.sharer_prompt_ids, sharer_model), use_cache=True).cache
    fused = fuser(r_cache, s_cache, ex.mapping)
    logits = fused_forward(receiver_model, fused, _ids(ex.continuation_ids, receiver_model), copy=False)
    loss, n = _continuation_loss(logits, ex.labels)
    return loss / max(n, 1), n


def _chunks_by_length(index: list[int], examples: list[PairExample], size: int) -> list[list[int]]:
    """``index`` sorted by prompt + continuation length (longest first), cut into chunks of
    ``size``: little padding inside a chunk."""
    order = sorted(index, key=lambda i: (-(len(examples[i].receiver_prompt_ids)
                                          + len(examples[i].continuation_ids)), i))
    return [order[k:k + size] for k in range(0, len(order), size)]


@torch.no_grad()
def evaluate_pair(fuser, receiver_model, sharer_model, examples: list[PairExample], gate: str = "on",
                  receiver_prefill: Prefiller | None = None, sharer_prefill: Prefiller | None = None,
                  micro_batch: int = 8, seed: int = 0, amp: bool = False) -> dict:
    """Held-out CE per response token over ``examples``.

    ``gate="on"``: with the fuser in eval mode (hard gates, as at inference), fed what its
    ``sharer_control`` says (a ``shuffled`` fuser reads the sharer cache of
    ``shuffled_partners(len(examples), seed)``). ``gate="off"``: the receiver alone, run on
    its own prefill cache without calling the fuser or the sharer at all (not by trusting a
    closed gate). Prompt caches come from the prefillers (default: computed), ``micro_batch``
    examples of similar length per forward pass.

    Returns:
        ``{"loss": nats/token over all tokens, "tokens": count, "examples": len(examples),
        "per_example": mean nats/token of each example (the items of a paired comparison)}``.

    Raises:
        ValueError: ``examples`` is empty or ``gate`` is not ``on``/``off``.
    """
    if gate not in ("on", "off"):
        raise ValueError(f"gate must be 'on' or 'off', got {gate!r}")
    if not examples:
        raise ValueError("no evaluation examples")
    r_pre, s_pre = _prefillers(receiver_model, sharer_model, receiver_prefill, sharer_prefill)
    partners = shuffled_partners(len(examples), seed) if gate == "on" else None
    was_training = fuser.training
    fuser.eval()
    sums, counts = [0.0] * len(examples), [0] * len(examples)
    try:
        for chunk in _chunks_by_length(list(range(len(examples))), examples, max(1, micro_batch)):
            if gate == "on":
                caches = [fuser(r, s, m) for r, s, m in _fuse_inputs(fuser, examples, chunk, r_pre, s_pre, partners)]
            else:
                caches = [r_pre(examples[i].receiver_prompt_ids) for i in chunk]
            loss, n = batch_losses(receiver_model, caches, [examples[i] for i in chunk], amp)
            for i, l_, c in zip(chunk, loss.tolist(), n.tolist()):
                sums[i], counts[i] = l_, int(c)
    finally:
        fuser.train(was_training)
    total = sum(counts)
    return {"loss": sum(sums) / max(total, 1), "tokens": total, "examples": len(examples),
            "per_example": [x / max(c, 1) for x, c in zip(sums, counts)]}


# -------------------------------------------------------------------------- training

def _epoch_order(n: int, seed: int, epoch: int, lengths: list[int] | None, batch_size: int,
                 group: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    if lengths is None or group <= 1 or batch_size <= 1:
        return perm
    mega, blocks = batch_size * group, []
    for k in range(0, n, mega):
        chunk = sorted(perm[k:k + mega].tolist(), key=lambda i: -lengths[i])
        blocks += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    order = np.random.default_rng([seed, epoch, 3]).permutation(len(blocks))
    return np.array([i for b in order for i in blocks[b]], dtype=np.int64)


def step_indices(n: int, batch_size: int, seed: int, step: int, lengths: list[int] | None = None,
                 length_group: int = 0) -> list[int]:
    """Indices of the examples of ``step``: a pure function of ``(seed, step)``.

    Examples are visited epoch by epoch, epoch ``e`` in the permutation drawn from
    ``default_rng([seed, e])``; step ``s`` takes positions ``s*batch_size ..`` of that stream.
    With ``lengths`` and ``length_group > 1`` (batching by length, as Hugging Face's
    length-grouped sampler does): each run of ``batch_size * length_group`` permuted
    examples is sorted by length and cut into batches, and the epoch's batches are then
    shuffled (``default_rng([seed, e, 3])``), so a step's examples have similar lengths.
    """
    orders: dict[int, np.ndarray] = {}
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(k, n)
        if epoch not in orders:
            orders[epoch] = _epoch_order(n, seed, epoch, lengths, batch_size, length_group)
        out.append(int(orders[epoch][pos]))
    return out


@contextmanager
def frozen(*modules):
    """Within the block, ``modules`` are in eval mode with ``requires_grad=False``; their
    previous modes and flags are restored afterwards (also on error)."""
    saved = [(m.training, [p.requires_grad for p in m.parameters()]) for m in modules]
    for m in modules:
        m.requires_grad_(False)
        m.eval()
    try:
        yield
    finally:
        for m, (mode, flags) in zip(modules, saved):
            m.train(mode)
            for p, flag in zip(m.parameters(), flags):
                p.requires_grad_(flag)


def _examples_digest(examples: list[PairExample]) -> str:
    """sha256 (hex) of the training examples' token ids, alignments and labels, in order."""
    import hashlib
    import json

    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([list(map(int, x)) for x in (ex.receiver_prompt_ids, ex.sharer_prompt_ids,
                                                          ex.continuation_ids, ex.labels)]
                            + [[list(map(int, m)) for m in ex.mapping]]).encode())
    return h.hexdigest()


def _step_seed(seed: int, step: int) -> int:
    return int(np.random.default_rng([seed, step, 1]).integers(2**62))


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoint files in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _CKPT_RE.match(p.name))]
    return sorted(found, reverse=True)


def _save_checkpoint(directory: Path, state: dict, keep_last: int) -> Path:
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    path = atomic_write_bytes(directory / f"step-{state['step']:06d}.pt", buf.getvalue())
    if keep_last > 0:
        for _, old in _checkpoints(directory)[keep_last:]:
            old.unlink(missing_ok=True)
    return path


def _load_latest(directory: Path) -> dict | None:
    """The newest readable checkpoint in ``directory``; unreadable ones warn and are skipped."""
    for step, path in _checkpoints(directory):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if state.get("format") != CHECKPOINT_FORMAT or state.get("step") != step:
                raise ValueError(f"not a {CHECKPOINT_FORMAT} checkpoint of step {step}")
            for key in ("fuser", "optimizer", "seed", "batch_size", "losses"):
                if key not in state:
                    raise ValueError(f"missing {key!r}")
            return state
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, not fatal
            warnings.warn(f"ignoring unreadable fuser checkpoint {path}: {type(e).__name__}: {e}",
                          stacklevel=3)
    return None


def train_fuser(
    fuser,
    receiver_model,
    sharer_model,
    examples: list[PairExample],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = True,
    progress: bool = True,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    keep_last: int = 2,
    receiver_prefill: Prefiller | None = None,
    sharer_prefill: Prefiller | None = None,
    micro_batch: int = 8,
    length_group: int = 0,
    amp: bool = False,
    on_step=None,
    until: int | None = None,
) -> dict:
    """Train ``fuser`` for ``steps`` AdamW steps; both models stay frozen.

    Each step accumulates gradients over ``batch_size`` examples
    (:func:`step_indices`; ``length_group`` batches by length), ``micro_batch`` of similar
    length per forward pass (:func:`batch_losses`; the fuser runs per example, the
    alignments differ), weighting each by its response tokens (the step loss is the mean
    CE per response token of the step), clips the fuser's gradient norm to
    ``max_grad_norm`` and steps AdamW on the fuser's parameters only. The Gumbel
    temperature anneals from the config's ``init_temperature`` (step 0) to
    ``min_temperature`` (the last step). During the run both models are in eval mode with
    ``requires_grad=False``; their previous flags and modes are restored at the end. The
    fuser is left in eval mode. The fuser is fed what its ``sharer_control`` says (a
    ``shuffled`` fuser reads example ``shuffled_partners(len(examples), seed)[i]``'s sharer
    cache). Prompt caches come from the prefillers (:mod:`edgefuse.c2c.prefill`; default:
    computed at every step): cached and uncached runs give identical fusers. ``on_step(done,
    losses)`` is called after each step (a benchmark's hook). ``until`` stops after that
    step of the ``steps``-step schedule (checkpointed there; a later call resumes).

    Checkpoints (see the module docstring) go to ``checkpoint_dir`` every
    ``checkpoint_every`` steps (0: never) and after the last step. With ``resume=True`` the
    newest readable checkpoint there is loaded first; with ``resume=False`` existing
    checkpoint files there are deleted and training starts at step 0.

    Returns:
        ``{"steps", "first_loss", "last_loss", "mean_loss", "losses" (one per step, the
        resumed ones included), "seconds" (this call), "examples_per_s" (examples of this
        call's steps per second, prefills included), "resumed_from" (step or None)}``.

    Raises:
        ValueError: no examples, ``steps < 1`` or ``batch_size < 1``; a checkpoint of
            another seed, batch size, length grouping, fuser config (a control's too), step
            count, learning rate, weight decay, gradient clip or training set, or past ``steps``.
    """
    if not examples:
        raise ValueError("no training examples for the fuser")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    t0 = time.perf_counter()
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    params = list(fuser.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    start, losses, resumed_from = 0, [], None
    schedule = {"steps": steps, "lr": lr, "weight_decay": weight_decay, "max_grad_norm": max_grad_norm,
                "examples": _examples_digest(examples)}
    if checkpoint_dir is not None and not resume:
        for _, old in _checkpoints(checkpoint_dir):
            old.unlink(missing_ok=True)
    if checkpoint_dir is not None and resume:
        state = _load_latest(checkpoint_dir)
        if state is not None:
            if (state["seed"], state["batch_size"], state.get("length_group", 0)) != (seed, batch_size, length_group):
                raise CheckpointMismatchError(f"checkpoint in {checkpoint_dir} is from a run with seed={state['seed']}, "
                                 f"batch_size={state['batch_size']}, length_group={state.get('length_group', 0)} "
                                 f"(this run: {seed}, {batch_size}, {length_group}); "
                                 "use another checkpoint_dir or resume=False")
            if state.get("fuser_config", fuser.config.to_dict()) != fuser.config.to_dict():
                raise CheckpointMismatchError(f"checkpoint in {checkpoint_dir} is of a fuser with another config "
                                 f"({state['fuser_config']}; this one: {fuser.config.to_dict()}); "
                                 "use another checkpoint_dir or resume=False")
            if state["step"] > steps:
                raise CheckpointMismatchError(f"checkpoint in {checkpoint_dir} is at step {state['step']}, past steps={steps}")
            other = [f"{k}={state[k]!r} (this run: {v!r})" for k, v in schedule.items()
                     if k in state and state[k] != v]
            if other:  # another temperature / learning-rate schedule or training set
                raise CheckpointMismatchError(f"checkpoint in {checkpoint_dir} is from a run with "
                                              f"{', '.join(other)}; use another checkpoint_dir or resume=False")
            fuser.load_state_dict(state["fuser"])
            opt.load_state_dict(state["optimizer"])
            start = resumed_from = int(state["step"])
            losses = list(state["losses"])

    device = params[0].device
    rng_devices = [device] if device.type == "cuda" else []
    r_pre, s_pre = _prefillers(receiver_model, sharer_model, receiver_prefill, sharer_prefill)
    partners = shuffled_partners(len(examples), seed) if fuser.config.sharer_control == "shuffled" else None
    lengths = [len(ex.receiver_prompt_ids) + len(ex.continuation_ids) for ex in examples]

    def checkpoint(step: int) -> None:
        _save_checkpoint(checkpoint_dir, {
            "format": CHECKPOINT_FORMAT, "step": step, "seed": seed, "batch_size": batch_size,
            "length_group": length_group,
            **schedule, "fuser_config": fuser.config.to_dict(),
            "fuser": fuser.state_dict(), "optimizer": opt.state_dict(), "losses": losses,
        }, keep_last)

    from tqdm.auto import tqdm

    stop = steps if until is None else max(start, min(int(until), steps))
    bar = tqdm(range(start, stop), initial=start, total=steps, desc="fuser", unit="step",
               leave=False, disable=not progress)
    fuser.train()
    with frozen(receiver_model, sharer_model):
        try:
            for step in bar:
                tau = fuser.anneal(step, max(steps - 1, 1))
                index = step_indices(len(examples), batch_size, seed, step, lengths, length_group)
                total = sum(examples[i].num_tokens for i in index)
                opt.zero_grad(set_to_none=True)
                step_loss = 0.0
                with torch.random.fork_rng(devices=rng_devices):
                    torch.manual_seed(_step_seed(seed, step))
                    for chunk in _chunks_by_length(index, examples, max(1, micro_batch)):
                        inputs = _fuse_inputs(fuser, examples, chunk, r_pre, s_pre, partners)
                        caches = [fuser(r, s_, m) for r, s_, m in inputs]
                        loss, _ = batch_losses(receiver_model, caches, [examples[i] for i in chunk], amp)
                        loss = loss.sum() / max(total, 1)
                        loss.backward()
                        step_loss += float(loss.detach())
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                opt.step()
                losses.append(step_loss)
                bar.set_postfix(loss=f"{step_loss:.3f}", tau=f"{tau:.2f}")
                done = step + 1
                due = done in (steps, stop) or (checkpoint_every > 0 and done % checkpoint_every == 0)
                if checkpoint_dir is not None and due:
                    checkpoint(done)
                if on_step is not None:
                    on_step(done, losses)
        finally:
            bar.close()
            fuser.eval()
    return {
        "steps": steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "mean_loss": sum(losses) / len(losses) if losses else None,
        "losses": losses,
        "seconds": time.perf_counter() - t0,
        "examples_per_s": (stop - start) * batch_size / max(time.perf_counter() - t0, 1e-9),
        "resumed_from": resumed_from,
    }


__all__ = ["CheckpointMismatchError", "pair_loss", "batch_losses", "evaluate_pair", "step_indices", "shuffled_partners", "train_fuser",
           "frozen", "CHECKPOINT_FORMAT"]
