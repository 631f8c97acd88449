"""The C2C fusers' training data (edgefuse.eval.splits.fuser_training_rows) and its held-out
counterpart (heldout_rows): named sources, disjoint from every evaluation set, sized and
checked at compose time. Needs the data mirror (Dolly and GSM8K); skipped without it."""

import json

import numpy as np
import pytest

from edgefuse.app.phases import compose
from edgefuse.config import ConfigError
from edgefuse.eval import splits
from edgefuse.eval.splits import (TRAIN_SOURCES, check_training_data, fuser_training_rows, heldout_rows,
                                  public_slices)

DOLLY_KEYS = ("instruction", "context", "response", "category")
BOTH_ALL = "c2c.train.data=[{source:dolly_public,n:all},{source:gsm8k_train,n:all}]"
GSM8K_TRAIN_ROWS = 7473  # lines of gsm8k/train.jsonl in the mirror


def qnorm(text):
    return " ".join(text.casefold().split())


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def cfg_of(mirror):
    def make(experiment="full", *overrides):
        return compose(experiment, [f"data.mirror={mirror}", *overrides])
    return make


@pytest.mark.parametrize("experiment, n", [("full", 160), ("default", 12), ("tiny", 8), ("c2c", 250)])
def test_the_default_data_is_the_fuser_train_slice(cfg_of, experiment, n):
    """Every experiment trains on exactly the rows it trained on before the sources existed."""
    cfg = cfg_of(experiment)
    rows = fuser_training_rows(cfg, int(cfg.seed))
    sl = public_slices(cfg.data, int(cfg.seed))
    assert len(rows) == n == len(sl.fuser_train)
    assert [{k: r[k] for k in DOLLY_KEYS} for r in rows] == sl.rows("fuser_train")
    assert [r["row"] for r in rows] == sl.fuser_train.tolist()
    assert {r["source"] for r in rows} == {"dolly_public"}


def test_sources_are_disjoint_from_every_evaluation_set(cfg_of, mirror):
    cfg = cfg_of("full", BOTH_ALL)
    rows = fuser_training_rows(cfg, 0)
    sl = public_slices(cfg.data, 0)
    ds = sl.dataset
    dolly = [r for r in rows if r["source"] == "dolly_public"]
    gsm = [r for r in rows if r["source"] == "gsm8k_train"]
    # n: all takes every row left: the fuser_train rows, then the other public rows outside
    # fuser_val / eval / attack_train whose instruction none of those (nor an earlier row)
    # holds, in dataset-row order (computed here from the public split itself)
    held = np.concatenate([sl.fuser_val, sl.eval, sl.attack_train]).tolist()
    ws = lambda i: " ".join(ds[i]["instruction"].split())  # noqa: E731
    first = sl.fuser_train.tolist()
    seen = {ws(i) for i in held + first}
    expect = list(first)
    for i in sorted(set(_public_rows(cfg)) - set(held) - set(first)):
        if ws(i) not in seen:
            expect.append(i)
            seen.add(ws(i))
    assert [r["row"] for r in dolly] == expect and len(dolly) == 1209
    assert len(gsm) == GSM8K_TRAIN_ROWS
    # by row index: no evaluation, validation or attacker row
    assert not {r["row"] for r in dolly} & set(held)
    # by normalised text, against every evaluation set: the Dolly slices and GSM8K test
    train_text = {qnorm(r["instruction"]) for r in rows}
    gsm_test = [qnorm(r["question"]) for r in read_jsonl(mirror / "gsm8k" / "test.jsonl")]
    for name in ("fuser_val", "eval", "attack_train"):
        assert not train_text & {qnorm(ds[int(i)]["instruction"]) for i in sl.indices(name)}, name
    assert not train_text & set(gsm_test)
    for source in ("dolly_eval", "gsm8k_test"):
        held_rows = heldout_rows(cfg, source, None, 0)
        assert not train_text & {qnorm(r["instruction"]) for r in held_rows}, source
    # the GSM8K rows are the train file's rows in the Dolly shape
    train_file = read_jsonl(mirror / "gsm8k" / "train.jsonl")
    assert sorted(r["row"] for r in gsm) == list(range(GSM8K_TRAIN_ROWS))
    r = gsm[0]
    assert r == {"instruction": train_file[r["row"]]["question"].strip(), "context": "",
                 "response": train_file[r["row"]]["answer"].strip(), "category": "gsm8k",
                 "source": "gsm8k_train", "row": r["row"]}


def _public_rows(cfg):
    from edgefuse.data import load_dolly, split_public

    return split_public(len(load_dolly(cfg.data)), float(cfg.data.public_fraction), int(cfg.seed))[0].tolist()


def test_gsm8k_train_and_test_share_no_question_on_the_mirror(mirror):
    """Read from the files directly, not through the loader: GSM8K train ∩ test = ∅."""
    train = {qnorm(r["question"]) for r in read_jsonl(mirror / "gsm8k" / "train.jsonl")}
    test = {qnorm(r["question"]) for r in read_jsonl(mirror / "gsm8k" / "test.jsonl")}
    assert len(train) > 7000 and len(test) > 1300
    assert not train & test


def test_a_train_question_the_test_split_holds_is_dropped(tmp_path):
    """Disjoint by construction: a train question equal to a test one (up to case and
    whitespace) never trains a fuser, nor does a repeated train question."""
    (tmp_path / "gsm8k").mkdir()
    train = [{"question": f"How much is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(6)]
    test = [{"question": "What is 7 times 3?", "answer": "#### 21"}]
    train[2]["question"] = "  what IS 7\ttimes 3? "
    train[4]["question"] = train[1]["question"] + " "
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / "gsm8k" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"seed": 0, "data": {"mirror": str(tmp_path)},
           "c2c": {"train": {"data": [{"source": "gsm8k_train", "n": "all"}]}}}
    rows = fuser_training_rows(cfg, 0)
    kept = sorted(r["row"] for r in rows)
    assert len(kept) == 4 and {0, 3, 5} <= set(kept) and len({1, 4} & set(kept)) == 1  # 2: the test's
    with pytest.raises(ConfigError, match="n=5 rows, 4 are available"):
        fuser_training_rows({**cfg, "c2c": {"train": {"data": [{"source": "gsm8k_train", "n": 5}]}}}, 0)


def test_same_seed_same_rows_and_a_stable_interleave(cfg_of):
    mixed = "c2c.train.data=[{source:dolly_public,n:300},{source:gsm8k_train,n:200}]"
    cfg = cfg_of("full", mixed)
    a, b, other = fuser_training_rows(cfg, 0), fuser_training_rows(cfg, 0), fuser_training_rows(cfg, 1)
    assert a == b and len(a) == 500
    assert [r["row"] for r in a] != [r["row"] for r in other]
    # interleaved, not one source after the other ...
    first = [r["source"] for r in a[:100]]
    assert 20 < first.count("gsm8k_train") < 80
    # ... each source in its own order, and a smaller n a prefix of a larger one
    for source, n in (("dolly_public", 300), ("gsm8k_train", 200)):
        alone = fuser_training_rows(cfg_of("full", f"c2c.train.data=[{{source:{source},n:{n}}}]"), 0)
        assert [r for r in a if r["source"] == source] == alone
        smaller = fuser_training_rows(cfg_of("full", f"c2c.train.data=[{{source:{source},n:50}}]"), 0)
        assert smaller == alone[:50]
    # dolly_public beyond the fuser_train slice: the slice first, then the spare rows; the
    # evaluation rows stay where they were
    sl = public_slices(cfg.data, 0)
    dolly = [r["row"] for r in a if r["source"] == "dolly_public"]
    assert dolly[:160] == sl.fuser_train.tolist() and set(dolly[160:]) <= set(sl.spare.tolist())
    assert np.array_equal(sl.eval, public_slices(cfg_of("full").data, 0).eval)


@pytest.mark.parametrize("data, match", [
    ("[{source:dolly,n:10}]", r"source='dolly' is not a fuser training source: use one of "
                              r"dolly_public, gsm8k_train"),
    ("[{source:gsm8k_test,n:10}]", "is not a fuser training source"),
    ("[{source:dolly_public,n:-1}]", r"c2c.train.data\[0\].n must be an integer >= 0 or 'all', got -1"),
    ("[{source:dolly_public,n:some}]", r"\.n must be an integer >= 0 or 'all', got 'some'"),
    ("[{source:dolly_public,n:1.5}]", r"\.n must be an integer"),
    ("[{source:dolly_public,n:5000}]", r"dolly_public asks for n=5000 rows, 1209 are available.*"
                                       r"data.public_fraction"),
    ("[{source:gsm8k_train,n:7474}]", "gsm8k_train asks for n=7474 rows, 7473 are available"),
    ("[{source:dolly_public,n:0},{source:gsm8k_train,n:0}]", "asks for 0 rows in all"),
    ("[{source:dolly_public,n:1},{source:dolly_public,n:2}]", "listed twice"),
    ("[{source:dolly_public}]", r"must be \{source: <name>, n: <int >= 0 \| all>\}"),
    ("[]", "must be a non-empty list"),
])
def test_bad_training_data_is_refused_at_compose(mirror, data, match):
    with pytest.raises(ConfigError, match=match):
        compose("full", [f"data.mirror={mirror}", f"c2c.train.data={data}"])


def test_the_public_split_size_is_checked_at_compose(mirror):
    for bad in ("1.0", "-0.1", "ten"):
        with pytest.raises(ConfigError, match=r"data.public_fraction .* must be a number in \[0, 1\)"):
            compose("full", [f"data.mirror={mirror}", f"data.public_fraction={bad}"])
    with pytest.raises(ConfigError, match=r"data.public_slices.fuser_val must be an integer >= 0"):
        compose("full", [f"data.mirror={mirror}", "data.public_slices.fuser_val=-2"])
    # a smaller public split holds fewer rows: n: all follows it, a fixed n above it is refused
    small = compose("full", [f"data.mirror={mirror}", "data.public_fraction=0.05", BOTH_ALL])
    assert sum(r["source"] == "dolly_public" for r in fuser_training_rows(small, 0)) == 460  # of 751 public rows
    with pytest.raises(ConfigError, match="1000 rows, 460 are available"):
        compose("full", [f"data.mirror={mirror}", "data.public_fraction=0.05",
                         "c2c.train.data=[{source:dolly_public,n:1000}]"])
    # and one public split too small for its slices, at compose
    with pytest.raises(ConfigError, match="the public split has 300 rows"):
        compose("full", [f"data.mirror={mirror}", "data.public_fraction=0.02", BOTH_ALL])


def test_the_default_check_loads_no_data(cfg_of, monkeypatch):
    """The default main job gets no slower: its compose-time check draws no rows."""
    cfg = cfg_of("default")

    def boom(*a, **k):
        raise AssertionError("data loaded at compose")

    monkeypatch.setattr(splits, "public_slices", boom)
    monkeypatch.setattr(splits, "load_gsm8k_split", boom)
    check_training_data(cfg)
    with pytest.raises(AssertionError, match="data loaded"):  # and the guard above is live
        check_training_data(cfg_of("default", BOTH_ALL))


def test_heldout_rows(cfg_of):
    from edgefuse.eval.queries import GSM8K_INSTRUCTION, load_gsm8k

    cfg = cfg_of("full")
    sl = public_slices(cfg.data, 0)
    dolly = heldout_rows(cfg, "dolly_eval", None, 0)
    assert sorted(r["row"] for r in dolly) == sl.eval.tolist() and len(dolly) == 80
    assert [r["category"] for r in dolly[:8]] == list(sl.categories)  # round-robin: balanced prefixes
    assert {r["source"] for r in dolly} == {"dolly_eval"}
    assert heldout_rows(cfg, "dolly_public", 16, 0) == dolly[:16]  # a training name: its counterpart
    gsm = heldout_rows(cfg, "gsm8k_test", 12, 0)
    queries = load_gsm8k(cfg.data.mirror, 12, 0)  # the accuracy evaluation's questions
    assert [f"{r['instruction']}\n{GSM8K_INSTRUCTION}" for r in gsm] == [q.instruction for q in queries]
    assert all(r["response"].split("####")[-1].strip() == q.reference for r, q in zip(gsm, queries))
    assert heldout_rows(cfg, "gsm8k_train", 12, 0) == gsm
    assert len(heldout_rows(cfg, "gsm8k_test", "all", 0)) == 1319
    with pytest.raises(ConfigError, match="held-out dolly_eval asks for n=81 rows, 80 are available.*"
                                          "eval_per_category"):
        heldout_rows(cfg, "dolly_eval", 81, 0)
    with pytest.raises(ConfigError, match="unknown held-out source 'mmlu': use one of dolly_eval, "
                                          "gsm8k_test, dolly_public, gsm8k_train"):
        heldout_rows(cfg, "mmlu", 5, 0)
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        heldout_rows(cfg, "gsm8k_test", 0, 0)


def test_the_fuser_service_trains_on_the_sources(cfg_of, tmp_path):
    from edgefuse.c2c.hub import FuserService
    from edgefuse.c2c.registry import FuserRegistry

    cfg = cfg_of("tiny", "c2c.train.data=[{source:dolly_public,n:20},{source:gsm8k_train,n:10}]")
    svc = FuserService(cfg, FuserRegistry(tmp_path))
    rows = svc.public("fuser_train")
    assert rows == fuser_training_rows(cfg, int(cfg.seed)) and len(rows) == 30
    assert svc.public("fuser_val") == public_slices(cfg.data, int(cfg.seed)).rows("fuser_val")
    assert set(TRAIN_SOURCES) == {r["source"] for r in rows}
