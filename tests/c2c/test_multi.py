"""Several sharers into one receiver (edgefuse.c2c.multi): the gate, fuse_many, examples, training.

Tiny random-weight models: receiver tiny-llama (3 layers) with sharers tiny-qwen2 (2 layers,
same tokenizer and chat template) and tiny-gemma3 (6 layers, sliding windows, plain prompt
format). The pair fusers get random projections and open hard gates, so each fused cache
differs from the receiver's (qwen2's fuser leaves llama layer 0 alone: no sharer layer).
"""

import copy
import math

import pytest
import torch

from edgefuse.models import tiny_model
from edgefuse.c2c import C2CFuser, FuserConfig, MultiSharerGate, fuse_many, kv_spec_from_config
from edgefuse.c2c.gate_train import MultiExample, build_multi_examples, evaluate_multi, multi_loss, train_gate
from edgefuse.c2c.examples import build_pair_example
from edgefuse.c2c.train import pair_loss
from tests.c2c.heldout import TRAIN_ROWS, VAL_ROWS

ROWS = [
    {"instruction": "Answer the question.", "context": "The quick brown fox.", "response": "The lazy dog."},
    {"instruction": "What trains a model?", "context": "", "response": "Federated learning."},
    {"instruction": "Answer the question.", "context": "Devices share their data.", "response": "No, without sharing."},
    {"instruction": "What jumps over the dog?", "context": "The quick brown fox jumps.", "response": "The fox."},
]
SHARERS = ("qwen2", "gemma3_text")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def setup():
    """receiver, sharers, fusers (eval, random projections, gates open) and examples."""
    receiver, rtok = tiny_model("llama", seed=0)
    sharers = [tiny_model(arch, seed=i + 1) for i, arch in enumerate(SHARERS)]
    fusers = []
    for k, (model, _) in enumerate(sharers):
        torch.manual_seed(10 + k)
        fuser = C2CFuser(kv_spec_from_config(receiver.config), kv_spec_from_config(model.config),
                         FuserConfig(bottleneck=16, gate_init=1.0))
        with torch.no_grad():
            for layer in fuser.layers.values():
                for branch in (layer.key, layer.value):
                    branch.up.weight.normal_(0, 0.5)
                    branch.up.bias.normal_(0, 0.5)
        fusers.append(fuser.eval())
    examples = build_multi_examples(ROWS, rtok, [tok for _, tok in sharers], max_seq_len=256)
    return {"receiver": receiver, "rtok": rtok, "sharer_models": [m for m, _ in sharers],
            "sharer_toks": [t for _, t in sharers], "fusers": fusers, "examples": examples}


def caches(setup, ex_index=0):
    """(receiver prefill cache, [fused cache per sharer]) of one example, no grad."""
    ex = setup["examples"][ex_index]
    with torch.no_grad():
        r_cache = setup["receiver"](torch.tensor([ex.receiver_prompt_ids]), use_cache=True).cache
        fused = []
        for fuser, model, ids, mapping in zip(setup["fusers"], setup["sharer_models"],
                                              ex.sharer_prompt_ids, ex.mappings):
            s_cache = model(torch.tensor([ids]), use_cache=True).cache
            fused.append(fuser(r_cache, s_cache, mapping))
    return r_cache, fused


def make_gate(setup, k=2, **kw):
    return MultiSharerGate(kv_spec_from_config(setup["receiver"].config), k, **kw)


def set_bias(gate, values):
    with torch.no_grad():
        for lin in gate.layers:
            lin.bias.copy_(torch.tensor(values, dtype=torch.float32))


def snapshot(*caches_):
    """Cloned (keys, values) of every layer of every cache, flattened."""
    return [t.clone() for c in caches_ for layer in c.layers for t in (layer.keys, layer.values)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------- gate


def test_gate_init_size_and_errors(setup):
    r_cache, fused = caches(setup)
    gate = make_gate(setup).eval()
    w = gate(r_cache)
    assert w.shape == (1, 3, 2) and torch.equal(w, torch.full_like(w, 0.5))
    width = 2 * 2 * 16  # keys + values, 2 kv heads of dim 16
    assert gate.num_parameters() == 3 * (width + 1) * 2 == 390
    # untrained gate == no gate (the plain average)
    a, b = fuse_many(r_cache, fused, gate), fuse_many(r_cache, fused, None)
    assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))
    assert torch.allclose(make_gate(setup, 3)(r_cache), torch.tensor(1 / 3))
    assert torch.allclose(make_gate(setup, 1)(r_cache), torch.tensor(0.95))
    with pytest.raises(ValueError, match="num_sharers"):
        make_gate(setup, 0)
    with pytest.raises(ValueError, match="drop_threshold"):
        make_gate(setup, 2, drop_threshold=1.0)
    s_cache = setup["sharer_models"][0](torch.tensor([[5, 6, 7]]), use_cache=True).cache
    with pytest.raises(ValueError, match="2 layers, the gate expects 3"):
        gate(s_cache)


def test_one_hot_gate_returns_exactly_one_fused_cache(setup):
    r_cache, fused = caches(setup)
    gate = make_gate(setup).eval()
    for bias, want in (([30.0, -30.0], fused[0]), ([-30.0, 30.0], fused[1]), ([-30.0, -30.0], r_cache)):
        set_bias(gate, bias)
        out = fuse_many(r_cache, fused, gate)
        for got, ref in zip(out.layers, want.layers):
            assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)
    assert not torch.equal(fused[0].layers[2].keys, fused[1].layers[2].keys)  # the test can tell them apart


def test_equal_weights_are_the_average(setup):
    r_cache, fused = caches(setup)
    third = [fused[0], fused[1], fused[0]]
    out2, out3 = fuse_many(r_cache, fused, None), fuse_many(r_cache, third, None)
    for i, r in enumerate(r_cache.layers):
        for name in ("keys", "values"):
            f0, f1 = getattr(fused[0].layers[i], name), getattr(fused[1].layers[i], name)
            assert torch.allclose(getattr(out2.layers[i], name), (f0 + f1) / 2, atol=1e-6)
            assert torch.allclose(getattr(out3.layers[i], name), (2 * f0 + f1) / 3, atol=1e-5)
            assert getattr(out2.layers[i], name).shape == getattr(r, name).shape
    assert [type(x) for x in out2.layers] == [type(x) for x in r_cache.layers]
    assert out2.get_seq_length() == r_cache.get_seq_length()


def test_eval_drops_small_weights(setup):
    r_cache, fused = caches(setup)
    gate = make_gate(setup, drop_threshold=0.1)
    set_bias(gate, [math.log(0.6 / 0.4), math.log(0.05 / 0.95)])  # weights 0.6, 0.05
    gate.train()
    assert torch.allclose(gate(r_cache), torch.tensor([0.6, 0.05]))  # soft when training
    gate.eval()
    w = gate(r_cache)
    assert torch.equal(w[..., 1], torch.zeros_like(w[..., 1])) and torch.allclose(w[..., 0], torch.tensor(0.6))
    out = fuse_many(r_cache, fused, gate)
    for i, r in enumerate(r_cache.layers):
        expect = r.keys + 0.6 * (fused[0].layers[i].keys - r.keys)
        assert torch.allclose(out.layers[i].keys, expect, atol=1e-6)


def test_fuse_many_leaves_inputs_alone_and_gradient_reaches_gate(setup):
    r_cache, fused = caches(setup)
    before = snapshot(r_cache, *fused)
    gate = make_gate(setup).train()
    out = fuse_many(r_cache, fused, gate)
    loss = sum((layer.keys ** 2).mean() + (layer.values ** 2).mean() for layer in out.layers)
    loss.backward()
    assert same(snapshot(r_cache, *fused), before)
    assert all(layer.keys is not r.keys for layer, r in zip(out.layers, r_cache.layers))
    for i, lin in enumerate(gate.layers):
        assert lin.weight.grad is not None and lin.bias.grad is not None
        # layer 0: only gemma3's fuser changed it (qwen2 has no sharer layer for it)
        moved = [k for k in range(2) if not torch.equal(fused[k].layers[i].keys, r_cache.layers[i].keys)]
        assert moved == ([1] if i == 0 else [0, 1])
        for k in range(2):
            assert (lin.bias.grad[k] != 0) == (k in moved), (i, k)
    assert all(p.grad is None for f in setup["fusers"] for p in f.parameters())


def test_fuse_many_errors(setup):
    r_cache, fused = caches(setup)
    with pytest.raises(ValueError, match="no fused caches"):
        fuse_many(r_cache, [])
    with pytest.raises(ValueError, match="weighs 3 sharers, got 2"):
        fuse_many(r_cache, fused, make_gate(setup, 3))
    other, _ = caches(setup, ex_index=1)  # another prompt length
    with pytest.raises(ValueError, match="fused cache 1 layer 0"):
        fuse_many(r_cache, [fused[0], other])
    s_cache = setup["sharer_models"][0](torch.tensor([[5, 6, 7]]), use_cache=True).cache
    with pytest.raises(ValueError, match="fused cache 0 has 2 layers"):
        fuse_many(r_cache, [s_cache])


# ----------------------------------------------------------------------- examples, loss, training


def test_multi_examples_match_pair_examples(setup):
    examples = setup["examples"]
    assert len(examples) == len(ROWS) and all(isinstance(ex, MultiExample) for ex in examples)
    for row, ex in zip(ROWS, examples):
        assert ex.num_sharers == 2
        for k, tok in enumerate(setup["sharer_toks"]):
            assert ex.pair(k) == build_pair_example(row, setup["rtok"], tok, 256)
        assert ex.num_tokens == ex.pair(1).num_tokens > 0
    # a row unusable for one sharer is dropped (no response token survives)
    long = {"instruction": "Answer the question.", "context": "", "response": "The lazy dog. " * 40}
    assert build_multi_examples([long], setup["rtok"], setup["sharer_toks"], max_seq_len=4) == []


def test_multi_loss_with_one_hot_gate_is_the_pair_loss(setup):
    ex = setup["examples"][0]
    gate = make_gate(setup).eval()
    set_bias(gate, [-30.0, 30.0])
    args = (setup["fusers"], setup["receiver"], setup["sharer_models"], ex)
    with torch.no_grad():
        multi, n = multi_loss(gate, *args)
        pair, m = pair_loss(setup["fusers"][1], setup["receiver"], setup["sharer_models"][1], ex.pair(1))
    assert n == m and float(multi) == pytest.approx(float(pair), rel=1e-6)
    with pytest.raises(ValueError, match="one fuser per sharer"):
        multi_loss(gate, setup["fusers"][:1], setup["receiver"], setup["sharer_models"], ex)


def test_train_gate_lowers_the_held_out_loss(setup):
    """Trained on TRAIN_ROWS, scored on VAL_ROWS (no row in common): the gate's held-out
    loss falls; only the gate learned."""
    fusers, sharers = setup["fusers"], setup["sharer_models"]
    examples = build_multi_examples(TRAIN_ROWS, setup["rtok"], setup["sharer_toks"], max_seq_len=256)
    held_out = build_multi_examples(VAL_ROWS, setup["rtok"], setup["sharer_toks"], max_seq_len=256)
    assert len(examples) == len(TRAIN_ROWS) and len(held_out) == len(VAL_ROWS)
    # A random tiny model predicts almost uniformly whatever its cache holds; scaling its
    # final norm by 10 sharpens the logits so that the cache (hence the gate) matters.
    receiver = copy.deepcopy(setup["receiver"])
    with torch.no_grad():
        receiver.model.norm.weight.mul_(10.0)
    torch.manual_seed(0)
    gate = make_gate(setup)
    fuser_state = [{k: v.clone() for k, v in f.state_dict().items()} for f in fusers]
    before = evaluate_multi(gate, fusers, receiver, sharers, held_out)
    out = train_gate(gate, fusers, receiver, sharers, examples, steps=12, batch_size=2, lr=0.03, seed=0,
                     progress=False)
    after = evaluate_multi(gate, fusers, receiver, sharers, held_out)
    print(f"gate held-out loss {before['loss']:.3f} -> {after['loss']:.3f}")
    assert len(out["losses"]) == 12 and out["first_loss"] == out["losses"][0]
    assert after["loss"] < before["loss"] - 0.3, (before, after)
    assert not gate.training
    # only the gate learned; the models and fusers got their flags and modes back
    for f, state in zip(fusers, fuser_state):
        assert all(torch.equal(v, f.state_dict()[k]) for k, v in state.items())
        assert not f.training and all(p.requires_grad for p in f.parameters())
    assert all(p.requires_grad for p in receiver.parameters())
    assert all(p.grad is None for m in [receiver, *sharers] for p in m.parameters())
    with pytest.raises(ValueError, match="no training examples"):
        train_gate(gate, fusers, receiver, sharers, [], steps=1, batch_size=1, lr=0.1, seed=0)
