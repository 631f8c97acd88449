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
size, or past ``steps``) is a ``ValueError``.
"""

from __future__ import annotations

import re
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edgefuse.data import IGNORE_INDEX, format_example
from edgefuse.io import atomic_write_bytes

from .align import align_formatted, align_spans
from .fuser import fused_forward

CHECKPOINT_FORMAT = "edgefuse-fuser-train/1"
_CKPT_RE = re.compile(r"^step-(\d+)\.pt$")


# ------------------------------------------------------------------------- examples

@dataclass
class PairExample:
    """One public row, tokenized for an ordered (receiver ← sharer) pair.

    Attributes:
        receiver_prompt_ids: the receiver's formatted prompt without its last token
            (``Tp_r`` ids, the receiver prefill that the fuser changes).
        continuation_ids: the receiver's last prompt token, then the response ids
            (response text + EOS, possibly cut on the right by ``max_seq_len``).
        labels: same length as ``continuation_ids``: ``-100`` at position 0, the ids
            after (the model input is shifted against them in the loss).
        sharer_prompt_ids: the sharer's own formatted prompt, all of it (``Tp_s`` ids).
        mapping: ``Tp_r`` lists of sharer prompt indices (:mod:`edgefuse.c2c.align`).
    """

    receiver_prompt_ids: list[int]
    continuation_ids: list[int]
    labels: list[int]
    sharer_prompt_ids: list[int]
    mapping: list[list[int]]

    @property
    def num_tokens(self) -> int:
        """Labelled (predicted) tokens: the response tokens."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


def _tokenize(example: dict, tok, max_seq_len: int):
    """Format and tokenize one row as :func:`edgefuse.data.tokenize_example` does.

    Returns ``(prompt_text, add_special, prompt_ids, kept, response_ids)``: ``kept`` are
    the indices into ``prompt_ids`` that survive truncation (a leading BOS plus a suffix),
    ``response_ids`` the response tokens that survive it.
    """
    prompt, response = format_example(example, tok)
    bos = tok.bos_token
    add_special = not (bos and prompt.startswith(bos))  # Gemma-style templates write BOS
    p_ids = tok(prompt, add_special_tokens=add_special)["input_ids"]
    r_ids = tok(response, add_special_tokens=False)["input_ids"]
    kept = list(range(len(p_ids)))
    if len(p_ids) + len(r_ids) > max_seq_len:
        keep = max(max_seq_len - len(r_ids), max_seq_len // 2)
        if len(p_ids) > keep:
            head = [0] if bos is not None and p_ids and p_ids[0] == tok.bos_token_id else []
            tail = max(keep - len(head), 0)
            kept = head + list(range(len(p_ids) - tail, len(p_ids)))
    kept = kept[:max_seq_len]
    return prompt, add_special, p_ids, kept, r_ids[:max(max_seq_len - len(kept), 0)]


def _special_offset(tok, text: str, add_special: bool) -> tuple[int, int]:
    """``(leading, trailing)`` tokens that ``add_special`` adds around ``tok(text)``."""
    if not add_special:
        return 0, 0
    plain = tok(text, add_special_tokens=False)["input_ids"]
    full = tok(text, add_special_tokens=True)["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return k, len(full) - len(plain) - k
    raise ValueError(f"{type(tok).__name__} changes the text's tokens when adding special tokens")


def _content_mapping(r_text: str, s_text: str, example: dict, receiver_tok, sharer_tok) -> list[list[int]]:
    """Alignment of the two formatted prompts (tokenized without special tokens).

    Through the user content (instruction + blank line + context, as
    :func:`edgefuse.data.format_example` builds it) with :func:`edgefuse.c2c.align.align_formatted`.
    When one side has no chat template, its prompt holds the instruction and context in
    separate blocks, so the content is not one substring: then instruction and context
    are aligned separately (each located from the end, the context first) and merged.
    """
    instruction = example["instruction"].strip()
    context = (example.get("context") or "").strip()
    content = instruction + (f"\n\n{context}" if context else "")
    try:
        return align_formatted(r_text, s_text, content, receiver_tok, sharer_tok)
    except ValueError:
        pass
    merged: list[set[int]] | None = None
    r_end, s_end = len(r_text), len(s_text)
    for piece in (context, instruction):  # right to left: the instruction precedes the context
        if not piece:
            continue
        ra, sa = r_text.rfind(piece, 0, r_end), s_text.rfind(piece, 0, s_end)
        if ra < 0 or sa < 0:
            continue
        part = align_spans(r_text, (ra, ra + len(piece)), s_text, (sa, sa + len(piece)),
                           receiver_tok, sharer_tok)
        merged = [set(m) for m in part] if merged is None else [a | set(b) for a, b in zip(merged, part)]
        r_end, s_end = ra, sa
    if merged is None:
        return [[] for _ in receiver_tok(r_text, add_special_tokens=False)["input_ids"]]
    return [sorted(m) for m in merged]


def build_pair_example(example: dict, receiver_tok, sharer_tok, max_seq_len: int) -> PairExample | None:
    """Tokenize one Dolly row for a (receiver ← sharer) pair; ``None`` if nothing usable remains.

    Both prompts are formatted by :func:`edgefuse.data.format_example` with each model's own
    tokenizer (chat template or plain format) and truncated as
    :func:`edgefuse.data.tokenize_example` does (the prompt loses tokens from its left,
    keeping a leading BOS, not below ``max_seq_len // 2``; then the whole is cut on the
    right); the sharer's prompt is truncated by the same rule with its own response length.
    The alignment (see :func:`_content_mapping`) is then restricted to the kept tokens.

    Returns ``None`` when no response token survives, the receiver prompt has fewer than
    two tokens (nothing to prefill), the sharer prompt is empty, or no prefilled receiver
    token maps to any sharer token (nothing to fuse).
    """
    r_text, r_special, r_prompt, r_kept, r_resp = _tokenize(example, receiver_tok, max_seq_len)
    s_text, s_special, s_prompt, s_kept, _ = _tokenize(example, sharer_tok, max_seq_len)
    if not r_resp or len(r_kept) < 2 or not s_kept:
        return None
    mapping = _content_mapping(r_text, s_text, example, receiver_tok, sharer_tok)
    r_lead, r_trail = _special_offset(receiver_tok, r_text, r_special)
    s_lead, _ = _special_offset(sharer_tok, s_text, s_special)
    mapping = [[]] * r_lead + [[s + s_lead for s in m] for m in mapping] + [[]] * r_trail
    assert len(mapping) == len(r_prompt), (len(mapping), len(r_prompt))
    new_index = {orig: new for new, orig in enumerate(s_kept)}
    prefill = r_kept[:-1]
    mapping = [[new_index[s] for s in mapping[i] if s in new_index] for i in prefill]
    if not any(mapping):
        return None
    last = r_prompt[r_kept[-1]]
    return PairExample(
        receiver_prompt_ids=[r_prompt[i] for i in prefill],
        continuation_ids=[last] + r_resp,
        labels=[IGNORE_INDEX] + r_resp,
        sharer_prompt_ids=[s_prompt[i] for i in s_kept],
        mapping=mapping,
    )


def build_pair_examples(rows, receiver_tok, sharer_tok, max_seq_len: int) -> list[PairExample]:
    """:func:`build_pair_example` on every row, dropping the unusable ones."""
    built = (build_pair_example(r, receiver_tok, sharer_tok, max_seq_len) for r in rows)
    return [ex for ex in built if ex is not None]


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


def pair_loss(fuser, receiver_model, sharer_model, ex: PairExample) -> tuple[torch.Tensor, int]:
    """The receiver's mean CE per response token given the fused prompt cache.

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


def _alone_loss(receiver_model, ex: PairExample) -> tuple[torch.Tensor, int]:
    """The receiver's summed CE on its own prefill cache (no fuser, no sharer), and the count."""
    cache = receiver_model(_ids(ex.receiver_prompt_ids, receiver_model), use_cache=True).cache
    logits = fused_forward(receiver_model, cache, _ids(ex.continuation_ids, receiver_model), copy=False)
    return _continuation_loss(logits, ex.labels)


@torch.no_grad()
def evaluate_pair(fuser, receiver_model, sharer_model, examples: list[PairExample], gate: str = "on") -> dict:
    """Held-out CE per response token over ``examples``.

    ``gate="on"``: with the fuser in eval mode (hard gates, as at inference).
    ``gate="off"``: the receiver alone, run on its own prefill cache without calling the
    fuser or the sharer at all (not by trusting a closed gate).

    Returns:
        ``{"loss": nats/token, "tokens": count, "examples": len(examples)}``.

    Raises:
        ValueError: ``examples`` is empty or ``gate`` is not ``on``/``off``.
    """
    if gate not in ("on", "off"):
        raise ValueError(f"gate must be 'on' or 'off', got {gate!r}")
    if not examples:
        raise ValueError("no evaluation examples")
    was_training = fuser.training
    fuser.eval()
    total, count = 0.0, 0
    try:
        for ex in examples:
            if gate == "on":
                loss, n = pair_loss(fuser, receiver_model, sharer_model, ex)
                total += float(loss) * n
            else:
                loss_sum, n = _alone_loss(receiver_model, ex)
                total += float(loss_sum)
            count += n
    finally:
        fuser.train(was_training)
    return {"loss": total / max(count, 1), "tokens": count, "examples": len(examples)}


# -------------------------------------------------------------------------- training

def step_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of the examples of ``step``: a pure function of ``(seed, step)``.

    Examples are visited epoch by epoch, epoch ``e`` in the permutation drawn from
    ``default_rng([seed, e])``; step ``s`` takes positions ``s*batch_size ..`` of that stream.
    """
    perms: dict[int, np.ndarray] = {}
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(k, n)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(int(perms[epoch][pos]))
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
) -> dict:
    """Train ``fuser`` for ``steps`` AdamW steps; both models stay frozen.

    Each step accumulates gradients over ``batch_size`` examples (batch size 1 each: the
    alignments differ), weighting each by its response tokens (the step loss is the mean
    CE per response token of the step), clips the fuser's gradient norm to
    ``max_grad_norm`` and steps AdamW on the fuser's parameters only. The Gumbel
    temperature anneals from the config's ``init_temperature`` (step 0) to
    ``min_temperature`` (the last step). During the run both models are in eval mode with
    ``requires_grad=False``; their previous flags and modes are restored at the end. The
    fuser is left in eval mode.

    Checkpoints (see the module docstring) go to ``checkpoint_dir`` every
    ``checkpoint_every`` steps (0: never) and after the last step. With ``resume=True`` the
    newest readable checkpoint there is loaded first; with ``resume=False`` existing
    checkpoint files there are deleted and training starts at step 0.

    Returns:
        ``{"steps", "first_loss", "last_loss", "mean_loss", "losses" (one per step, the
        resumed ones included), "seconds" (this call), "resumed_from" (step or None)}``.

    Raises:
        ValueError: no examples, ``steps < 1`` or ``batch_size < 1``; a checkpoint of
            another seed or batch size, or past ``steps``.
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
    if checkpoint_dir is not None and not resume:
        for _, old in _checkpoints(checkpoint_dir):
            old.unlink(missing_ok=True)
    if checkpoint_dir is not None and resume:
        state = _load_latest(checkpoint_dir)
        if state is not None:
            if (state["seed"], state["batch_size"]) != (seed, batch_size):
                raise ValueError(f"checkpoint in {checkpoint_dir} is from a run with seed={state['seed']}, "
                                 f"batch_size={state['batch_size']} (this run: {seed}, {batch_size}); "
                                 "use another checkpoint_dir or resume=False")
            if state["step"] > steps:
                raise ValueError(f"checkpoint in {checkpoint_dir} is at step {state['step']}, past steps={steps}")
            fuser.load_state_dict(state["fuser"])
            opt.load_state_dict(state["optimizer"])
            start = resumed_from = int(state["step"])
            losses = list(state["losses"])

    device = params[0].device
    rng_devices = [device] if device.type == "cuda" else []

    def checkpoint(step: int) -> None:
        _save_checkpoint(checkpoint_dir, {
            "format": CHECKPOINT_FORMAT, "step": step, "seed": seed, "batch_size": batch_size,
            "steps": steps, "lr": lr, "fuser_config": fuser.config.to_dict(),
            "fuser": fuser.state_dict(), "optimizer": opt.state_dict(), "losses": losses,
        }, keep_last)

    from tqdm.auto import tqdm

    bar = tqdm(range(start, steps), initial=start, total=steps, desc="fuser", unit="step",
               leave=False, disable=not progress)
    fuser.train()
    with frozen(receiver_model, sharer_model):
        try:
            for step in bar:
                tau = fuser.anneal(step, max(steps - 1, 1))
                batch = [examples[i] for i in step_indices(len(examples), batch_size, seed, step)]
                total = sum(ex.num_tokens for ex in batch)
                opt.zero_grad(set_to_none=True)
                step_loss = 0.0
                with torch.random.fork_rng(devices=rng_devices):
                    torch.manual_seed(_step_seed(seed, step))
                    for ex in batch:
                        loss, n = pair_loss(fuser, receiver_model, sharer_model, ex)
                        (loss * (n / max(total, 1))).backward()
                        step_loss += float(loss.detach()) * n / max(total, 1)
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                opt.step()
                losses.append(step_loss)
                bar.set_postfix(loss=f"{step_loss:.3f}", tau=f"{tau:.2f}")
                done = step + 1
                due = done == steps or (checkpoint_every > 0 and done % checkpoint_every == 0)
                if checkpoint_dir is not None and due:
                    checkpoint(done)
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
        "resumed_from": resumed_from,
    }


__all__ = [
    "PairExample", "build_pair_example", "build_pair_examples", "pair_loss", "evaluate_pair",
    "step_indices", "train_fuser", "frozen", "CHECKPOINT_FORMAT",
]
