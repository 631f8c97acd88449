import math

import pytest
import torch

from edgefuse.data import collate, tokenize_example
from edgefuse.lora import attach_lora
from edgefuse.models import tiny_model
from edgefuse.training import evaluate_loss, train_steps

EXAMPLES = [
    {"instruction": "Name a colour.", "context": "", "response": "Blue is a colour."},
    {"instruction": "What is federated learning?", "context": "",
     "response": "Training across devices without sharing data."},
    {"instruction": "Summarize.", "context": "The fox jumps over the lazy dog.",
     "response": "A fox jumps."},
]


@pytest.fixture
def tiny():
    model, tok = tiny_model("llama")
    rows = [tokenize_example(e, tok, 64) for e in EXAMPLES]
    return model, tok, rows


def test_evaluate_loss_is_mean_cross_entropy_over_response_tokens(tiny):
    model, tok, rows = tiny
    res = evaluate_loss(model, rows, tok.pad_token_id, batch_size=2)
    # by hand: per-row summed CE over labelled shifted positions, divided by the token count
    total, count = 0.0, 0
    for row in rows:
        b = collate([row], tok.pad_token_id)
        logits = model(input_ids=b["input_ids"]).logits[0, :-1]
        labels = b["labels"][0, 1:]
        mask = labels != -100
        total += float(torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum"))
        count += int(mask.sum())
    assert res["tokens"] == count
    assert res["loss"] == pytest.approx(total / count, rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_lora_training_lowers_loss_and_touches_only_the_adapter(tiny):
    model, tok, rows = tiny
    peft = attach_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], seed=0)
    base_weight = peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    before = evaluate_loss(peft, rows, tok.pad_token_id)["loss"]
    stats = train_steps(peft, rows, tok.pad_token_id, steps=30, batch_size=3, lr=1e-2)
    after = evaluate_loss(peft, rows, tok.pad_token_id)["loss"]
    assert after < before - 0.2
    assert stats["steps"] == 30 and stats["tokens"] > 0 and stats["last_loss"] < stats["first_loss"]
    assert torch.equal(base_weight, peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight)


def test_empty_inputs_raise(tiny):
    model, tok, _ = tiny
    with pytest.raises(ValueError, match="no training rows"):
        train_steps(model, [], tok.pad_token_id, steps=1, batch_size=1, lr=1e-3)
    with pytest.raises(ValueError, match="no evaluation rows"):
        evaluate_loss(model, [], tok.pad_token_id)


def test_training_repeats_exactly_whatever_ran_before():
    """Dropout noise comes from (seed, round), not from the process's RNG history."""
    import torch

    from edgefuse.lora import attach_lora, get_adapter_state
    from edgefuse.models import tiny_model
    from edgefuse.training import train_steps

    def run(noise_first: bool):
        model, tok = tiny_model("llama")
        peft = attach_lora(model, rank=4, alpha=8, dropout=0.3, target_modules=["q_proj", "v_proj"], seed=0)
        ids = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
        rows = [{"input_ids": ids, "labels": ids, "attention_mask": [1] * len(ids)}] * 4
        if noise_first:
            torch.rand(1000)  # another client's work in the same worker
        out = train_steps(peft, rows, tok.pad_token_id, steps=3, batch_size=2, lr=1e-2, seed=5, round_idx=2)
        return out["train_loss"], get_adapter_state(peft)

    (loss_a, a), (loss_b, b) = run(False), run(True)
    assert loss_a == loss_b
    assert all((a[k] == b[k]).all() for k in a)
