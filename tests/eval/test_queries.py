"""Tests for edgefuse.eval.queries: MMLU/Dolly evaluation queries, prompt split, scoring, ROUGE-L."""

import json

import numpy as np
import pytest
import torch

from edgefuse import data
from edgefuse.data import format_example, tokenize_example
from edgefuse.models import tiny_model, tiny_tokenizer
from edgefuse.c2c.fuser import copy_cache
from edgefuse.eval.queries import (
    Query, answer_text, choice_token_ids, dolly_eval_queries, greedy_decode, load_mmlu, prefill,
    prompt_split, query_example, rouge_l, score_choices, t2t_hint,
)
from edgefuse.c2c.examples import build_pair_example

ARCHS = ["llama", "qwen2", "gemma3_text"]


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_model(arch) for arch in ARCHS}


def dolly_cfg(mirror, **over):
    base = dict(name="dolly", hub_id="databricks/databricks-dolly-15k", mirror=str(mirror),
                mirror_file="dolly/databricks-dolly-15k.jsonl", partitioning="category",
                dirichlet_alpha=0.5, public_fraction=0.1, val_fraction=0.1,
                max_train_examples=2000, max_eval_examples=16, max_seq_len=128,
                public_slices=dict(fuser_train=200, fuser_val=8, eval_per_category=5,
                                   attack_train=20, draft_corpus=None))
    return {**base, **over}


def mmlu_query(question="What is 2 + 2?", choices=("3", "4", "5", "None"), answer=1):
    body = "\n".join([question] + [f"{L}. {c}" for L, c in zip("ABCD", choices)])
    return Query(qid="q0", kind="mmlu", instruction=body + "\nAnswer with the letter of the correct choice.",
                 context="", choices=list(choices), answer=answer, reference=None, category="math")


def dolly_query(context="The fox is quick and brown."):
    return Query(qid="dolly/7", kind="dolly", instruction="Describe the fox.", context=context,
                 choices=None, answer=None, reference="A quick brown fox.", category="closed_qa")


# ------------------------------------------------------------------------------ queries

def test_query_round_trips_through_json():
    for q in (mmlu_query(), dolly_query()):
        assert Query.from_dict(json.loads(json.dumps(q.to_dict()))) == q
    with pytest.raises(ValueError, match="unknown"):
        Query.from_dict({**mmlu_query().to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="kind"):
        Query(qid="x", kind="trivia", instruction="", context="", choices=None, answer=None,
              reference=None, category="")
    with pytest.raises(ValueError, match="answer"):
        mmlu_query(answer=4)


def test_load_mmlu_seeded_stratified(mirror):
    a = load_mmlu(mirror, 60, seed=0)
    assert len(a) == 60 and len({q.qid for q in a}) == 60
    assert [q.qid for q in load_mmlu(mirror, 60, seed=0)] == [q.qid for q in a]
    assert [q.qid for q in load_mmlu(mirror, 60, seed=1)] != [q.qid for q in a]
    # Round-robin: 60 draws over 57 subjects touch every subject, none more than twice.
    counts = {}
    for q in a:
        counts[q.category] = counts.get(q.category, 0) + 1
    assert len(counts) == 57 and max(counts.values()) == 2
    q = a[0]
    assert q.kind == "mmlu" and 0 <= q.answer <= 3 and len(q.choices) == 4
    assert q.instruction.endswith("\nAnswer with the letter of the correct choice.")
    assert all(f"\n{L}. {c}\n" in q.instruction for L, c in zip("ABCD", q.choices))


def test_load_mmlu_keeps_none_and_numeric_choices_as_text(mirror):
    # college_mathematics_test.csv: "...end in exactly 99 zeros?,None,One,Four,Five,3"
    qs = load_mmlu(mirror, 100, seed=0, subjects=["college_mathematics"])
    hit = [q for q in qs if "end in exactly 99 zeros" in q.instruction]
    assert len(hit) == 1
    assert hit[0].choices == ["None", "One", "Four", "Five"] and hit[0].answer == 3
    # abstract_algebra_test.csv row 0: "...over Q.",0,4,2,6,1 (numbers stay strings)
    alg = load_mmlu(mirror, 100, seed=0, subjects=["abstract_algebra"])
    first = next(q for q in alg if q.qid == "mmlu/test/abstract_algebra/0")
    assert first.choices == ["0", "4", "2", "6"] and first.answer == 1


def test_load_mmlu_errors(mirror, tmp_path):
    with pytest.raises(FileNotFoundError, match="data.mirror") as e:
        load_mmlu(tmp_path / "nowhere", 5, seed=0)
    assert str(tmp_path / "nowhere") in str(e.value)
    with pytest.raises(ValueError, match="abstract_algebra"):
        load_mmlu(mirror, 5, seed=0, subjects=["astrology"])
    with pytest.raises(ValueError, match="n must be"):
        load_mmlu(mirror, 0, seed=0)
    with pytest.raises(ValueError, match="only 100"):
        load_mmlu(mirror, 101, seed=0, subjects=["college_mathematics"])


def test_dolly_eval_queries_held_out(mirror):
    cfg, seed, k = dolly_cfg(mirror), 0, 5
    qs = dolly_eval_queries(cfg, seed, per_category=k)
    cats = sorted(set(data.load_dolly(cfg)["category"]))
    assert len(cats) == 8 and len(qs) == 8 * k
    assert [q.category for q in qs] == sorted(c for c in cats for _ in range(k))
    assert [q.qid for q in dolly_eval_queries(cfg, seed, k)] == [q.qid for q in qs]
    rows = [int(q.qid.split("/")[1]) for q in qs]
    public, fed = data.split_public(len(data.load_dolly(cfg)), cfg["public_fraction"], seed)
    skip = 200 + 8  # fuser_train + fuser_val
    assert set(rows) <= set(public[skip:].tolist())  # not among the fuser rows
    assert not set(rows) & set(fed.tolist())  # held by no client
    # the first k public rows of each category after the fuser rows, as before the slices
    cat_of = np.asarray(data.load_dolly(cfg)["category"])
    rest = public[skip:]
    assert rows == [int(r) for c in cats for r in rest[cat_of[rest] == c][:k]]
    ds = data.load_dolly(cfg)
    assert all(ds[r]["response"] == q.reference and ds[r]["category"] == q.category
               for r, q in zip(rows, qs))
    # fewer per category: a prefix of each category's rows
    two = dolly_eval_queries(cfg, seed, per_category=2)
    assert [q.qid for q in two] == [q.qid for i, q in enumerate(qs) if i % k < 2]
    # Nor in any client's train/val rows, by content.
    seen = {(q.instruction, q.context, q.reference) for q in qs}
    for pid in range(4):
        for split in data.client_split(cfg, pid, 4, seed):
            assert not seen & {(r["instruction"], r["context"], r["response"]) for r in split}
    with pytest.raises(ValueError, match=r"6 Dolly evaluation rows per category.*holds 5 "
                                         r"\(data.public_slices.eval_per_category\)"):
        dolly_eval_queries(cfg, seed, per_category=6)
    with pytest.raises(ValueError, match="per_category"):
        dolly_eval_queries(cfg, seed, per_category=0)


def test_t2t_hint_reaches_the_prompt():
    tok = tiny_tokenizer()
    q = dolly_query()
    h = t2t_hint(q, "  It is a fox. ")
    assert h.context == "The fox is quick and brown.\n\nA peer assistant answered:\nIt is a fox."
    assert q.context == "The fox is quick and brown."  # original untouched
    prompt, _ = format_example(query_example(h), tok)
    assert "A peer assistant answered:\nIt is a fox." in prompt
    assert t2t_hint(mmlu_query(), "B").context == "A peer assistant answered:\nB"


# ------------------------------------------------------------------------------ prompts

@pytest.mark.parametrize("chat", [True, False])
def test_prompt_split_concatenates_to_the_prompt(chat):
    tok = tiny_tokenizer(chat_template=chat)
    q = dolly_query()
    prompt, _ = format_example(query_example(q), tok)
    full = tok(prompt)["input_ids"]
    ids, last = prompt_split(q, tok, 10_000)
    assert ids + [last] == full
    short, last2 = prompt_split(q, tok, 12)  # left-truncated to 12 tokens, BOS kept
    kept = [i for i, lab in zip(*(tokenize_example(query_example(q), tok, 13)[k]
                                  for k in ("input_ids", "labels"))) if lab == -100]
    assert short + [last2] == kept and len(kept) == 12 and last2 == full[-1]
    if full[0] == tok.bos_token_id:
        assert short[0] == tok.bos_token_id
    with pytest.raises(ValueError, match=">= 2"):
        prompt_split(q, tok, 1)


def test_prompt_split_matches_build_pair_example():
    r_tok, s_tok = tiny_tokenizer(True), tiny_tokenizer(False)
    q = dolly_query()
    for max_prompt in (12, 10_000):
        ids, last = prompt_split(q, r_tok, max_prompt)
        ex = build_pair_example(query_example(q), r_tok, s_tok, max_prompt + 1)
        assert ex.receiver_prompt_ids == ids and ex.continuation_ids[0] == last


@pytest.mark.parametrize("chat", [True, False])
def test_choice_token_ids_tiny(chat):
    tok = tiny_tokenizer(chat_template=chat)
    ids = choice_token_ids(tok)
    assert ids == [tok.encode(L, add_special_tokens=False)[0] for L in "ABCD"]
    assert len(set(ids)) == 4


REAL_LETTER_IDS = {"smollm2-135m": [49, 50, 51, 52], "qwen2.5-coder-0.5b": [32, 33, 34, 35],
                   "gemma3-270m": [236776, 236799, 236780, 236796]}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(REAL_LETTER_IDS))
def test_choice_token_ids_real_tokenizers(name):
    """Bare-letter ids after ``<|im_start|>assistant\\n`` (SmolLM2, Qwen) or ``### Response:\\n``
    (Gemma); tokenizers only, from the model cache (fetched first if missing)."""
    from edgefuse.models import load_tokenizer

    tok = load_tokenizer(name)
    assert choice_token_ids(tok) == REAL_LETTER_IDS[name]


# ------------------------------------------------------------------------------ scoring

@pytest.mark.parametrize("arch", ARCHS)
def test_score_choices_equals_full_forward(models, arch):
    model, tok = models[arch]
    q = mmlu_query(question="The quick brown fox jumps over the lazy dog. Which animal is lazy?")
    ids, last = prompt_split(q, tok, 10_000)
    assert len(ids) > 16  # past the tiny Gemma 3 sliding window
    choice_ids = choice_token_ids(tok)
    cache = prefill(model, ids)
    pred, logp = score_choices(model, cache, last, choice_ids)
    with torch.no_grad():
        full = model(torch.tensor([ids + [last]])).logits[0, -1].float()
    want = torch.log_softmax(full, -1)[choice_ids]
    assert pred == int(torch.argmax(want))
    assert np.allclose(logp, want.numpy(), atol=1e-5)
    assert cache.get_seq_length() == len(ids)  # copy=True: the cache is reusable
    assert score_choices(model, cache, last, choice_ids) == (pred, logp)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_equals_generate(models, arch):
    model, tok = models[arch]
    q = dolly_query()
    ids, last = prompt_split(q, tok, 10_000)
    n = 12
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids + [last]]), attention_mask=torch.ones(1, len(ids) + 1, dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, len(ids) + 1:].tolist()
    if tok.eos_token_id in gen:
        gen = gen[:gen.index(tok.eos_token_id)]
    cache = prefill(model, ids)
    out = greedy_decode(model, copy_cache(cache), last, n, {tok.eos_token_id})
    assert out == gen and len(out) <= n
    assert cache.get_seq_length() == len(ids)  # decoding grew the copy only
    # Stopping at EOS: declare a token of the greedy output an EOS id; decoding stops before it.
    assert len(gen) >= 3
    stop = gen[2]
    assert greedy_decode(model, prefill(model, ids), last, n, {stop}) == gen[:gen.index(stop)]
    assert isinstance(answer_text(tok, out), str)


def test_answer_text_skips_specials_and_strips():
    tok = tiny_tokenizer()
    ids = tok.encode(" The fox ", add_special_tokens=False) + [tok.eos_token_id]
    assert answer_text(tok, ids) == "The fox"


def test_rouge_l_hand_checked():
    assert rouge_l("The cat sat on the mat.", "The cat sat on the mat.") == pytest.approx(1.0)
    assert rouge_l("alpha beta", "gamma delta") == 0.0
    # LCS of [the cat sat on the mat] and [the cat lay on a mat] is "the cat on mat": 4 of 6
    # tokens on each side, so P = R = F = 2/3.
    assert rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(2 / 3)
    # Unequal lengths: LCS "a b" = 2; P = 2/2, R = 2/4, F = 2PR / (P + R) = 2/3.
    assert rouge_l("a b", "a x b y") == pytest.approx(2 / 3)
    assert rouge_l("", "anything") == 0.0


def test_gsm8k_final_number():
    from edgefuse.eval.queries import gsm8k_final

    assert gsm8k_final("16 - 3 - 4 = 9 eggs.\n9 * 2 = $18\n#### 18") == "18"
    assert gsm8k_final("So the total is 1,234.50 dollars") == "1234.5"
    assert gsm8k_final("#### 3.0") == "3"
    assert gsm8k_final("She has -5 left, then 7.") == "7"
    assert gsm8k_final("no number here") is None


def test_load_gsm8k_seeded(mirror):
    from edgefuse.eval.queries import load_gsm8k

    a = load_gsm8k(mirror, 5, seed=0)
    assert [q.qid for q in a] == [q.qid for q in load_gsm8k(mirror, 5, seed=0)]
    assert len({q.qid for q in a}) == 5 and all(q.kind == "gsm8k" for q in a)
    assert all(q.reference and q.reference.lstrip("-").replace(".", "").isdigit() for q in a)
    assert all(q.instruction.endswith("#### <number>") for q in a)
    with pytest.raises(ValueError):
        load_gsm8k(mirror, 0, seed=0)
    with pytest.raises(FileNotFoundError, match="data.mirror"):
        load_gsm8k("/nonexistent", 1, seed=0)
