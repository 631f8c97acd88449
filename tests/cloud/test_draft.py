"""edgefuse.cloud.decoding.drafters: pruned draft head, shallow draft, frequent-token ids, prompt
lookup, and the Drafter interface (proposals, the q they are drawn from, observe / rollback)."""

import copy
import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from edgefuse.cloud.decoding import EdgeLM
from edgefuse.cloud.decoding.drafters import (DraftHead, FullHeadDrafter, NgramDrafter, PrunedHeadDrafter,
                                              ShallowDrafter, always_kept_ids, frequent_token_ids,
                                              shallow_model)
from edgefuse.cloud.speculative import draft_q, sample_sparse, sparse_q
from edgefuse.models import tiny_model

ARCHS = ("qwen2", "llama", "gemma3_text")  # untied head, tied head, soft-capped / scaled


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, one_thread):
    return tiny_model(request.param)


def _ids(model, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (2, T), generator=g)


@torch.inference_mode()
def test_full_head_equals_model_logits(tiny):
    model, _ = tiny
    x = _ids(model)
    ref = model(input_ids=x).logits
    head = DraftHead(model)
    hidden = model.model(input_ids=x).last_hidden_state
    assert head.size == model.config.vocab_size
    torch.testing.assert_close(head.logits(hidden), ref, atol=1e-5, rtol=0)
    all_ids = DraftHead(model, torch.arange(model.config.vocab_size))
    torch.testing.assert_close(all_ids.logits(hidden), ref, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_pruned_head_equals_model_columns(tiny):
    model, _ = tiny
    x = _ids(model, seed=1)
    ref = model(input_ids=x).logits
    keep = torch.tensor([0, 3, 7, 40, 41, 100, model.config.vocab_size - 1])
    head = DraftHead(model, keep)
    got = head.logits(model.model(input_ids=x).last_hidden_state)
    assert got.shape == (2, 12, len(keep))
    torch.testing.assert_close(got, ref[..., keep], atol=1e-5, rtol=0)
    assert head.to_vocab(torch.tensor([0, 6])).tolist() == [0, model.config.vocab_size - 1]
    assert head.from_vocab(torch.tensor([40, 5, 100])).tolist() == [3, -1, 5]
    # the slice is a copy: the model's own head is untouched
    assert model.get_output_embeddings().weight.shape[0] == model.config.vocab_size


def test_pruned_head_rejects_bad_ids(tiny):
    model, _ = tiny
    with pytest.raises(ValueError):
        DraftHead(model, torch.tensor([model.config.vocab_size]))
    with pytest.raises(ValueError):
        DraftHead(model, torch.tensor([], dtype=torch.long))


@torch.inference_mode()
def test_forward_last_over_a_cache_equals_full_forward(tiny):
    model, _ = tiny
    x = _ids(model, T=10, seed=2)[:1]
    keep = torch.arange(0, model.config.vocab_size, 3)
    head = DraftHead(model, keep)
    ref = model(input_ids=x).logits[:, -1, keep]
    _, cache = head.forward_last(model, x[:, :6], DynamicCache())
    assert cache.get_seq_length() == 6
    got, cache = head.forward_last(model, x[:, 6:9], cache)  # several new tokens at once
    got, cache = head.forward_last(model, x[:, 9:], cache)  # then one
    assert cache.get_seq_length() == 10 and got.shape == (1, len(keep))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    fresh, _ = head.forward_last(model, x)  # no cache given: starts one
    torch.testing.assert_close(fresh, ref, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_pruned_head_drafter_is_greedy_over_kept_ids(tiny):
    model, tok = tiny
    x = _ids(model, T=5, seed=3)[:1]
    keep = torch.arange(0, model.config.vocab_size, 2)
    drafter = PrunedHeadDrafter(EdgeLM(model, tok), DraftHead(model, keep))
    drafter.start(x[0].tolist())
    drafted = drafter.propose(3).ids
    seq = x
    for t in drafted:
        nxt = keep[model(input_ids=seq).logits[0, -1, keep].argmax()]
        assert int(nxt) == t
        seq = torch.cat([seq, torch.tensor([[t]])], 1)
    assert drafter.lm.cache.get_seq_length() == 5 + 2  # the last draft is fed by the next step


@torch.inference_mode()
def test_shallow_model_matches_early_exit_and_shares_weights(tiny):
    model, _ = tiny
    total = model.config.num_hidden_layers
    x = _ids(model, T=8, seed=4)[:1]
    full = shallow_model(model, total)
    torch.testing.assert_close(full(input_ids=x).logits, model(input_ids=x).logits, atol=1e-5, rtol=0)
    L = 1
    sm = shallow_model(model, L)
    assert model.config.num_hidden_layers == total and len(model.model.layers) == total
    assert sm.model.layers[0] is model.model.layers[0]
    assert sm.get_output_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    # reference: run layer 0 by hand through the full model's hidden states, norm, head
    hs = model.model(input_ids=x, output_hidden_states=True).hidden_states
    ref = model.get_output_embeddings()(model.model.norm(hs[L]))
    if getattr(model.config, "final_logit_softcapping", None):
        c = model.config.final_logit_softcapping
        ref = torch.tanh(ref / c) * c
    torch.testing.assert_close(sm(input_ids=x).logits, ref, atol=1e-5, rtol=0)
    head = DraftHead(sm)
    got, cache = head.forward_last(sm, x[:, :5], DynamicCache())
    got, cache = head.forward_last(sm, x[:, 5:], cache)
    torch.testing.assert_close(got, ref[:, -1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        shallow_model(model, total + 1)


@torch.inference_mode()
def test_shallow_model_of_a_peft_model_keeps_the_adapter(tiny):
    """A device's model is a PEFT model: its shallow view runs the base model's first layer
    with the LoRA applied (it differs from the view of the model without the adapter)."""
    from edgefuse.lora import attach_lora

    model, _ = tiny
    x = _ids(model, T=6, seed=7)[:1]
    plain = shallow_model(model, 1)(input_ids=x).logits
    peft = attach_lora(copy.deepcopy(model), rank=4, alpha=16.0, dropout=0.0,
                       target_modules=["q_proj", "v_proj"], seed=0)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    hs = peft(input_ids=x, output_hidden_states=True).hidden_states
    base = peft.get_base_model()
    ref = base.get_output_embeddings()(base.model.norm(hs[1]))
    if getattr(model.config, "final_logit_softcapping", None):
        c = model.config.final_logit_softcapping
        ref = torch.tanh(ref / c) * c
    got = shallow_model(peft, 1)(input_ids=x).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(got, plain, atol=1e-3)


TEXTS = ["The quick brown fox jumps over the lazy dog.", "the the the dog dog fox",
         "Federated learning trains a model across devices."]


def test_frequent_ids_keep_specials_respect_n_and_are_deterministic(tiny):
    _, tok = tiny
    forced = always_kept_ids(tok)
    assert set(tok.all_special_ids) <= forced
    if tok.chat_template:
        assert tok.convert_tokens_to_ids("<|assistant|>") in forced
    n = len(forced) + 5
    ids = frequent_token_ids(tok, TEXTS, n)
    assert ids.dtype == torch.long and len(ids) == n and len(set(ids.tolist())) == n
    assert ids.tolist() == sorted(ids.tolist())
    assert forced <= set(ids.tolist())
    assert torch.equal(ids, frequent_token_ids(tok, list(TEXTS), n))
    # the 5 free slots go to the most frequent corpus tokens (ties: lower id first)
    counts = {}
    for t in tok(TEXTS, add_special_tokens=False)["input_ids"]:
        for i in t:
            if i not in forced:
                counts[i] = counts.get(i, 0) + 1
    top = sorted(counts, key=lambda i: (-counts[i], i))[:5]
    assert set(ids.tolist()) - forced == set(top)
    assert len(frequent_token_ids(tok, TEXTS, 10 ** 6)) == len(tok)
    with pytest.raises(ValueError):
        frequent_token_ids(tok, TEXTS, len(forced) - 1)


def test_frequent_ids_cache_round_trip(tiny, tmp_path, monkeypatch):
    _, tok = tiny
    n = len(always_kept_ids(tok)) + 3
    path = tmp_path / "sub" / "freq.json"
    ids = frequent_token_ids(tok, TEXTS, n, cache_path=path)
    doc = json.loads(path.read_text())
    assert doc["ids"] == ids.tolist() and doc["n"] == n
    assert not list(path.parent.glob("*.tmp"))
    import edgefuse.cloud.decoding.drafters as D

    def boom(*a, **k):
        raise AssertionError("recounted despite a valid cache")

    monkeypatch.setattr(D, "token_counts", boom)
    assert torch.equal(frequent_token_ids(tok, TEXTS, n, cache_path=path), ids)
    monkeypatch.undo()
    # another n or another corpus is a miss: recomputed and rewritten
    other = frequent_token_ids(tok, TEXTS[:1], n + 1, cache_path=path)
    assert len(other) == n + 1 and json.loads(path.read_text())["n"] == n + 1
    path.write_text("{not json")
    assert torch.equal(frequent_token_ids(tok, TEXTS, n, cache_path=path), ids)


def test_ngram_drafter_hand_made():
    d = NgramDrafter(max_n=2, min_n=1)
    assert d.lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # the most recent earlier occurrence wins
    assert d.lookup([1, 2, 5, 1, 2, 6, 1, 2], 3) == [6, 1, 2]
    # the 2-gram [2, 1] never occurred: fall back to the 1-gram [1]
    assert d.lookup([7, 1, 9, 2, 1], 2) == [9, 2]
    # a 2-gram match beats a more recent 1-gram one
    assert d.lookup([3, 4, 8, 4, 9, 3, 4], 2) == [8, 4]
    # a match near the end proposes fewer than gamma tokens
    assert d.lookup([5, 5, 5], 4) == [5]
    # no match, too short, gamma 0
    assert d.lookup([1, 2, 3, 4], 3) == []
    assert d.lookup([1], 3) == []
    assert d.lookup([1, 2, 1], 0) == []
    assert NgramDrafter(max_n=3, min_n=2).lookup([7, 1, 9, 2, 1], 2) == []
    with pytest.raises(ValueError):
        NgramDrafter(max_n=1, min_n=2)


def test_ngram_drafter_proposes_observes_and_rolls_back():
    """The Drafter interface on a hand-made sequence: proposals extend the held ids, the
    cloud's answer keeps the accepted prefix and its token, a look-ahead drafted on the right
    token survives, and at temperature > 0 each proposal carries its one-hot q."""
    d = NgramDrafter(max_n=2, min_n=1)
    d.start([1, 2, 3, 4, 1, 2])
    assert d.committed == 6
    block = d.propose(3)
    assert block.ids == [3, 4, 1] and block.q == [] and d.tokens == [1, 2, 3, 4, 1, 2, 3, 4, 1]
    # the cloud kept 1 of 3 and answered 9: the rest is dropped, 9 committed
    assert d.observe(1, 9) == 0
    assert d.tokens == [1, 2, 3, 4, 1, 2, 3, 9] and d.committed == 8
    assert d.propose(2).ids == []  # [3, 9] and [9] never occurred before
    # spec_async: block [4, 1] ... then a guess and a look-ahead drafted on top of it
    d.start([5, 4, 1, 2, 5, 4])
    assert d.propose(2).ids == [1, 2] and d.propose(1).ids == [5] and d.propose(1).ids == [4]
    assert d.observe(2, 5) == 1  # all kept, the token equals the guess: the look-ahead [4] stays
    assert d.tokens == [5, 4, 1, 2, 5, 4, 1, 2, 5, 4] and d.committed == 9
    d.rollback(9)
    assert d.tokens == [5, 4, 1, 2, 5, 4, 1, 2, 5]
    # rejected: the draft goes, the target's token follows
    assert d.propose(1).ids == [4]
    assert d.observe(0, 7) == 0 and d.tokens == [5, 4, 1, 2, 5, 4, 1, 2, 5, 7] and d.committed == 10
    with pytest.raises(ValueError, match="accepted"):
        d.observe(1, 3)  # nothing held to accept
    sampled = NgramDrafter(2, 1)
    sampled.start([8, 6, 8])
    got = sampled.propose(2, temperature=0.7)
    assert got.ids == [6, 8]
    assert [(q.tolist(), p.tolist()) for q, p in got.q] == [([6], [1.0]), ([8], [1.0])]


def _model_drafters(model, tok):
    keep = torch.arange(0, model.config.vocab_size, 3)
    head = DraftHead(model, keep)
    return {"full_head": (FullHeadDrafter(EdgeLM(model, tok)), lambda x: model(input_ids=x).logits[0, -1], None),
            "pruned_head": (PrunedHeadDrafter(EdgeLM(model, tok), head),
                            lambda x: model(input_ids=x).logits[0, -1, keep], keep),
            "shallow": (ShallowDrafter.of(model, tok, 1),
                        lambda x: shallow_model(model, 1)(input_ids=x).logits[0, -1], None)}


@torch.inference_mode()
def test_model_drafters_draw_from_exactly_the_q_they_send(tiny):
    """Greedy: the argmax of the drafter's model (full, pruned columns, first layer). Sampled:
    the q sent is draft_q of those logits (ids mapped to the vocabulary), and the drafted id
    is the draw sample_sparse makes from that q with the same generator (replayed)."""
    model, tok = tiny
    prompt = _ids(model, T=6, seed=5)[0].tolist()
    for name, (drafter, ref_logits, keep) in _model_drafters(model, tok).items():
        drafter.start(prompt)
        greedy = drafter.propose(3)
        assert greedy.q == [] and drafter.tokens == prompt + greedy.ids
        seq = list(prompt)
        for t in greedy.ids:
            i = int(ref_logits(torch.tensor([seq])).argmax())
            assert t == (int(keep[i]) if keep is not None else i), name
            seq.append(t)
        drafter.rollback(len(prompt))
        logits = ref_logits(torch.tensor([prompt])).float()
        ids, probs = draft_q(logits, 0.8, 8)
        if keep is not None:
            ids = keep[torch.as_tensor(ids)].numpy()
        for seed in range(20):
            d = drafter.propose(1, temperature=0.8, kq=8, gen=torch.Generator().manual_seed(seed))
            (sent_ids, sent_probs), = d.q
            assert sent_ids.tolist() == ids.tolist(), name
            np.testing.assert_allclose(sent_probs.astype(np.float32), probs.astype(np.float32), atol=1e-3)
            replay = sample_sparse(*sparse_q(sent_ids, sent_probs), torch.Generator().manual_seed(seed))
            assert d.ids == [replay] and replay in sent_ids
            drafter.rollback(len(prompt))


@torch.inference_mode()
def test_model_drafters_observe_like_a_fresh_start(tiny):
    """After the cloud's answer (1 of 3 kept, then a token of its own) a drafter proposes what
    a fresh drafter started on the committed ids proposes: its cache was rolled back right."""
    model, tok = tiny
    prompt = _ids(model, T=5, seed=6)[0].tolist()
    for name, (drafter, _, _) in _model_drafters(model, tok).items():
        drafter.start(prompt)
        block = drafter.propose(3)
        token = (block.ids[1] + 1) % model.config.vocab_size  # not the draft: a rejection
        assert drafter.observe(1, token) == 0
        committed = prompt + block.ids[:1] + [token]
        assert drafter.tokens == committed and drafter.committed == len(committed)
        fresh = _model_drafters(model, tok)[name][0]
        fresh.start(committed)
        assert drafter.propose(4).ids == fresh.propose(4).ids, name
