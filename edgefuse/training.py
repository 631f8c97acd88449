"""Local LoRA training and held-out evaluation on one client (plain PyTorch loops)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from edgefuse.data import batches, collate


def _token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over labelled (response) tokens, and their count.

    ``batch`` holds ``input_ids``, ``attention_mask``, ``labels`` as ``[batch, T]``
    LongTensors with ``labels == -100`` on prompt and padding positions. The LM head runs on
    the labelled positions only (``[n, V]`` logits instead of ``[batch, T, V]``: the same loss,
    a fraction of the memory), soft-capped as the model does (Gemma).
    """
    device = next(model.parameters()).device  # batches are built on the CPU
    batch = {k: v.to(device) for k, v in batch.items()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=batch["input_ids"],
                                attention_mask=batch["attention_mask"]).last_hidden_state
    shift_labels = batch["labels"][:, 1:]
    keep = shift_labels != -100
    logits = base.get_output_embeddings()(hidden[:, :-1][keep]).float()
    cap = getattr(base.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    loss = torch.nn.functional.cross_entropy(logits, shift_labels[keep], reduction="sum")
    return loss, int(keep.sum())


def train_steps(
    model,
    rows: Sequence[dict],
    pad_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    round_idx: int = 0,
    progress: bool = False,
    gradient_checkpointing: bool = False,
) -> dict:
    """Run ``steps`` AdamW steps on the trainable (LoRA) parameters of ``model``.

    The optimizer starts fresh every round (its state is not federated), as in
    FlowerTune. Loss is the mean cross-entropy per response token of each batch. Batch order
    and dropout noise are functions of ``(seed, round_idx)`` only, so a run repeats exactly
    whatever else the process ran before.

    ``gradient_checkpointing``: recompute each decoder layer in the backward pass (transformers'
    non-reentrant checkpointing, which restores the dropout RNG: the same losses and adapter)
    instead of keeping its activations; switched off again on return.

    Returns:
        ``{"train_loss": mean of the step losses (nats/token), "first_loss", "last_loss",
        "steps", "tokens": response tokens seen, "seconds"}``.

    Raises:
        ValueError: ``rows`` is empty or ``steps < 1``.
    """
    if not rows:
        raise ValueError("no training rows: the client's partition is empty after tokenization")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    model.train()
    losses, tokens, t0 = [], 0, time.perf_counter()
    stream = batches(rows, batch_size, seed, round_idx)
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="train", unit="step", leave=False)
    device = next(model.parameters()).device
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if gradient_checkpointing:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # Dropout noise from (seed, round), not from whatever this worker process ran before:
    # the same config gives the same adapters on any schedule; the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(np.random.default_rng([seed, round_idx]).integers(2**62)))
        for _ in it:
            batch = collate(next(stream), pad_id)
            loss_sum, n = _token_loss_sum(model, batch)
            loss = loss_sum / max(n, 1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            losses.append(float(loss.detach()))
            tokens += n
    if gradient_checkpointing:
        base.activation_checkpointing_disable()
    model.eval()
    return {
        "train_loss": sum(losses) / len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "steps": steps,
        "tokens": tokens,
        "seconds": time.perf_counter() - t0,
    }


@torch.no_grad()
def evaluate_loss(model, rows: Sequence[dict], pad_id: int, batch_size: int = 8) -> dict:
    """Held-out loss: cross-entropy per response token, averaged over all tokens of ``rows``.

    Returns:
        ``{"loss": nats/token, "ppl": exp(loss), "tokens": count, "examples": len(rows)}``.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("no evaluation rows")
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        loss_sum, n = _token_loss_sum(model, collate(list(rows[i:i + batch_size]), pad_id))
        total += float(loss_sum)
        count += n
    loss = total / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count, "examples": len(rows)}
