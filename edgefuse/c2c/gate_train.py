"""Training the several-sharers gate (:class:`edgefuse.c2c.multi.MultiSharerGate`) with the
pair fusers frozen: examples, loss, evaluation and the training loop. Kept apart from
:mod:`edgefuse.c2c.multi` so that the query-time path (:func:`edgefuse.c2c.multi.fuse_many`)
never imports training code."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .examples import PairExample, build_pair_example
from .fuser import fused_forward
from .multi import MultiSharerGate, fuse_many
from .train import _continuation_loss, _ids, frozen, step_indices


# ------------------------------------------------------------------------- examples

@dataclass
class MultiExample:
    """One public row, tokenized for a receiver and ``K`` sharers.

    The receiver fields are those of :class:`edgefuse.c2c.examples.PairExample` (identical for every
    sharer); per sharer ``k``, ``sharer_prompt_ids[k]`` is its whole formatted prompt and
    ``mappings[k]`` the alignment of the receiver prefill (``len(receiver_prompt_ids)``
    lists) onto it.
    """

    receiver_prompt_ids: list[int]
    continuation_ids: list[int]
    labels: list[int]
    sharer_prompt_ids: list[list[int]]
    mappings: list[list[list[int]]]

    @property
    def num_sharers(self) -> int:
        return len(self.sharer_prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Labelled (predicted) tokens: the response tokens."""
        return self.pair(0).num_tokens

    def pair(self, k: int) -> PairExample:
        """The :class:`edgefuse.c2c.examples.PairExample` of the receiver with sharer ``k``."""
        return PairExample(self.receiver_prompt_ids, self.continuation_ids, self.labels,
                           self.sharer_prompt_ids[k], self.mappings[k])


def build_multi_example(example: dict, receiver_tok, sharer_toks: list, max_seq_len: int) -> MultiExample | None:
    """:func:`edgefuse.c2c.examples.build_pair_example` for every sharer; ``None`` if one of them is unusable.

    Raises:
        ValueError: no sharer tokenizers.
    """
    if not sharer_toks:
        raise ValueError("no sharer tokenizers")
    pairs = [build_pair_example(example, receiver_tok, tok, max_seq_len) for tok in sharer_toks]
    if any(p is None for p in pairs):
        return None
    first = pairs[0]
    for p in pairs[1:]:  # the receiver side depends on the receiver tokenizer only
        assert (p.receiver_prompt_ids, p.continuation_ids, p.labels) == \
            (first.receiver_prompt_ids, first.continuation_ids, first.labels)
    return MultiExample(first.receiver_prompt_ids, first.continuation_ids, first.labels,
                        [p.sharer_prompt_ids for p in pairs], [p.mapping for p in pairs])


def build_multi_examples(rows, receiver_tok, sharer_toks: list, max_seq_len: int) -> list[MultiExample]:
    """:func:`build_multi_example` on every row, dropping rows unusable for any sharer."""
    built = (build_multi_example(r, receiver_tok, sharer_toks, max_seq_len) for r in rows)
    return [ex for ex in built if ex is not None]


# ---------------------------------------------------------------------------- losses

def multi_loss(gate: MultiSharerGate | None, fusers: list, receiver_model, sharer_models: list,
               ex: MultiExample) -> tuple[torch.Tensor, int]:
    """The receiver's mean CE per response token given the gated multi-sharer cache.

    The prefills and the ``K`` fusers run without gradients (the fusers in whatever mode
    they are in: :func:`train_gate` and :func:`evaluate_multi` put them in eval mode);
    :func:`fuse_many` and the continuation run with them, so gradients reach the gate.
    Batch size 1.

    Returns:
        ``(loss, n_tokens)``: a scalar tensor (summed CE / ``n_tokens``) and the count.

    Raises:
        ValueError: ``fusers``, ``sharer_models`` and the example's sharers differ in number.
    """
    k = len(fusers)
    if not k or len(sharer_models) != k or ex.num_sharers != k:
        raise ValueError(f"need one fuser per sharer model per example sharer: got {k} fusers, "
                         f"{len(sharer_models)} sharer models, {ex.num_sharers} example sharers")
    with torch.no_grad():
        r_cache = receiver_model(_ids(ex.receiver_prompt_ids, receiver_model), use_cache=True).cache
        fused = []
        for fuser, model, ids, mapping in zip(fusers, sharer_models, ex.sharer_prompt_ids, ex.mappings):
            s_cache = model(_ids(ids, model), use_cache=True).cache
            fused.append(fuser(r_cache, s_cache, mapping))
    combined = fuse_many(r_cache, fused, gate)
    logits = fused_forward(receiver_model, combined, _ids(ex.continuation_ids, receiver_model), copy=False)
    loss, n = _continuation_loss(logits, ex.labels)
    return loss / max(n, 1), n


@torch.no_grad()
def evaluate_multi(gate: MultiSharerGate | None, fusers: list, receiver_model, sharer_models: list,
                   examples: list[MultiExample]) -> dict:
    """Held-out CE per response token over ``examples``, gate and fusers in eval mode.

    Returns:
        ``{"loss": nats/token, "tokens": count, "examples": len(examples)}``.

    Raises:
        ValueError: ``examples`` is empty; the checks of :func:`multi_loss`.
    """
    if not examples:
        raise ValueError("no evaluation examples")
    modules = [m for m in [gate, *fusers] if m is not None]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    total, count = 0.0, 0
    try:
        for ex in examples:
            loss, n = multi_loss(gate, fusers, receiver_model, sharer_models, ex)
            total += float(loss) * n
            count += n
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
    return {"loss": total / max(count, 1), "tokens": count, "examples": len(examples)}


# -------------------------------------------------------------------------- training

def train_gate(
    gate: MultiSharerGate,
    fusers: list,
    receiver_model,
    sharer_models: list,
    examples: list[MultiExample],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = True,
    max_grad_norm: float = 1.0,
) -> dict:
    """Train only ``gate`` for ``steps`` AdamW steps; fusers and models stay frozen.

    Each step accumulates over ``batch_size`` examples (:func:`edgefuse.c2c.train.step_indices`,
    a function of ``(seed, step)``), weighting each by its response tokens, clips the
    gate's gradient norm to ``max_grad_norm`` and steps. During the run the models and
    fusers are in eval mode with ``requires_grad=False`` (fusers with hard gates, as at
    inference) and the gate in training mode (soft weights, no dropping); previous modes
    and flags are restored at the end, and the gate is left in eval mode. The gate has no
    randomness, so the run is deterministic given ``seed``.

    Returns:
        ``{"steps", "first_loss", "last_loss", "mean_loss", "losses" (one per step),
        "seconds"}``.

    Raises:
        ValueError: no examples, ``steps < 1`` or ``batch_size < 1``; the checks of
            :func:`multi_loss`.
    """
    if not examples:
        raise ValueError("no training examples for the gate")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    t0 = time.perf_counter()
    params = list(gate.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    from tqdm.auto import tqdm

    losses: list[float] = []
    bar = tqdm(range(steps), total=steps, desc="gate", unit="step", leave=False, disable=not progress)
    gate.train()
    with frozen(receiver_model, *sharer_models, *fusers):
        try:
            for step in bar:
                batch = [examples[i] for i in step_indices(len(examples), batch_size, seed, step)]
                total = sum(ex.num_tokens for ex in batch)
                opt.zero_grad(set_to_none=True)
                step_loss = 0.0
                for ex in batch:
                    loss, n = multi_loss(gate, fusers, receiver_model, sharer_models, ex)
                    (loss * (n / max(total, 1))).backward()
                    step_loss += float(loss.detach()) * n / max(total, 1)
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                opt.step()
                losses.append(step_loss)
                bar.set_postfix(loss=f"{step_loss:.3f}")
        finally:
            bar.close()
            gate.eval()
    return {
        "steps": steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "mean_loss": sum(losses) / len(losses) if losses else None,
        "losses": losses,
        "seconds": time.perf_counter() - t0,
    }


__all__ = [
    "MultiSharerGate", "fuse_many", "MultiExample", "build_multi_example", "build_multi_examples",
    "multi_loss", "evaluate_multi", "train_gate",
]
