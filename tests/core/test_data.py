"""Tests for edgefuse.data: loading the Dolly mirror, partitions, prompts, batching."""

import itertools
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from edgefuse import data
from edgefuse.models import tiny_tokenizer

MIRROR = Path(os.environ.get("EDGEFUSE_DATA_MIRROR") or Path(__file__).parents[3] / "shared" / "data")
DOLLY_COUNTS = {"open_qa": 3742, "general_qa": 2191, "classification": 2136, "closed_qa": 1773,
                "brainstorming": 1766, "information_extraction": 1506, "summarization": 1188,
                "creative_writing": 709}
needs_mirror = pytest.mark.skipif(
    not (MIRROR / "dolly" / "databricks-dolly-15k.jsonl").is_file(),
    reason=f"offline data mirror not found at {MIRROR} (set EDGEFUSE_DATA_MIRROR)")


def cfg(**over):
    base = dict(name="dolly", hub_id="databricks/databricks-dolly-15k", mirror=str(MIRROR),
                mirror_file="dolly/databricks-dolly-15k.jsonl", partitioning="category",
                dirichlet_alpha=0.5, public_fraction=0.1, val_fraction=0.1,
                max_train_examples=2000, max_eval_examples=32, max_seq_len=256)
    return {**base, **over}


@pytest.fixture(scope="module")
def categories():
    if not (MIRROR / "dolly" / "databricks-dolly-15k.jsonl").is_file():
        pytest.skip(f"offline data mirror not found at {MIRROR} (set EDGEFUSE_DATA_MIRROR)")
    return data.load_dolly(cfg())["category"]


# ------------------------------------------------------------------------------ loading

@needs_mirror
def test_load_dolly_rows_and_categories():
    ds = data.load_dolly(cfg())
    assert len(ds) == 15011
    assert set(ds.column_names) >= {"instruction", "context", "response", "category"}
    assert Counter(ds["category"]) == DOLLY_COUNTS
    assert data.load_dolly(cfg()) is ds  # cached: loaded once per process


def test_missing_mirror_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.mirror") as e:
        data.load_dolly(cfg(mirror=str(tmp_path / "nowhere")))
    assert "EDGEFUSE_DATA_MIRROR" in str(e.value)
    assert str(tmp_path / "nowhere") in str(e.value)


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="dolly"):
        data.load_dolly(cfg(name="alpaca"))


# ------------------------------------------------------------------------- partitioning

def test_split_public_cover_and_determinism():
    pub, fed = data.split_public(1000, 0.1, seed=0)
    assert len(pub) == 100 and len(fed) == 900
    assert np.array_equal(np.sort(np.concatenate([pub, fed])), np.arange(1000))
    pub2, _ = data.split_public(1000, 0.1, seed=0)
    pub3, _ = data.split_public(1000, 0.1, seed=1)
    assert np.array_equal(pub, pub2) and not np.array_equal(pub, pub3)
    with pytest.raises(ValueError):
        data.split_public(10, 1.0, seed=0)


def _exact_cover(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))


@needs_mirror
@pytest.mark.parametrize("num_partitions", [1, 3, 4, 8])
def test_category_partition_whole_categories(categories, num_partitions):
    pub, fed = data.split_public(len(categories), 0.1, seed=0)
    cats = np.asarray(categories)[fed]
    parts = data.partition_by_category(cats, num_partitions, seed=0)
    assert len(parts) == num_partitions
    assert _exact_cover(parts, len(fed))
    # public + all partitions (mapped back to dataset rows) = every row exactly once
    rows = np.concatenate([pub] + [fed[p] for p in parts])
    assert np.array_equal(np.sort(rows), np.arange(len(categories)))
    held = [set(cats[p]) for p in parts]
    assert all(held)  # each partition has at least one category
    for a, b in itertools.combinations(held, 2):
        assert not a & b
    assert set().union(*held) == set(DOLLY_COUNTS)
    # whole categories: a partition holds every federated example of its categories
    for p, h in zip(parts, held):
        assert len(p) == sum((cats == c).sum() for c in h)


@needs_mirror
def test_category_partition_more_partitions_than_categories(categories):
    cats = np.asarray(categories)
    parts = data.partition_by_category(cats, 10, seed=0)
    assert _exact_cover(parts, len(cats))
    assert all(len(p) > 0 for p in parts)
    assert all(len(set(cats[p])) == 1 for p in parts)  # still one category per client
    # 10 partitions over 8 categories: two categories are shared by two clients each
    per_cat = Counter(cats[p][0] for p in parts)
    assert sorted(per_cat.values()) == [1] * 6 + [2] * 2


@needs_mirror
def test_partitions_deterministic(categories):
    cats = np.asarray(categories)
    for fn in (lambda s: data.partition_by_category(cats, 4, s),
               lambda s: data.partition_dirichlet(cats, 4, 0.5, s)):
        a, b, c = fn(0), fn(0), fn(1)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def _mean_max_share(cats, parts):
    return np.mean([Counter(cats[p]).most_common(1)[0][1] / len(p) for p in parts])


@needs_mirror
def test_dirichlet_cover_min_size_and_skew(categories):
    cats = np.asarray(categories)
    skewed = data.partition_dirichlet(cats, 10, alpha=0.1, seed=0, min_size=20)
    flat = data.partition_dirichlet(cats, 10, alpha=100.0, seed=0, min_size=20)
    for parts in (skewed, flat):
        assert len(parts) == 10 and _exact_cover(parts, len(cats))
        assert min(len(p) for p in parts) >= 20
    # IID share of the biggest category (open_qa) is 3742/15011 ≈ 0.25
    assert _mean_max_share(cats, flat) < 0.3
    assert _mean_max_share(cats, skewed) > 0.6


def test_dirichlet_impossible_min_size_raises():
    cats = ["a"] * 5 + ["b"] * 5
    with pytest.raises(RuntimeError, match="tries"):
        data.partition_dirichlet(cats, 4, alpha=0.5, seed=0, min_size=5)
    with pytest.raises(ValueError, match="alpha"):
        data.partition_dirichlet(cats, 4, alpha=0.0, seed=0)
    with pytest.raises(ValueError, match="11 partitions for 10 examples"):
        data.partition_dirichlet(cats, 11, alpha=0.5, seed=0)


def test_dirichlet_is_flwr_datasets_partitioner():
    """The partitions are DirichletPartitioner's on the seeded row order (every row of a
    category goes to exactly one partition; the per-category shares sum to 1)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    cats = np.array(["a"] * 30 + ["b"] * 20 + ["c"] * 10)
    got = data.partition_dirichlet(cats, 3, alpha=0.5, seed=7, min_size=2)
    order = np.random.default_rng([7, 1]).permutation(len(cats))
    ref = DirichletPartitioner(num_partitions=3, partition_by="category", alpha=0.5, min_partition_size=2,
                               self_balancing=False, shuffle=False, seed=7)
    ref.dataset = Dataset.from_dict({"category": cats[order].tolist(), "row": order.tolist()})
    want = [sorted(ref.load_partition(p)["row"][:]) for p in range(3)]
    assert [p.tolist() for p in got] == want
    assert min(len(p) for p in got) >= 2 and _exact_cover(got, len(cats))
    for c in "abc":
        shares = [int((cats[p] == c).sum()) / int((cats == c).sum()) for p in got]
        assert sum(shares) == pytest.approx(1.0)


def test_categories_come_from_natural_id_partitioning():
    """_by_category is flwr-datasets' NaturalIdPartitioner partitioning: one partition per
    category, sorted, each holding that category's rows in order."""
    from datasets import Dataset
    from flwr_datasets.partitioner import NaturalIdPartitioner

    cats = list("cabbacxac")
    ref = NaturalIdPartitioner(partition_by="category")
    ref.dataset = Dataset.from_dict({"category": cats, "row": list(range(len(cats)))})
    want = {ref.partition_id_to_natural_id[p]: ref.load_partition(p)["row"][:] for p in range(ref.num_partitions)}
    got = data._by_category(cats)
    assert list(got) == ["a", "b", "c", "x"] == sorted(want)
    assert {c: v.tolist() for c, v in got.items()} == want == {"a": [1, 4, 7], "b": [2, 3], "c": [0, 5, 8], "x": [6]}


@needs_mirror
@pytest.mark.parametrize("num_partitions, sizes, digest", [
    (3, [6862, 4406, 2242], "d7094f8d7554ad77"),
    (4, [2974, 3568, 2559, 4409], "c70ab95e5ae35753"),
    (10, [803, 982, 638, 3336, 1369, 1604, 1921, 1073, 802, 982], "82030e44c028ae25"),
])
def test_category_partitions_as_before_flwr_datasets(categories, num_partitions, sizes, digest):
    """The federated run's category partitions are the rows they were before the
    partitioning went through flwr-datasets (sizes and sha256 recorded then, seed 0)."""
    import hashlib

    _, fed = data.split_public(len(categories), 0.1, seed=0)
    parts = data.partition_by_category(np.asarray(categories)[fed], num_partitions, seed=0)
    assert [len(p) for p in parts] == sizes
    assert hashlib.sha256(b"".join(p.tobytes() for p in parts)).hexdigest()[:16] == digest


@needs_mirror
def test_client_split_sizes_and_caps(categories):
    c = cfg(max_train_examples=None, max_eval_examples=None)
    pub, fed = data.split_public(len(categories), 0.1, seed=3)
    parts = data.partition_by_category(np.asarray(categories)[fed], 4, seed=3)
    for pid in range(4):
        n = len(parts[pid])
        train, val = data.client_split(c, pid, 4, seed=3)
        assert len(val) == round(0.1 * n) and len(train) + len(val) == n
        want = Counter(np.asarray(categories)[fed[parts[pid]]])
        assert Counter(train["category"]) + Counter(val["category"]) == want
    train, val = data.client_split(cfg(max_train_examples=50, max_eval_examples=7), 0, 4, seed=3)
    assert (len(train), len(val)) == (50, 7)
    train, val = data.client_split(cfg(partitioning="dirichlet", val_fraction=0.0), 1, 4, seed=3)
    assert len(val) == 1 and len(train) == 2000  # val is at least one example
    assert len(data.public_split(cfg(), seed=3)) == round(0.1 * 15011)


@needs_mirror
def test_client_split_errors():
    for pid in (-1, 4):
        with pytest.raises(ValueError, match="partition_id"):
            data.client_split(cfg(), pid, 4, seed=0)
    with pytest.raises(ValueError, match="dirichlet"):
        data.client_split(cfg(partitioning="iid"), 0, 4, seed=0)


# ----------------------------------------------------------------- prompts and tokens

EX = {"instruction": "Answer the question.", "context": "The fox is quick.",
      "response": "The fox is quick!", "category": "closed_qa"}


def _split_at_labels(row):
    n_prompt = sum(1 for l in row["labels"] if l == -100)
    assert all(l == -100 for l in row["labels"][:n_prompt])  # prompt is a prefix
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert row["attention_mask"] == [1] * len(row["input_ids"])
    return n_prompt


def test_plain_template_when_no_chat_template():
    tok = tiny_tokenizer(chat_template=False)
    prompt, resp = data.format_example(EX, tok)
    assert prompt == ("### Instruction:\nAnswer the question.\n\n### Context:\nThe fox is quick."
                      "\n\n### Response:\n")
    assert resp == "The fox is quick!<eos>"
    prompt, _ = data.format_example({**EX, "context": ""}, tok)
    assert "### Context" not in prompt
    row = data.tokenize_example(EX, tok, 256)
    n = _split_at_labels(row)
    assert tok.decode(row["input_ids"][:n]).endswith("### Response:\n")
    assert tok.decode(row["input_ids"][n:]) == "The fox is quick!<eos>"


def test_chat_template_used():
    tok = tiny_tokenizer(chat_template=True)
    prompt, resp = data.format_example(EX, tok)
    assert prompt == "<|user|>Answer the question.\n\nThe fox is quick.<|end|><|assistant|>"
    assert resp == "The fox is quick!<eos>"
    row = data.tokenize_example(EX, tok, 256)
    n = _split_at_labels(row)
    assert row["input_ids"][:n] == tok(prompt)["input_ids"]
    labelled = [l for l in row["labels"] if l != -100]
    assert tok.decode(labelled) == "The fox is quick!<eos>"


def _bos_tokenizer(chat_template):
    """tiny_tokenizer that prepends <bos> like Gemma's / Llama's tokenizers."""
    from tokenizers.processors import TemplateProcessing

    tok = tiny_tokenizer(chat_template=chat_template)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    return tok


def test_bos_added_once():
    tok = _bos_tokenizer(chat_template=False)
    row = data.tokenize_example(EX, tok, 256)
    assert row["input_ids"][0] == tok.bos_token_id and row["labels"][0] == -100
    assert row["input_ids"].count(tok.bos_token_id) == 1  # not on the response
    # a chat template that writes the BOS itself (Gemma-it) must not get a second one
    tok = _bos_tokenizer(chat_template=True)
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    row = data.tokenize_example(EX, tok, 256)
    assert row["input_ids"].count(tok.bos_token_id) == 1 and row["input_ids"][0] == tok.bos_token_id


def test_truncation_keeps_response():
    tok = _bos_tokenizer(chat_template=False)
    long_ctx = {**EX, "context": "The quick brown fox jumps over the lazy dog. " * 40}
    row = data.tokenize_example(long_ctx, tok, 64)
    n = _split_at_labels(row)
    assert len(row["input_ids"]) == 64
    assert tok.decode(row["input_ids"][n:]) == "The fox is quick!<eos>"  # whole response kept
    assert row["input_ids"][0] == tok.bos_token_id  # BOS survives left truncation
    assert tok.decode(row["input_ids"][:n]).endswith("### Response:\n")
    # long prompt and long response: prompt cut to max_seq_len // 2, response cut on the right
    both = {**long_ctx, "response": "Federated learning trains a model. " * 40}
    row = data.tokenize_example(both, tok, 64)
    n = _split_at_labels(row)
    assert len(row["input_ids"]) == 64 and n == 32
    assert tok.decode(row["input_ids"][n:]).startswith("Federated learning")


def test_tokenize_dataset_drops_rows_without_response():
    tok = tiny_tokenizer(chat_template=False)
    # max_seq_len=1: the prompt is cut to 0 tokens, the single slot is a response token
    rows = data.tokenize_dataset([EX, EX], tok, 1)
    assert len(rows) == 2 and all(r["labels"][0] != -100 for r in rows)
    bos_tok = _bos_tokenizer(chat_template=False)
    assert data.tokenize_dataset([EX], bos_tok, 1) == []  # only the BOS fits: dropped
    assert len(data.tokenize_dataset([EX], bos_tok, 64)) == 1


def test_collate_pads():
    rows = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
            {"input_ids": [8], "attention_mask": [1], "labels": [8]}]
    out = data.collate(rows, pad_id=0)
    assert out["input_ids"].dtype == torch.long and out["input_ids"].shape == (2, 3)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_batches_endless_seeded():
    rows = [{"i": i} for i in range(10)]
    take = lambda seed, r: [[x["i"] for x in b] for b in itertools.islice(data.batches(rows, 4, seed, r), 5)]
    a = take(0, 0)
    assert all(len(b) == 4 for b in a)  # endless: 20 rows from 10
    flat = sum(a, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # reshuffled each epoch
    assert take(0, 0) == a and take(0, 1) != a and take(1, 0) != a
