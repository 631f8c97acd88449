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


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_loss_on_labelled_rows_equals_the_full_logits_loss(arch):
    """The head runs on labelled positions only; the loss and the LoRA gradients are those of
    the full ``[batch, T, V]`` logits (Gemma's soft-capping included)."""
    from edgefuse.training import _token_loss_sum

    model, tok = tiny_model(arch)
    if arch == "gemma3_text":
        model.config.final_logit_softcapping = 5.0
    peft = attach_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], seed=0)
    for p in peft.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    batch = collate([tokenize_example(e, tok, 64) for e in EXAMPLES], tok.pad_token_id)
    loss, n = _token_loss_sum(peft, batch)
    grads = torch.autograd.grad(loss, [p for p in peft.parameters() if p.requires_grad])
    logits = peft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    full = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    full_grads = torch.autograd.grad(full, [p for p in peft.parameters() if p.requires_grad])
    assert n == int((labels != -100).sum()) > 0
    assert torch.allclose(loss, full, rtol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(grads, full_grads))


def test_gradient_checkpointing_gives_the_same_losses_and_adapter(tiny):
    """Recomputing activations (dropout on) changes memory, not the result."""
    from edgefuse.lora import get_adapter_state

    model, tok, rows = tiny
    out = []
    for ckpt in (False, True):
        m, _ = tiny_model("llama")
        peft = attach_lora(m, rank=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"], seed=0)
        res = train_steps(peft, rows, tok.pad_token_id, steps=3, batch_size=2, lr=1e-2, seed=1,
                          gradient_checkpointing=ckpt)
        assert not peft.get_base_model().is_activation_checkpointing  # switched off again
        out.append((res["first_loss"], res["last_loss"], get_adapter_state(peft)))
    assert out[0][:2] == pytest.approx(out[1][:2], rel=1e-5)
    assert all(abs(out[0][2][k] - out[1][2][k]).max() < 1e-5 for k in out[0][2])
