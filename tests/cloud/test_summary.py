"""edgefuse.cloud.devices.summarize: per-mode rows with n, 95 % intervals and the paired
difference from the cloud-only generations, hand-computed on a handful of records."""

import pytest

from edgefuse.cloud.decoding import DecodeResult
from edgefuse.cloud.devices import ROW_FIELDS, Record, agreement, summarize
from edgefuse.eval.queries import rouge_l


class Tok:
    """Decodes ids as their decimal strings, space-joined (enough for GSM8K's final number)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def rec(qid, kind, mode, tokens, text, reference, decode_s=1.0):
    return Record(qid, kind, mode, 0, DecodeResult(mode=mode, tokens=list(tokens), text=text,
                                                   decode_s=decode_s), reference)


def records():
    return [
        rec("g1", "gsm8k", "cloud", [4, 2], "4 2", "2"), rec("g2", "gsm8k", "cloud", [7], "7", "7"),
        rec("d1", "dolly", "cloud", [1, 2, 3], "the cat sat", "the cat sat"),
        rec("d2", "dolly", "cloud", [5, 6], "a dog", "the dog ran"),
        rec("g1", "gsm8k", "edge", [4, 3], "4 3", "2"), rec("g2", "gsm8k", "edge", [7], "7", "7"),
        rec("d1", "dolly", "edge", [1, 9, 3], "the cat", "the cat sat"),
        rec("d2", "dolly", "edge", [5, 6], "the dog ran", "the dog ran"),
    ]


def test_rows_carry_n_intervals_and_paired_difference_from_cloud():
    rows = {r["mode"]: r for r in summarize(records(), {"cloud": 2.0, "edge": 1.0}, Tok(), 80.0, 1,
                                            greedy=True)}
    assert set(ROW_FIELDS) <= set(rows["edge"])
    cloud, edge = rows["cloud"], rows["edge"]
    # GSM8K: the final number of "4 2" is 2 (right), of "7" is 7 (right); edge "4 3" -> 3 (wrong)
    assert (cloud["gsm8k_exact_match"], cloud["gsm8k_n"]) == (1.0, 2)
    assert (edge["gsm8k_exact_match"], edge["gsm8k_n"]) == (0.5, 2)
    assert edge["gsm8k_ci95_low"] < 0.5 < edge["gsm8k_ci95_high"]
    # agreement with the cloud's tokens, per generation, then the mean over the 4 prompts
    each = [agreement([4, 3], [4, 2]), 1.0, agreement([1, 9, 3], [1, 2, 3]), 1.0]
    assert edge["agreement_with_target"] == pytest.approx(sum(each) / 4) and edge["agreement_n"] == 4
    assert edge["identical_to_target"] is False and cloud["identical_to_target"] is True
    # ROUGE-L on the Dolly rows, and its difference from cloud on the same two prompts
    r_edge = [rouge_l("the cat", "the cat sat"), rouge_l("the dog ran", "the dog ran")]
    r_cloud = [rouge_l("the cat sat", "the cat sat"), rouge_l("a dog", "the dog ran")]
    assert edge["rouge_l"] == pytest.approx(sum(r_edge) / 2) and edge["rouge_l_n"] == 2
    assert edge["rouge_l_vs_cloud"] == pytest.approx((sum(r_edge) - sum(r_cloud)) / 2)
    assert edge["rouge_l_vs_cloud_n"] == 2
    assert edge["rouge_l_vs_cloud_ci95_low"] <= edge["rouge_l_vs_cloud"] <= edge["rouge_l_vs_cloud_ci95_high"]
    assert cloud["rouge_l_vs_cloud"] is None and cloud["rouge_l_vs_cloud_n"] == 0
