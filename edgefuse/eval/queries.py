"""Evaluation queries for Cache-to-Cache (C2C) and its baselines (no Flower, no training).

A receiver SLM answers each :class:`Query` three ways: alone, with a text-to-text hint
(T2T: a sharer's generated answer appended to the context, :func:`t2t_hint`), and from a
fused KV cache (C2C). This module holds the model-side pieces:

* queries: MMLU multiple choice (:func:`load_mmlu`) and held-out public Dolly rows
  (:func:`dolly_eval_queries`), JSON-able so they travel inside Flower ConfigRecords;
* prompts: each query becomes a Dolly-style row (:func:`query_example`) that
  :func:`edgefuse.data.format_example` and :func:`edgefuse.c2c.examples.build_pair_example` render
  for each model's own tokenizer; :func:`prompt_split` tokenizes it and splits off the
  last prompt token;
* scoring: :func:`prefill` the prompt but its last token, (optionally fuse the cache,)
  then :func:`score_choices` (MMLU: log-likelihood of the letters A-D at the next
  position) or :func:`greedy_decode` (Dolly: generation, scored by :func:`rouge_l`).

The last prompt token is fed after the (fused) cache, never prefilled, for the reason given
in :mod:`edgefuse.c2c.train`: the first answer token is predicted at its position, so it must
attend to the fused cache. Without fusion this is exactly a full forward pass.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from edgefuse.data import DATASETS, IGNORE_INDEX, format_example, mirror_dir, tokenize_example
from edgefuse.eval.splits import public_slices

from edgefuse.kvcache import fused_forward

LETTERS = ("A", "B", "C", "D")
MMLU_HUB_ID = "cais/mmlu"
MMLU_SPLITS = ("dev", "test")
_MMLU_COLUMNS = ("question", "choice0", "choice1", "choice2", "choice3", "answer")
_KINDS = ("mmlu", "dolly", "gsm8k")
GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_INSTRUCTION = "Solve the problem. End with the final answer as: #### <number>"
HINT_HEADER = "A peer assistant answered:"

# Loaded MMLU tables, keyed by (source, split, subjects): one load per process.
_MMLU_CACHE: dict[tuple, dict[str, list[dict]]] = {}
_ROUGE = None  # the ROUGE-L scorer, built on first use


# ------------------------------------------------------------------------------ queries

@dataclass
class Query:
    """One evaluation question.

    Attributes:
        qid: stable id (``mmlu/<split>/<subject>/<row>`` or ``dolly/<dataset row>``).
        kind: ``"mmlu"`` (multiple choice, scored by accuracy) or ``"dolly"`` (free text,
            scored by ROUGE-L).
        instruction: the user instruction (for MMLU: question, lettered choices, and the
            request to answer with a letter).
        context: extra context, possibly empty.
        choices: the four MMLU choice texts (``None`` for Dolly).
        answer: index of the correct MMLU choice, 0..3 (``None`` for Dolly).
        reference: the Dolly reference response (``None`` for MMLU).
        category: the MMLU subject or the Dolly category.
    """

    qid: str
    kind: str
    instruction: str
    context: str
    choices: list[str] | None
    answer: int | None
    reference: str | None
    category: str

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"Query.kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind == "mmlu":
            if self.choices is None or len(self.choices) != len(LETTERS):
                raise ValueError(f"MMLU query {self.qid} needs {len(LETTERS)} choices, got {self.choices!r}")
            if self.answer is not None and not 0 <= self.answer < len(LETTERS):
                raise ValueError(f"MMLU query {self.qid} has answer {self.answer}, expected 0..3")

    def to_dict(self) -> dict:
        """A JSON-able dict of all fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Query:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown or missing keys, or invalid values (see the class).
        """
        known = {f.name for f in fields(cls)}
        if set(d) != known:
            raise ValueError(f"Query dict keys differ from the fields: unknown {sorted(set(d) - known)}, "
                             f"missing {sorted(known - set(d))}")
        return cls(**d)


def mmlu_instruction(question: str, choices: list[str]) -> str:
    """The MMLU prompt text: the question, the lettered choices, and the answer instruction."""
    lines = [question.strip()] + [f"{L}. {c}" for L, c in zip(LETTERS, choices)]
    return "\n".join(lines + ["Answer with the letter of the correct choice."])


def _mmlu_from_mirror(mirror: str | Path, split: str, subjects: list[str] | None) -> dict[str, list[dict]]:
    import datasets

    folder = mirror_dir(mirror) / "mmlu" / split
    files = {p.name[:-len(f"_{split}.csv")]: p for p in sorted(folder.glob(f"*_{split}.csv"))}
    if not files:
        raise FileNotFoundError(
            f"no MMLU files {folder}/SUBJECT_{split}.csv (mirror={str(mirror)!r}). Point "
            f"data.mirror (the data mirror, e.g. ../shared/data) at the folder "
            f"holding mmlu/{split}/, or set it to hub to download {MMLU_HUB_ID!r} from the hub.")
    if subjects is not None:
        unknown = sorted(set(subjects) - set(files))
        if unknown:
            raise ValueError(f"unknown MMLU subjects {unknown}; valid ones include "
                             f"{', '.join(sorted(files)[:5])}, ... ({len(files)} in {folder})")
        files = {s: files[s] for s in sorted(set(subjects))}
    # Every column as a string (choices like "0" or "None" stay text), the answer an int.
    features = datasets.Features({c: datasets.Value("int64" if c == "answer" else "string")
                                  for c in _MMLU_COLUMNS})
    loaded = datasets.load_dataset("csv", data_files={s: str(p) for s, p in files.items()},
                                   features=features, keep_default_na=False)
    return {s: [dict(question=r["question"], choices=[r[f"choice{i}"] for i in range(4)],
                     answer=int(r["answer"])) for r in loaded[s]]
            for s in files}


def _mmlu_from_hub(split: str, subjects: list[str] | None) -> dict[str, list[dict]]:
    import datasets

    try:
        ds = datasets.load_dataset(MMLU_HUB_ID, "all", split=split)
    except Exception as e:  # offline, hub errors, unknown split: many types
        raise RuntimeError(
            f"could not load {MMLU_HUB_ID!r} (split {split!r}) from the hub: {type(e).__name__}: {e}. "
            f"Offline, set data.mirror to a data mirror holding mmlu/{split}/ "
            f"(e.g. ../shared/data).") from e
    table: dict[str, list[dict]] = {}
    for r in ds:
        table.setdefault(r["subject"], []).append(
            dict(question=r["question"], choices=list(r["choices"]), answer=int(r["answer"])))
    if subjects is not None:
        unknown = sorted(set(subjects) - set(table))
        if unknown:
            raise ValueError(f"unknown MMLU subjects {unknown}; valid ones include "
                             f"{', '.join(sorted(table)[:5])}, ... ({len(table)} subjects)")
        table = {s: table[s] for s in sorted(set(subjects))}
    return dict(sorted(table.items()))


def load_mmlu(mirror: str | Path | None, n: int, seed: int, split: str = "test",
              subjects: list[str] | None = None) -> list[Query]:
    """``n`` MMLU questions, drawn by ``seed`` and stratified round-robin across subjects.

    Reads ``<mirror>/mmlu/<split>/<subject>_<split>.csv`` (header
    ``question,choice0..choice3,answer``) with ``datasets``, every choice as a string
    (``keep_default_na=False``: a choice "None" or "NA" stays that text); with
    ``mirror=None`` (or ``"hub"``) loads the hub dataset ``cais/mmlu`` (config ``all``). Draw: a seeded
    generator shuffles the subject order and the rows of each subject; questions are then
    taken round-robin (the first row of every subject, then the second, ...) until ``n``.
    Each query's instruction is the question, ``A. ..`` to ``D. ..`` on their own lines,
    and "Answer with the letter of the correct choice."; the context is empty.

    Returns:
        ``n`` queries of kind ``mmlu`` in draw order, ``qid = mmlu/<split>/<subject>/<row>``.

    Raises:
        ValueError: ``n < 1``, ``split`` not dev/test, unknown subjects (the message names
            a few valid ones), or fewer than ``n`` questions available.
        FileNotFoundError: the mirror has no ``mmlu/<split>/`` files (the message names the
            path and the setting ``data.mirror``).
        RuntimeError: ``mirror=None`` and the hub could not be reached.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if split not in MMLU_SPLITS:
        raise ValueError(f"MMLU split must be one of {MMLU_SPLITS}, got {split!r}")
    folder = mirror_dir(mirror)
    key = ("hub" if folder is None else str(folder), split,
           None if subjects is None else tuple(sorted(set(subjects))))
    if key not in _MMLU_CACHE:
        _MMLU_CACHE[key] = (_mmlu_from_hub(split, subjects) if folder is None
                            else _mmlu_from_mirror(mirror, split, subjects))
    table = _MMLU_CACHE[key]
    total = sum(len(rows) for rows in table.values())
    if n > total:
        raise ValueError(f"asked for {n} MMLU questions, only {total} in split {split!r}")
    rng = np.random.default_rng(seed)
    names = sorted(table)
    order = [names[i] for i in rng.permutation(len(names))]
    perms = {s: rng.permutation(len(table[s])) for s in order}
    out: list[Query] = []
    rank = 0
    while len(out) < n:
        for s in order:
            if rank < len(perms[s]) and len(out) < n:
                row = int(perms[s][rank])
                r = table[s][row]
                out.append(Query(qid=f"mmlu/{split}/{s}/{row}", kind="mmlu",
                                 instruction=mmlu_instruction(r["question"], r["choices"]),
                                 context="", choices=list(r["choices"]), answer=r["answer"],
                                 reference=None, category=s))
        rank += 1
    return out


def gsm8k_final(text: str) -> str | None:
    """The final number of a GSM8K answer or a model's output: the number after the last
    ``####`` if there is one, else the last number in the text; commas, ``$`` and a
    trailing ``.0`` removed (``"1,234.0"`` → ``"1234"``). ``None`` when there is no number."""
    import re

    tail = text.rsplit("####", 1)[1] if "####" in text else text
    nums = re.findall(r"-?\$?\d[\d,]*(?:\.\d+)?", tail)
    if not nums:
        return None
    num = nums[0 if "####" in text else -1].replace(",", "").replace("$", "")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return num


def load_gsm8k(mirror: str | Path | None, n: int, seed: int, split: str = "test",
               full_answer: bool = False) -> list[Query]:
    """``n`` GSM8K questions drawn by ``seed`` (without replacement) from ``split``.

    Reads ``<mirror>/gsm8k/<split>.jsonl`` with ``datasets``; ``mirror=None`` (or ``"hub"``)
    loads the hub dataset ``openai/gsm8k`` (config ``main``). The instruction is the question plus
    :data:`GSM8K_INSTRUCTION`; ``reference`` is the gold final number (:func:`gsm8k_final`),
    or with ``full_answer`` the whole reference solution ending ``#### <number>``, its
    calculator annotations ``<<...>>`` removed (a response to score, e.g. by its NLL).

    Raises:
        ValueError: ``n < 1`` or more than the split holds.
        FileNotFoundError: the mirror has no ``gsm8k/<split>.jsonl`` (names ``data.mirror``).
        RuntimeError: ``mirror=None`` and the hub could not be reached.
    """
    import datasets

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if mirror_dir(mirror) is None:
        try:
            ds = datasets.load_dataset(GSM8K_HUB_ID, "main", split=split)
        except Exception as e:  # offline, hub errors, unknown split: many types
            raise RuntimeError(f"could not load {GSM8K_HUB_ID!r} (split {split!r}) from the hub: "
                               f"{type(e).__name__}: {' '.join(str(e).split())[:300]}. Offline, set "
                               "data.mirror to a data mirror "
                               f"holding gsm8k/{split}.jsonl (e.g. ../shared/data).") from e
    else:
        path = mirror_dir(mirror) / "gsm8k" / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"no GSM8K file {path} (mirror={str(mirror)!r}). Point data.mirror "
                                    "at the data mirror (e.g. ../shared/data), or set it to hub "
                                    f"to download {GSM8K_HUB_ID!r} from the hub.")
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    if n > len(ds):
        raise ValueError(f"asked for {n} GSM8K questions, split {split!r} has {len(ds)}")
    rows = np.random.default_rng(seed).permutation(len(ds))[:n]
    return [Query(qid=f"gsm8k/{split}/{int(i)}", kind="gsm8k",
                  instruction=f"{ds[int(i)]['question'].strip()}\n{GSM8K_INSTRUCTION}", context="",
                  choices=None, answer=None,
                  reference=(_GSM8K_CALC.sub("", ds[int(i)]["answer"]).strip() if full_answer
                             else gsm8k_final(ds[int(i)]["answer"])),
                  category="gsm8k") for i in rows]


_GSM8K_CALC = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations


def dolly_eval_queries(data_cfg, seed: int, per_category: int) -> list[Query]:
    """Held-out Dolly queries: the ``eval`` slice of the public split (rows no client holds,
    no fuser trains on, the draft head never counts; :func:`edgefuse.eval.splits.public_slices`).

    The first ``per_category`` rows (in dataset-row order) of every category of the slice.

    Returns:
        ``per_category * n_categories`` queries of kind ``dolly``, sorted by category then
        dataset row; ``qid = dolly/<dataset row>``, ``reference`` the Dolly response.

    Raises:
        ValueError: ``per_category < 1``, or more than ``data.public_slices.eval_per_category``
            (the slice's rows per category); see also :func:`edgefuse.eval.splits.public_slices`.
        FileNotFoundError: see :func:`edgefuse.data.load_dolly`.
    """
    sl = public_slices(data_cfg, seed)
    if not 1 <= per_category <= sl.sizes.eval_per_category:
        raise ValueError(f"asked for {per_category} Dolly evaluation rows per category, the eval slice "
                         f"holds {sl.sizes.eval_per_category} (data.public_slices.eval_per_category): "
                         "need 1 <= per_category <= that")
    label = DATASETS[data_cfg["name"]][1]
    rows = sl.eval.tolist()
    table = sl.dataset.select(rows)
    by_cat: dict[str, list[int]] = {}
    for pos, cat in enumerate(table[label]):
        by_cat.setdefault(cat, []).append(pos)
    out: list[Query] = []
    for cat in sl.categories:
        for pos in by_cat[cat][:per_category]:
            r = table[pos]
            out.append(Query(qid=f"dolly/{rows[pos]}", kind="dolly", instruction=r["instruction"],
                             context=r.get("context") or "", choices=None, answer=None,
                             reference=r["response"], category=cat))
    return out


def t2t_hint(query: Query, sharer_answer: str) -> Query:
    """A copy of ``query`` whose context ends with the sharer's answer (T2T baseline):
    ``"<context>\\n\\nA peer assistant answered:\\n<answer>"`` (no blank line when the
    context is empty)."""
    hint = f"{HINT_HEADER}\n{sharer_answer.strip()}"
    context = query.context.strip()
    return dataclasses.replace(query, context=f"{context}\n\n{hint}" if context else hint,
                               choices=None if query.choices is None else list(query.choices))


def query_example(query: Query) -> dict:
    """The Dolly-style row ``{"instruction", "context", "response": ""}`` of a query, for
    :func:`edgefuse.data.format_example` / :func:`edgefuse.c2c.examples.build_pair_example`."""
    return {"instruction": query.instruction, "context": query.context, "response": ""}


# ------------------------------------------------------------------------------ prompts

def prompt_split(query: Query, tok, max_prompt_tokens: int) -> tuple[list[int], int]:
    """Tokenize the query's prompt for ``tok`` and split off its last token.

    The prompt is rendered by :func:`edgefuse.data.format_example` and tokenized by
    :func:`edgefuse.data.tokenize_example` (special tokens as it adds them; a prompt over
    ``max_prompt_tokens`` loses tokens from its left, a leading BOS kept). It therefore
    equals the receiver side of ``build_pair_example(query_example(query), tok, sharer_tok,
    max_prompt_tokens + 1)``: ``receiver_prompt_ids`` and ``continuation_ids[0]``.

    Returns:
        ``(prefill_ids, last_id)``: all prompt tokens but the last (``len <=
        max_prompt_tokens - 1``), and the last prompt token.

    Raises:
        ValueError: ``max_prompt_tokens < 2`` or the prompt has fewer than 2 tokens.
    """
    if max_prompt_tokens < 2:
        raise ValueError(f"max_prompt_tokens must be >= 2, got {max_prompt_tokens}")
    # The empty response is just EOS: one token after a prompt of <= max_prompt_tokens.
    row = tokenize_example(query_example(query), tok, max_prompt_tokens + 1)
    ids = [i for i, label in zip(row["input_ids"], row["labels"]) if label == IGNORE_INDEX]
    if len(ids) < 2:
        raise ValueError(f"query {query.qid}: the prompt has {len(ids)} token(s), need >= 2")
    return ids[:-1], ids[-1]


def choice_token_ids(tok) -> list[int]:
    """The token id of each letter A-D as the model would emit it right after the prompt.

    For each letter, a sample prompt (rendered by :func:`edgefuse.data.format_example`,
    chat template or plain format) is tokenized with and without the letter appended; the
    letter must add exactly one token, equal to ``tok.encode(letter,
    add_special_tokens=False)`` (for SmolLM2/Qwen2.5 after ``<|im_start|>assistant\\n``,
    for Gemma after ``### Response:\\n``, the bare letter with no leading space).

    Returns:
        4 distinct token ids, for A, B, C, D.

    Raises:
        ValueError: a letter is not a single token there, or two letters share an id.
    """
    prompt, _ = format_example({"instruction": "Q?", "context": "", "response": ""}, tok)
    bos = tok.bos_token
    add_special = not (bos and prompt.startswith(bos))
    base = tok(prompt, add_special_tokens=add_special)["input_ids"]
    ids = []
    for letter in LETTERS:
        plain = tok.encode(letter, add_special_tokens=False)
        after = tok(prompt + letter, add_special_tokens=add_special)["input_ids"]
        if len(plain) != 1 or after[:len(base)] != base or after[len(base):] != plain:
            raise ValueError(f"{type(tok).__name__}: letter {letter!r} is not a single token after the "
                             f"prompt (alone: {plain}, after the prompt: {after[len(base) - 1:]})")
        ids.append(plain[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"{type(tok).__name__}: letters A-D share token ids {ids}")
    return ids


# ------------------------------------------------------------------------------ scoring

def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def prefill(model, ids: list[int]) -> DynamicCache:
    """The model's KV cache after the prompt ``ids`` (batch 1, ``len(ids)`` tokens), no grad.

    Only the cache is kept, so the output head runs for the last position only
    (``logits_to_keep=1``): for a 262k-token vocabulary (Gemma 3) the head over every
    prompt position costs more than the decoder layers.

    Raises:
        ValueError: ``ids`` is empty.
    """
    if not ids:
        raise ValueError("nothing to prefill: ids is empty")
    x = torch.tensor([ids], dtype=torch.long, device=_device(model))
    return model(input_ids=x, use_cache=True, logits_to_keep=1).cache


@torch.no_grad()
def score_choices(model, cache: DynamicCache, last_id: int, choice_ids: list[int]) -> tuple[int, list[float]]:
    """Multiple-choice scoring: feed ``last_id`` after the (possibly fused) prompt cache.

    Runs :func:`edgefuse.c2c.fuser.fused_forward` with ``copy=True``, so ``cache`` is unchanged
    and reusable. The log-softmax is over the full vocabulary (float32).

    Returns:
        ``(pred, logprobs)``: the index of the choice with the highest log-probability
        (first on ties) and the ``len(choice_ids)`` log-probabilities (nats).
    """
    x = torch.tensor([[last_id]], dtype=torch.long, device=_device(model))
    logits = fused_forward(model, cache, x, copy=True)[0, -1].float()
    logp = torch.log_softmax(logits, dim=-1)[list(choice_ids)]
    return int(torch.argmax(logp)), [float(v) for v in logp]


@torch.no_grad()
def greedy_decode(model, cache: DynamicCache, last_id: int, max_new_tokens: int,
                  eos_ids: set[int]) -> list[int]:
    """Greedy generation from a (possibly fused) prompt cache, feeding ``last_id`` first.

    The cache grows in place (pass a :func:`edgefuse.c2c.fuser.copy_cache` copy to keep it).
    Stops after ``max_new_tokens`` tokens or at the first token in ``eos_ids``.

    Returns:
        The generated ids (at most ``max_new_tokens``), without the EOS token.
    """
    out: list[int] = []
    device = _device(model)
    token = last_id
    for _ in range(max_new_tokens):
        logits = fused_forward(model, cache, torch.tensor([[token]], dtype=torch.long, device=device),
                               copy=False)
        token = int(torch.argmax(logits[0, -1]))
        if token in eos_ids:
            break
        out.append(token)
    return out


def answer_text(tok, ids: list[int]) -> str:
    """Decoded text of generated ``ids``, special tokens skipped, whitespace stripped."""
    return tok.decode(ids, skip_special_tokens=True).strip()


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure in [0, 1] (``rouge_score``, Porter stemming; lower-cased
    alphanumeric tokens). 0.0 when either side has no token."""
    global _ROUGE
    if _ROUGE is None:
        import logging

        from rouge_score import rouge_scorer

        before = list(logging.root.handlers)
        _ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
        # absl (under rouge_score) adds a root handler, which prints every Flower log twice.
        for h in logging.root.handlers[:]:
            if h not in before:
                logging.root.removeHandler(h)
    return float(_ROUGE.score(reference, prediction)["rougeL"].fmeasure)


__all__ = [
    "Query", "LETTERS", "load_mmlu", "dolly_eval_queries", "t2t_hint", "query_example",
    "prompt_split", "choice_token_ids", "prefill", "score_choices", "greedy_decode",
    "answer_text", "rouge_l",
]
