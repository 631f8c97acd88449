"""Pair examples (edgefuse.c2c.examples) and fuser training (edgefuse.c2c.train): the loss,
training, checkpoints and resume.

Tiny random-weight models: receiver tiny-llama (3 layers) with sharer tiny-qwen2 (2 layers),
which share the tiny tokenizer and chat template (alignment one-to-one), and sharer
tiny-gemma3 (6 layers, no chat template: a different prompt format).
"""

import shutil

import pytest
import torch
import torch.nn.functional as F

from edgefuse.data import IGNORE_INDEX, format_example, tokenize_example
from edgefuse.models import tiny_model
from edgefuse.c2c import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.examples import PairExample, build_pair_example, build_pair_examples
from edgefuse.c2c.train import evaluate_pair, pair_loss, step_indices, train_fuser
from tests.c2c.heldout import TRAIN_ROWS, VAL_ROWS

ROWS = [
    {"instruction": "Answer the question.", "context": "The quick brown fox.", "response": "The lazy dog."},
    {"instruction": "What trains a model?", "context": "", "response": "Federated learning."},
    {"instruction": "Answer the question.", "context": "Devices share their data.", "response": "No, without sharing."},
    {"instruction": "What jumps over the dog?", "context": "The quick brown fox jumps.", "response": "The fox."},
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def models():
    """{name: (model, tokenizer)}; the models keep requires_grad=True as loaded."""
    return {"llama": tiny_model("llama", seed=0, tokenizer="bpe"), "qwen2": tiny_model("qwen2", seed=1),
            "gemma3_text": tiny_model("gemma3_text", seed=2, tokenizer="bpe")}  # one tokenizer: the hand-checked ids


def make_fuser(recv, share, seed=0, gate=None, randomize=False):
    torch.manual_seed(seed)
    fuser = C2CFuser(kv_spec_from_config(recv.config), kv_spec_from_config(share.config),
                     FuserConfig(bottleneck=16))
    with torch.no_grad():
        for layer in fuser.layers.values():
            for branch in (layer.key, layer.value):
                if randomize:
                    branch.up.weight.normal_(0, 0.5)
                    branch.up.bias.normal_(0, 0.5)
                if gate is not None:
                    branch.gate_logit.fill_(gate)
    return fuser


def plain_loss(model, tok, row, max_seq_len=256):
    """Receiver-alone CE per response token: one plain forward over prompt + response."""
    t = tokenize_example(row, tok, max_seq_len)
    with torch.no_grad():
        logits = model(torch.tensor([t["input_ids"]])).logits
    labels = torch.tensor(t["labels"][1:])
    return float(F.cross_entropy(logits[0, :-1], labels, ignore_index=IGNORE_INDEX)), int((labels != -100).sum())


# ----------------------------------------------------------------------- examples


def test_build_pair_example_hand_checked(models):
    (_, rtok), (_, stok) = models["llama"], models["qwen2"]
    row = ROWS[0]
    ex = build_pair_example(row, rtok, stok, max_seq_len=256)
    dec = lambda ids: [rtok.decode([i]) for i in ids]  # noqa: E731
    assert dec(ex.receiver_prompt_ids) == ["<|user|>", "A", "nswer", " the", " question", ".", "\n", "\n",
                                           "The", " quick", " brown", " fox", ".", "<|end|>"]
    # the last prompt token opens the continuation; the response + EOS are the labels
    assert dec(ex.continuation_ids[:1]) == ["<|assistant|>"]
    assert ex.labels[0] == IGNORE_INDEX and ex.labels[1:] == ex.continuation_ids[1:]
    assert rtok.decode([t for t in ex.labels if t != IGNORE_INDEX]) == "The lazy dog.<eos>"
    assert ex.num_tokens == len(ex.labels) - 1 == 5
    # same tokens as the LoRA path, split after the second-to-last prompt token
    assert ex.receiver_prompt_ids + ex.continuation_ids == tokenize_example(row, rtok, 256)["input_ids"]
    # the sharer prefills its whole prompt (same tokenizer, so the prompt + <|assistant|>)
    assert ex.sharer_prompt_ids == ex.receiver_prompt_ids + ex.continuation_ids[:1]
    # one-to-one on the content, [] on template markup
    assert ex.mapping == [[]] + [[i] for i in range(1, 13)] + [[]]


def test_build_pair_example_other_prompt_format(models):
    (_, rtok), (_, stok) = models["llama"], models["gemma3_text"]
    row = ROWS[0]
    ex = build_pair_example(row, rtok, stok, max_seq_len=256)
    assert stok.decode(ex.sharer_prompt_ids) == format_example(row, stok)[0]  # "### Instruction:..."
    assert len(ex.mapping) == len(ex.receiver_prompt_ids)
    pairs = [(rtok.decode([ex.receiver_prompt_ids[i]]), stok.decode([ex.sharer_prompt_ids[s] for s in m]))
             for i, m in enumerate(ex.mapping) if m]
    assert len(pairs) == 10  # 5 instruction + 5 context tokens; template and "\n\n" unmapped
    assert all(r.strip() == s.strip() for r, s in pairs)


def test_build_pair_example_truncates_like_data(models):
    (_, rtok), (_, stok) = models["llama"], models["gemma3_text"]
    row = {"instruction": "Answer the question.",
           "context": " ".join(["The quick brown fox jumps over the lazy dog."] * 6),
           "response": "The fox."}
    ex = build_pair_example(row, rtok, stok, max_seq_len=24)
    assert ex.receiver_prompt_ids + ex.continuation_ids == tokenize_example(row, rtok, 24)["input_ids"]
    s_full = tokenize_example(row, stok, 24)
    assert ex.sharer_prompt_ids == [t for t, l in zip(s_full["input_ids"], s_full["labels"]) if l == -100]
    assert len(ex.mapping) == len(ex.receiver_prompt_ids)
    for i, m in enumerate(ex.mapping):  # what survives on both sides still lines up
        if m:
            assert max(m) < len(ex.sharer_prompt_ids)
            assert rtok.decode([ex.receiver_prompt_ids[i]]).strip() == \
                stok.decode([ex.sharer_prompt_ids[s] for s in m]).strip()
    assert any(ex.mapping)
    # a prompt cut to a single token leaves nothing to prefill
    assert build_pair_example({**row, "response": "The fox. " * 10}, rtok, stok, max_seq_len=2) is None
    assert len(build_pair_examples(ROWS, rtok, stok, 256)) == len(ROWS)


def test_step_indices_are_a_function_of_seed_and_step():
    a = [step_indices(5, 3, seed=7, step=s) for s in range(10)]
    assert a == [step_indices(5, 3, seed=7, step=s) for s in range(10)]
    flat = sum(a, [])
    assert sorted(flat[:5]) == list(range(5))  # every example once per epoch
    assert a != [step_indices(5, 3, seed=8, step=s) for s in range(10)]


# --------------------------------------------------------------------------- loss


def test_gate_off_equals_receiver_alone(models):
    (recv, rtok), (share, stok) = models["llama"], models["qwen2"]
    examples = build_pair_examples(ROWS, rtok, stok, 256)
    off = make_fuser(recv, share, gate=-10.0, randomize=True).eval()
    total, count = 0.0, 0
    for row, ex in zip(ROWS, examples):
        alone, n = plain_loss(recv, rtok, row)
        with torch.no_grad():
            loss, m = pair_loss(off, recv, share, ex)
        assert m == n
        assert float(loss) == pytest.approx(alone, abs=1e-5)
        total, count = total + alone * n, count + n
    expected = pytest.approx(total / count, abs=1e-5)
    for fuser in (off, make_fuser(recv, share, gate=10.0, randomize=True)):
        assert evaluate_pair(fuser, recv, share, examples, gate="off")["loss"] == expected
    assert evaluate_pair(off, recv, share, examples, gate="on")["loss"] == expected
    # the test has teeth: the same fuser with its gates open changes the loss
    on = make_fuser(recv, share, gate=10.0, randomize=True)
    assert abs(evaluate_pair(on, recv, share, examples, gate="on")["loss"] - total / count) > 1e-2


@pytest.mark.parametrize("sharer", ["qwen2", "gemma3_text"])
def test_gradients_reach_the_fuser_only(models, sharer):
    (recv, rtok), (share, stok) = models["llama"], models[sharer]
    ex = build_pair_example(ROWS[0], rtok, stok, 256)
    fuser = make_fuser(recv, share).train()
    for m in (recv, share):
        m.requires_grad_(False)
    try:
        loss, n = pair_loss(fuser, recv, share, ex)
        assert n == ex.num_tokens and torch.isfinite(loss)
        loss.backward()
    finally:
        for m in (recv, share):
            m.requires_grad_(True)
    assert all(p.grad is None for m in (recv, share) for p in m.parameters())
    for layer in fuser.layers.values():  # up starts at zero, so its gradient is the first nonzero
        assert layer.key.up.weight.grad.abs().sum() > 0
        assert layer.value.up.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------- training


def test_training_lowers_the_held_out_loss_and_keeps_models(models):
    """Trained on TRAIN_ROWS, scored on VAL_ROWS (no row in common): the fused receiver's
    held-out loss falls below the receiver alone's, and the models are left untouched."""
    (recv, rtok), (share, stok) = models["llama"], models["qwen2"]
    examples = build_pair_examples(TRAIN_ROWS, rtok, stok, 256)
    held_out = build_pair_examples(VAL_ROWS, rtok, stok, 256)
    assert len(examples) == len(TRAIN_ROWS) and len(held_out) == len(VAL_ROWS)
    before = {n: [p.detach().clone() for p in m.parameters()] for n, m in (("r", recv), ("s", share))}
    fuser = make_fuser(recv, share)
    alone = evaluate_pair(fuser, recv, share, held_out, gate="off")["loss"]
    untrained = evaluate_pair(fuser, recv, share, held_out, gate="on")["loss"]
    assert untrained == pytest.approx(alone, abs=1e-5)  # zero-initialised projection
    out = train_fuser(fuser, recv, share, examples, steps=30, batch_size=4, lr=1e-2,
                      seed=0, progress=False)
    assert out["steps"] == 30 and len(out["losses"]) == 30 and out["resumed_from"] is None
    fused = evaluate_pair(fuser, recv, share, held_out, gate="on")["loss"]
    print(f"held-out: receiver alone {alone:.3f}, with the trained fuser {fused:.3f}")
    assert fused < alone - 0.2, (alone, fused)
    for name, m in (("r", recv), ("s", share)):
        assert all(torch.equal(a, p) for a, p in zip(before[name], m.parameters()))
        assert all(p.requires_grad and p.grad is None for p in m.parameters())  # flags restored


def _run(models, tmp, steps=10, every=5, seed=0, **kw):
    (recv, rtok), (share, stok) = models["llama"], models["qwen2"]
    examples = build_pair_examples(ROWS, rtok, stok, 256)
    fuser = make_fuser(recv, share, seed=123)
    out = train_fuser(fuser, recv, share, examples, steps=steps, batch_size=2, lr=1e-2, seed=seed,
                      checkpoint_dir=tmp, checkpoint_every=every, progress=False, **kw)
    return fuser, out


def _same(a, b):
    return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_resume_matches_uninterrupted(models, tmp_path):
    full, out = _run(models, tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-000005.pt", "step-000010.pt"]
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "step-000005.pt", tmp_path / "b")
    resumed, out_b = _run(models, tmp_path / "b")
    assert out_b["resumed_from"] == 5
    assert _same(full, resumed)
    assert out_b["losses"] == pytest.approx(out["losses"])
    # resuming a finished run trains nothing and returns its state
    again, out_c = _run(models, tmp_path / "a")
    assert out_c["resumed_from"] == 10 and _same(full, again)
    # resume=False starts over (and clears the old checkpoints)
    fresh, out_d = _run(models, tmp_path / "a", resume=False)
    assert out_d["resumed_from"] is None and _same(full, fresh)


def test_corrupt_checkpoint_is_skipped_with_a_warning(models, tmp_path):
    full, _ = _run(models, tmp_path / "a")
    good = (tmp_path / "a" / "step-000010.pt").read_bytes()
    (tmp_path / "a" / "step-000010.pt").write_bytes(good[: len(good) // 2])  # interrupted write
    (tmp_path / "a" / "step-000008.pt").write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="ignoring unreadable fuser checkpoint"):
        resumed, out = _run(models, tmp_path / "a")
    assert out["resumed_from"] == 5 and _same(full, resumed)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "step-000003.pt").write_bytes(b"")
    with pytest.warns(UserWarning, match="ignoring unreadable"):
        fresh, out = _run(models, tmp_path / "c")
    assert out["resumed_from"] is None and _same(full, fresh)


def test_checkpoint_of_another_run_is_an_error(models, tmp_path):
    _run(models, tmp_path, steps=5, every=0)
    with pytest.raises(ValueError, match="seed"):
        _run(models, tmp_path, steps=5, seed=1)
    with pytest.raises(ValueError, match="past steps"):
        _run(models, tmp_path, steps=3)


def test_bad_arguments(models):
    (recv, _), (share, _) = models["llama"], models["qwen2"]
    fuser = make_fuser(recv, share)
    with pytest.raises(ValueError, match="no training examples"):
        train_fuser(fuser, recv, share, [], steps=1, batch_size=1, lr=1e-3, seed=0, progress=False)
    ex = PairExample([1, 2], [3, 4], [-100, 4], [1, 2], [[0], [1]])
    with pytest.raises(ValueError, match="steps"):
        train_fuser(fuser, recv, share, [ex], steps=0, batch_size=1, lr=1e-3, seed=0, progress=False)
    with pytest.raises(ValueError, match="gate"):
        evaluate_pair(fuser, recv, share, [ex], gate="maybe")


@pytest.mark.integration
def test_real_pair_training_lowers_the_loss_on_training_and_held_out_rows(mirror):
    """SmolLM2-135M reading Gemma-3-270M's cache (both real, fetched if missing), 8 steps on
    16 public Dolly rows: the receiver's response loss falls on those rows and on 8 held-out
    public rows (hard gates). Measured here: training rows 2.767 -> 2.355, held-out rows
    2.627 -> 2.511 nats; asserted with margin (0.02)."""
    from edgefuse.config import compose
    from edgefuse.data import public_split
    from edgefuse.models import fetch, is_fetched, get_spec, load_model

    for name in ("smollm2-135m", "gemma3-270m"):
        if not is_fetched(get_spec(name)):
            fetch(name)
    recv, rtok = load_model("smollm2-135m")
    share, stok = load_model("gemma3-270m")
    cfg = compose("default", f"data.mirror={mirror}")
    rows = [dict(r) for r in public_split(cfg.data, 0).select(range(24))]
    train = build_pair_examples(rows[:16], rtok, stok, 96)
    held = build_pair_examples(rows[16:], rtok, stok, 96)
    assert len(train) >= 12 and len(held) >= 6
    assert not any(ex.receiver_prompt_ids == h.receiver_prompt_ids for ex in train for h in held)
    fuser = C2CFuser(kv_spec_from_config(recv.config), kv_spec_from_config(share.config),
                     FuserConfig(bottleneck=32, gate_init=1.0))
    alone_train = evaluate_pair(fuser, recv, share, train, gate="off")["loss"]
    alone_held = evaluate_pair(fuser, recv, share, held, gate="off")["loss"]
    assert evaluate_pair(fuser, recv, share, held, gate="on")["loss"] == pytest.approx(alone_held, abs=1e-4)
    train_fuser(fuser, recv, share, train, steps=8, batch_size=4, lr=3e-3, seed=0, progress=False)
    fused_train = evaluate_pair(fuser, recv, share, train, gate="on")["loss"]
    fused_held = evaluate_pair(fuser, recv, share, held, gate="on")["loss"]
    print(f"SmolLM2 alone / reading Gemma-3: training rows {alone_train:.3f} / {fused_train:.3f}, "
          f"held-out rows {alone_held:.3f} / {fused_held:.3f}")
    assert fused_train < alone_train - 0.02
    assert fused_held < alone_held - 0.02
