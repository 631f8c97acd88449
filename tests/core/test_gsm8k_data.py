"""edgefuse.data.load_gsm8k_split: GSM8K from the mirror or from the hub id, like Dolly."""

import json

import datasets
import pytest

from edgefuse import data


def test_from_the_mirror_folder(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}]
    (tmp_path / "gsm8k" / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    ds = data.load_gsm8k_split({"mirror": str(tmp_path)}, "train")
    assert [dict(r) for r in ds] == rows
    assert data.load_gsm8k_split({"mirror": str(tmp_path)}, "train") is ds  # cached per process
    with pytest.raises(FileNotFoundError, match=r"gsm8k/test.jsonl.*data.mirror"):
        data.load_gsm8k_split({"mirror": str(tmp_path)}, "test")
    with pytest.raises(ValueError, match="unknown GSM8K split 'dev': use one of train, test"):
        data.load_gsm8k_split({"mirror": str(tmp_path)}, "dev")


@pytest.mark.parametrize("mirror", [None, "hub", "null", ""])
def test_without_a_mirror_it_loads_the_hub_id(monkeypatch, mirror):
    calls = []
    fake = datasets.Dataset.from_dict({"question": ["q"], "answer": ["#### 1"]})

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return fake

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(data, "_CACHE", {})
    assert data.load_gsm8k_split({"mirror": mirror}, "test") is fake
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]


def test_an_unreachable_hub_is_one_clear_error(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("offline\n  (no route)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(data, "_CACHE", {})
    with pytest.raises(RuntimeError, match=r"could not load 'openai/gsm8k' \(split 'train'\) from the hub "
                                           r"\(ConnectionError: offline \(no route\)\).*data.mirror"):
        data.load_gsm8k_split({"mirror": "hub"}, "train")
