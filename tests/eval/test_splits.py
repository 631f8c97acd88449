"""Tests for edgefuse.eval.splits: the public split cut into named, disjoint slices."""

import itertools
import json

import numpy as np
import pytest

from edgefuse import data
from edgefuse.eval.splits import SLICES, public_slices, slice_sizes

SIZES = dict(fuser_train=160, fuser_val=8, eval_per_category=10, attack_train=200, draft_corpus=None)


def dolly_cfg(mirror, **sizes):
    return dict(name="dolly", hub_id="databricks/databricks-dolly-15k", mirror=str(mirror),
                mirror_file="dolly/databricks-dolly-15k.jsonl", public_fraction=0.1,
                public_slices={**SIZES, **sizes})


def _norm(text):
    return " ".join(text.split())


def test_slices_disjoint_sized_and_seed_stable(mirror):
    cfg = dolly_cfg(mirror)
    sl = public_slices(cfg, 0)
    ds = data.load_dolly(cfg)
    public, _ = data.split_public(len(ds), 0.1, 0)
    assert len(public) == 1501
    # sizes as configured; eval: 10 rows of each of the 8 categories
    assert [len(sl.indices(n)) for n in ("fuser_train", "fuser_val", "eval", "attack_train")] == [160, 8, 80, 200]
    assert sl.categories == tuple(sorted(set(ds["category"]))) and len(sl.categories) == 8
    cats = np.asarray(ds["category"])
    assert {c: int((cats[sl.eval] == c).sum()) for c in sl.categories} == {c: 10 for c in sl.categories}
    # pairwise disjoint, by dataset row and by instruction text; all public rows
    texts = {n: {_norm(ds[int(i)]["instruction"]) for i in sl.indices(n)} for n in SLICES}
    for a, b in itertools.combinations(SLICES, 2):
        assert not set(sl.indices(a).tolist()) & set(sl.indices(b).tolist()), (a, b)
        assert not texts[a] & texts[b], (a, b)
    used = np.concatenate([sl.indices(n) for n in SLICES])
    assert set(used.tolist()) <= set(public.tolist())
    for n in SLICES:
        idx = sl.indices(n)
        assert idx.dtype == np.int64 and np.array_equal(idx, np.sort(idx))
    # draft_corpus=None: every public row no other slice holds, except repeated instructions
    rest = set(public.tolist()) - set(used.tolist())
    claimed = set().union(*(texts[n] for n in SLICES))
    assert all(_norm(ds[i]["instruction"]) in claimed for i in rest)
    assert len(sl.draft_corpus) == 1501 - 448 - len(rest) and len(rest) == 3
    # the rows of a slice are the dataset's rows
    assert sl.rows("fuser_val") == [dict(ds[int(i)]) for i in sl.fuser_val]
    # stable for a seed, different for another
    again, other = public_slices(cfg, 0), public_slices(cfg, 1)
    assert all(np.array_equal(sl.indices(n), again.indices(n)) for n in SLICES)
    assert not np.array_equal(sl.eval, other.eval)
    with pytest.raises(ValueError, match="unknown public slice"):
        sl.indices("test")


def test_slices_keep_the_earlier_row_choices(mirror):
    """fuser_train / fuser_val are the first public rows and eval the first rows per category
    after them: what `skip = examples + 8` chose before the slices existed."""
    ds = data.load_dolly(dolly_cfg(mirror))
    cats = np.asarray(ds["category"])
    for seed, n in ((0, 160), (3, 250), (1, 8)):
        sl = public_slices(dolly_cfg(mirror, fuser_train=n), seed)
        public, _ = data.split_public(len(ds), 0.1, seed)
        assert np.array_equal(sl.fuser_train, public[:n])
        assert np.array_equal(sl.fuser_val, public[n:n + 8])
        rest = public[n + 8:]
        before = np.sort(np.concatenate([rest[cats[rest] == c][:10] for c in sorted(set(cats))]))
        assert np.array_equal(sl.eval, before)


def test_draft_corpus_excludes_the_evaluation_rows(mirror):
    from edgefuse.cloud.devices import public_corpus
    from edgefuse.eval.queries import dolly_eval_queries
    from edgefuse.models import tiny_tokenizer

    cfg = dolly_cfg(mirror, draft_corpus=50)
    sl = public_slices(cfg, 0)
    assert len(sl.draft_corpus) == 50
    assert not set(sl.draft_corpus.tolist()) & set(sl.eval.tolist())
    tok = tiny_tokenizer()
    corpus = public_corpus(cfg, 0, tok)
    assert len(corpus) == 50
    joined = "\n".join(corpus)
    queries = dolly_eval_queries(cfg, 0, per_category=10)
    assert {int(q.qid.split("/")[1]) for q in queries} == set(sl.eval.tolist())
    assert not any(q.instruction.strip() in joined for q in queries)
    # and the corpus is exactly the slice's rows, formatted
    assert corpus == ["".join(data.format_example(r, tok)) for r in sl.rows("draft_corpus")]


def test_too_small_public_split_names_the_budget(mirror):
    with pytest.raises(ValueError) as e:
        public_slices(dolly_cfg(mirror) | {"public_fraction": 0.02}, 0)
    msg = str(e.value)
    assert "the public split has 300 rows" in msg and "data.public_slices asks for 448" in msg
    assert "fuser_train 160 + fuser_val 8 + eval 10 x 8 categories + attack_train 200" in msg
    assert "data.public_fraction" in msg
    # enough rows overall, too few of one category for the evaluation pool
    with pytest.raises(ValueError, match=r"category 'creative_writing' has \d+ public rows left .*"
                                         r"eval_per_category asks for 100"):
        public_slices(dolly_cfg(mirror, eval_per_category=100, attack_train=0), 0)
    # an explicit draft corpus larger than what is left
    with pytest.raises(ValueError, match="asks for 2448"):
        public_slices(dolly_cfg(mirror, draft_corpus=2000), 0)
    # 1053 fit the row count, but 3 rows repeat an instruction an earlier slice holds
    with pytest.raises(ValueError, match="asks for 1501.*only 1050 distinct rows left for draft_corpus"):
        public_slices(dolly_cfg(mirror, draft_corpus=1053), 0)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="data.public_slices is missing"):
        slice_sizes({"name": "dolly"})
    for key, bad in (("fuser_val", -1), ("attack_train", "ten"), ("eval_per_category", None),
                     ("fuser_train", True), ("draft_corpus", 2.5)):
        with pytest.raises(ValueError, match=f"data.public_slices.{key} must be an integer >= 0"):
            slice_sizes({"public_slices": {**SIZES, key: bad}})
    assert slice_sizes({"public_slices": SIZES}).draft_corpus is None


def test_repeated_instructions_stay_in_one_slice(tmp_path):
    """Hand-built data: a row whose instruction an earlier slice holds is skipped later."""
    rows = [{"instruction": f"q{i}", "context": "", "response": f"r{i}", "category": "ab"[i % 2]}
            for i in range(40)]
    public, _ = data.split_public(40, 0.5, seed=0)
    first = int(public[0])
    dup = int(public[3])  # would be fuser_val's row: same instruction as a fuser_train row
    rows[dup]["instruction"] = f"  q{first} "
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"name": "dolly", "hub_id": "x", "mirror": str(tmp_path), "mirror_file": "d.jsonl",
           "public_fraction": 0.5,
           "public_slices": dict(fuser_train=2, fuser_val=2, eval_per_category=1, attack_train=3,
                                 draft_corpus=None)}
    sl = public_slices(cfg, 0)
    p = public.tolist()
    assert sl.fuser_train.tolist() == sorted(p[:2])
    assert sl.fuser_val.tolist() == sorted([p[2], p[4]])  # p[3] repeats p[0]'s instruction
    assert dup not in np.concatenate([sl.indices(n) for n in SLICES]).tolist()
    rest = p[5:]
    cat = {i: rows[i]["category"] for i in range(40)}
    ev = [next(i for i in rest if cat[i] == c) for c in "ab"]
    assert sl.eval.tolist() == sorted(ev)
    rest = [i for i in rest if i not in ev]
    assert sl.attack_train.tolist() == sorted(rest[:3])
    assert sl.draft_corpus.tolist() == sorted(rest[3:])
