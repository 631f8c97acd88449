"""Row padding (edgefuse.cloud.rows): the table chosen from measured costs, the fixed rule it
replaces, the calibration's on-disk cache, and a target that pads its forwards computing the
same answers as one that does not."""

from __future__ import annotations

import json

import pytest

from edgefuse.cloud import protocol as P
from edgefuse.cloud.rows import RowPadding, calibrate, check_row_padding, row_padding_for
from edgefuse.cloud.target import Target, pack_rows, tokenizer_fingerprint
from edgefuse.models import tiny_model


def test_each_count_is_padded_to_the_cheapest_measured_count_at_or_above():
    # a CPU-like step: 1-3 rows cost the same, 4-8 twice that, 16 less than 8
    costs = {1: 100.0, 2: 110.0, 3: 115.0, 4: 200.0, 8: 300.0, 16: 250.0}
    pad = RowPadding.from_costs(costs)
    by_hand = {1: 1, 2: 2, 3: 3, 4: 4, 5: 16, 6: 16, 7: 16, 8: 16, 9: 16, 15: 16, 16: 16, 17: 17, 40: 40}
    assert {n: pad.rows(n) for n in by_hand} == by_hand
    assert pad.summary()["pad_to"] == {n: 16 for n in range(5, 16)}
    # within the tolerance the fewer rows win: 2 rows at 103 ms are not worth padding 1 to
    assert RowPadding.from_costs({1: 100.0, 2: 103.0}).rows(1) == 1
    assert RowPadding.from_costs({1: 100.0, 2: 90.0}).rows(1) == 2
    # fed: 3 sessions of 2 new rows = 6 rows -> 16 -> each padded to 6 rows: 18 fed
    assert pad.fed(3, 2) == 18 and pad.fed(1, 4) == 4 and pad.fed(2, 1) == 2


def test_the_fixed_rule_is_the_old_min_block_rows():
    pad = RowPadding.minimum(4)
    assert [pad.rows(n) for n in range(1, 7)] == [1, 4, 4, 4, 5, 6]
    assert pad.fed(3, 1) == 6 and pad.fed(2, 1) == 4  # 3 rows -> 4 -> 2 per session
    assert RowPadding.coerce(4) == pad and RowPadding.coerce(None) == RowPadding.none()
    assert RowPadding.minimum(1).rows(2) == 2 and RowPadding.minimum(2).rows(2) == 2
    keys = ["a", "b", "c"]
    assert pack_rows(keys, [1, 1, 1], RowPadding.none(), 2) == [["a", "b"], ["c"]]
    assert pack_rows(keys, [1, 1, 1], RowPadding.from_costs({1: 1.0, 2: 9.0, 4: 2.0}), 2) == [["a"], ["b"], ["c"]]


@pytest.mark.parametrize("bad", [0, -3, "0", "x", "", True, 2.5, "auto-ish"])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="row_padding must be"):
        check_row_padding(bad)


def test_settings_and_tables_that_make_no_sense_are_refused():
    assert [check_row_padding(v) for v in ("AUTO", " none ", 4, "16")] == ["auto", "none", "4", "16"]
    with pytest.raises(ValueError, match="fewer than it has"):
        RowPadding((1, 1))
    for costs in ({}, {0: 1.0}, {1: 0.0}, {1: -5.0}):
        with pytest.raises(ValueError, match="row costs"):
            RowPadding.from_costs(costs)
    with pytest.raises(ValueError):
        RowPadding.coerce("4")


def test_calibration_is_measured_once_then_read_back_and_a_damaged_file_remeasured(tmp_path, caplog):
    model, _ = tiny_model("qwen2")
    rows = (1, 2, 3, 4)
    first = calibrate(model, "tiny-qwen2", cache_dir=tmp_path, context=8, rows=rows, repeats=1)
    assert first.source == "calibrated" and set(first.costs_ms) == set(rows)
    assert all(v > 0 for v in first.costs_ms.values())
    files = list((tmp_path / "rowcost").glob("tiny-qwen2-*.json"))
    assert len(files) == 1
    again = calibrate(model, "tiny-qwen2", cache_dir=tmp_path, context=8, rows=rows, repeats=1)
    assert again.source == "cached" and again.costs_ms == first.costs_ms and again.pad_to == first.pad_to
    # another setting (here the timed counts) is another key: measured anew, not mistaken
    other = calibrate(model, "tiny-qwen2", cache_dir=tmp_path, context=8, rows=(1, 2), repeats=1)
    assert other.source == "calibrated" and len(list((tmp_path / "rowcost").iterdir())) == 2
    files[0].write_text("{not json")
    with caplog.at_level("WARNING"):
        fixed = calibrate(model, "tiny-qwen2", cache_dir=tmp_path, context=8, rows=rows, repeats=1)
    assert fixed.source == "calibrated" and "unreadable" in caplog.text
    assert set(json.loads(files[0].read_text())["costs_ms"]) == {"1", "2", "3", "4"}
    assert row_padding_for("none", model, "tiny-qwen2") == RowPadding.none()
    assert row_padding_for(3, model, "tiny-qwen2") == RowPadding.minimum(3)


def test_a_padded_target_answers_as_an_unpadded_one_and_counts_the_pad_rows():
    model, tok = tiny_model("qwen2")
    fp = tokenizer_fingerprint(tok)
    pad = RowPadding.from_costs({1: 1.0, 2: 1.0, 3: 9.0, 4: 9.0, 8: 2.0})  # 3..8 rows -> 8
    prompts = [[5, 17, 33, 60, 91], [7, 8, 9], [40, 41, 42, 43]]
    drafts = [[12, 13, 14], [20, 21], [30]]
    got = {}
    shapes: list = []  # the rows each real forward was fed (batch x new ids)
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: shapes.append(kw["input_ids"].numel()), with_kwargs=True)
    for name, padding in (("padded", pad), ("plain", RowPadding.none())):
        t = Target(model, tok, "tiny-qwen2", max_context=256, row_padding=padding)
        sessions = [t.open(P.Open(p, fp, max_new=20)) for p in prompts]
        t.forward_tokens, f0 = 0, t.forwards
        shapes.clear()
        solo = t.step([(sessions[0], P.Verify(1, len(prompts[0]), drafts[0]))])  # 4 rows
        fed_solo = t.forward_tokens
        batch = t.step([(s, P.Verify(2, len(p) + 1 + r.accepted, [50, 51]))
                        for s, p, r in zip(sessions[1:], prompts[1:],
                                           t.step([(s, P.Verify(1, len(p), d))
                                                   for s, p, d in zip(sessions[1:], prompts[1:], drafts[1:])]))])
        got[name] = (solo, batch, [s.tokens for s in sessions], fed_solo, t.forward_tokens, t.forwards - f0)
        assert sum(shapes) == t.forward_tokens, name  # the count is what the model really ran
    hook.remove()
    padded, plain = got["padded"], got["plain"]
    assert padded[:3] == plain[:3]
    assert all(isinstance(r, P.Verified) for r in padded[0] + padded[1])
    assert plain[3] == 4 and padded[3] == 8  # one 4-row block, padded to 8
    # then two batches of 2 sessions fed as 2 x 3 rows (6; padded: 8, 4 each)
    assert plain[4] == 4 + 6 + 6 and padded[4] == 8 + 8 + 8
    assert padded[5] == plain[5] == 3
