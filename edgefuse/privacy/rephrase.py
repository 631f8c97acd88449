"""The device's own SLM rewords a prompt before it leaves the device.

Greedy decoding with a Hugging Face causal LM (transformers ``generate``); several prompts
go through one left-padded ``generate`` call. Placeholders such as ``<PERSON_1>`` (from
:mod:`edgefuse.privacy.redact`) must survive: the instruction asks the model to keep them
and the output is checked; a missing placeholder, an empty, unchanged or runaway output
makes the result fall back to the input text (``fell_back=True``, ``reason`` says why).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PLACEHOLDER = re.compile(r"<[A-Z][A-Z_]*_\d+>")

# Worded so that qwen2.5-coder-0.5b changes words at all (with "rephrase/paraphrase" and a
# system prompt it copied the input verbatim).
_INSTRUCTION = ("Reword this text using synonyms and keep its meaning (keep <...> placeholders "
                "such as <PERSON_1> unchanged), output only the new text:")
# "Sure, here is the rephrased text:", "Rephrased text:", "Here's a rewrite -" ...
_CHATTY = re.compile(
    r"^\s*(?:(?:sure|certainly|of course|okay|ok|absolutely)\b[^\n:]*?(?:[:\n]|[.!]\s+)\s*)?"
    r"(?:(?:here(?:'s| is| are)|below is)\b[^\n:]*[:\n]\s*)?"
    r"(?:(?:rephrased|rewritten|paraphrased|new)(?: text| version| sentence| prompt)?\s*:\s*)?",
    re.IGNORECASE)


@dataclass
class RephraseResult:
    """One rephrased prompt.

    Attributes:
        text: the rephrased text, or the input when the rephrasing fell back.
        fell_back: True when the model's output was rejected and ``text`` is the input.
        reason: why it fell back ("" when it did not): ``empty``, ``unchanged``,
            ``too long``, ``lost <PERSON_1>, ...``.
    """

    text: str
    fell_back: bool
    reason: str = ""


def build_prompt(tok, text: str) -> str:
    """The generation prompt for ``text``: the tokenizer's chat template when it has one
    (``tok.chat_template``), else a plain ``Rephrase ...`` completion prompt."""
    user = f"{_INSTRUCTION}\n{text}"
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": user}],
                                       add_generation_prompt=True, tokenize=False)
    return f"Rephrase the text. {user}\n\nRephrased text:\n"


def clean_output(raw: str) -> str:
    """Strip a chatty prefix ("Sure, here is ...:"), surrounding quotes and whitespace."""
    out = _CHATTY.sub("", raw.strip(), count=1).strip()
    if len(out) >= 2 and out[0] == out[-1] and out[0] in "\"'`":
        out = out[1:-1].strip()
    return out


def check(text: str, out: str) -> RephraseResult:
    """Accept ``out`` as the rephrasing of ``text``, or fall back to ``text``.

    Falls back when ``out`` is empty, equal to ``text`` (ignoring case and spacing),
    longer than 3x ``text`` (+20 characters), or misses a placeholder of ``text``.
    """
    def norm(s: str) -> str:
        return " ".join(s.lower().split())

    reason = ""
    if not out.strip():
        reason = "empty"
    elif norm(out) == norm(text):
        reason = "unchanged"
    elif len(out) > 3 * len(text) + 20:
        reason = "too long"
    else:
        lost = [p for p in dict.fromkeys(PLACEHOLDER.findall(text)) if p not in out]
        if lost:
            reason = "lost " + ", ".join(lost)
    return RephraseResult(text, True, reason) if reason else RephraseResult(out, False)


def rephrase_batch(model, tok, texts: list[str], max_new_tokens: int = 96,
                   batch_size: int = 8, attempts: int = 3, temperature: float = 0.8,
                   seed: int = 0) -> list[RephraseResult]:
    """Rephrase several prompts with the device SLM (left-padded batches).

    The first attempt is greedy; prompts whose output is rejected (:func:`check`: small
    models often copy the input) are tried again, up to ``attempts`` in all, sampling at
    ``temperature`` from a generator seeded by ``seed`` (deterministic for a seed).

    Args:
        model: a loaded Hugging Face causal LM (``edgefuse.models.load_model``).
        tok: its tokenizer; ``padding_side`` is set to ``left`` during the call and
            restored after; a missing pad token falls back to the EOS token.
        texts: prompts (may contain ``<TYPE_n>`` placeholders).
        max_new_tokens: generation budget per prompt.
        batch_size: prompts per ``generate`` call.
        attempts: generations per prompt at most (1 = greedy only).
        temperature: sampling temperature of the retries.
        seed: seed of the retries' sampling.

    Returns:
        one :class:`RephraseResult` per input, in order (see :func:`check`). Empty inputs
        are returned unchanged (fell_back=True, reason ``empty``) without generating.

    Library: transformers (``tokenizer.apply_chat_template``, ``model.generate``), torch.
    """
    import torch

    results: list[RephraseResult | None] = [None] * len(texts)
    todo = [i for i, t in enumerate(texts) if t.strip()]
    for i in set(range(len(texts))) - set(todo):
        results[i] = RephraseResult(texts[i], True, "empty")
    side, pad = tok.padding_side, tok.pad_token
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    try:
        device = next(model.parameters()).device
        for attempt in range(max(1, int(attempts))):
            sample = attempt > 0
            if sample:
                todo = [i for i in todo if results[i] is not None and results[i].fell_back]
                torch.manual_seed(int(seed) * 1000 + attempt)
            for b in range(0, len(todo), batch_size):
                idx = todo[b:b + batch_size]
                prompts = [build_prompt(tok, texts[i]) for i in idx]
                enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
                enc = {k: v.to(device) for k, v in enc.items()}
                kw = dict(do_sample=True, temperature=float(temperature), top_p=0.95) if sample else \
                    dict(do_sample=False)
                with torch.inference_mode():
                    out = model.generate(input_ids=enc["input_ids"],
                                         attention_mask=enc["attention_mask"],
                                         max_new_tokens=max_new_tokens,
                                         pad_token_id=tok.pad_token_id, **kw)
                new = out[:, enc["input_ids"].shape[1]:]
                for i, ids in zip(idx, new):
                    raw = tok.decode(ids, skip_special_tokens=True)
                    results[i] = check(texts[i], clean_output(raw))
    finally:
        tok.padding_side = side
        if pad is None:
            tok.pad_token = None
    return results  # type: ignore[return-value]


def rephrase(model, tok, text: str, max_new_tokens: int = 96) -> str:
    """Rephrase one prompt with the device SLM; returns the input when it falls back.

    See :func:`rephrase_batch` (args, library); use it to learn whether it fell back.
    """
    return rephrase_batch(model, tok, [text], max_new_tokens)[0].text
