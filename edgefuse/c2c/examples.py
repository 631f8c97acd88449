"""C2C pair examples: one prompt tokenized for a (receiver ← sharer) pair, both sides aligned.

Shared by fuser training (:mod:`edgefuse.c2c.train`, :mod:`edgefuse.c2c.multi`) and the
query-time path (:mod:`edgefuse.c2c.peer`), so a device builds exactly what the fusers were
trained on without importing training code. Each model renders the row with its own
tokenizer (:func:`edgefuse.data.format_example`), truncated by the rule of
:func:`edgefuse.data.tokenize_parts`; the receiver prefills its prompt but the last token
(see :mod:`edgefuse.c2c.train` for why), and :mod:`edgefuse.c2c.align` maps every prefilled
receiver token to the sharer tokens holding the same characters of the user content.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgefuse.data import IGNORE_INDEX, tokenize_parts

from .align import align_formatted, align_spans


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
    tokenizer (chat template or plain format) and truncated by
    :func:`edgefuse.data.tokenize_parts` (the rule of :func:`edgefuse.data.tokenize_example`);
    the sharer's prompt is truncated by the same rule with its own response length. The
    alignment (see :func:`_content_mapping`) is then restricted to the kept tokens.

    Returns ``None`` when no response token survives, the receiver prompt has fewer than
    two tokens (nothing to prefill), the sharer prompt is empty, or no prefilled receiver
    token maps to any sharer token (nothing to fuse).
    """
    r = tokenize_parts(example, receiver_tok, max_seq_len)
    s = tokenize_parts(example, sharer_tok, max_seq_len)
    if not r.response_ids or len(r.kept) < 2 or not s.kept:
        return None
    mapping = _content_mapping(r.prompt, s.prompt, example, receiver_tok, sharer_tok)
    r_lead, r_trail = _special_offset(receiver_tok, r.prompt, r.add_special_tokens)
    s_lead, _ = _special_offset(sharer_tok, s.prompt, s.add_special_tokens)
    mapping = [[]] * r_lead + [[j + s_lead for j in m] for m in mapping] + [[]] * r_trail
    assert len(mapping) == len(r.prompt_ids), (len(mapping), len(r.prompt_ids))
    new_index = {orig: new for new, orig in enumerate(s.kept)}
    prefill = r.kept[:-1]
    mapping = [[new_index[j] for j in mapping[i] if j in new_index] for i in prefill]
    if not any(mapping):
        return None
    last = r.prompt_ids[r.kept[-1]]
    return PairExample(
        receiver_prompt_ids=[r.prompt_ids[i] for i in prefill],
        continuation_ids=[last] + r.response_ids,
        labels=[IGNORE_INDEX] + r.response_ids,
        sharer_prompt_ids=[s.prompt_ids[i] for i in s.kept],
        mapping=mapping,
    )


def build_pair_examples(rows, receiver_tok, sharer_tok, max_seq_len: int) -> list[PairExample]:
    """:func:`build_pair_example` on every row, dropping the unusable ones."""
    built = (build_pair_example(r, receiver_tok, sharer_tok, max_seq_len) for r in rows)
    return [ex for ex in built if ex is not None]


__all__ = ["PairExample", "build_pair_example", "build_pair_examples"]
