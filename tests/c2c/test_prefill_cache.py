"""The prompt-cache store (edgefuse.c2c.prefill) and what fuser training builds on it: batched
losses equal per-example ones, cached and uncached training give identical fusers, a changed
model or adapter never serves stale caches, batching by length, the sharer controls.

Tiny random-weight models as in test_fuser_train.py.
"""

import pytest
import torch

from edgefuse.c2c import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.examples import build_pair_examples
from edgefuse.c2c.fuser import control_sharer
from edgefuse.c2c.prefill import PrefillStore, Prefiller, prefill
from edgefuse.c2c.train import (batch_losses, evaluate_pair, pair_loss, shuffled_partners, step_indices,
                                train_fuser)
from edgefuse.models import tiny_model
from tests.c2c.heldout import TRAIN_ROWS, VAL_ROWS


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_model("llama", seed=0), "qwen2": tiny_model("qwen2", seed=1),
            "gemma3_text": tiny_model("gemma3_text", seed=2)}


def _fuser(recv, share, control="none", seed=5, randomize=True):
    torch.manual_seed(seed)
    fuser = C2CFuser(kv_spec_from_config(recv.config), kv_spec_from_config(share.config),
                     FuserConfig(bottleneck=16, gate_init=1.0, sharer_control=control))
    if randomize:
        with torch.no_grad():
            for layer in fuser.layers.values():
                for branch in (layer.key, layer.value):
                    branch.up.weight.normal_(0, 0.5)
                    branch.up.bias.normal_(0, 0.5)
    return fuser


# prompts and responses of different lengths, so batches are padded
VARIED = [dict(r, context=r["context"] + " The data is here." * (k % 4),
               response=r["response"] + " It is." * (k % 3)) for k, r in enumerate(TRAIN_ROWS)]


def _examples(models, sharer="qwen2", rows=VARIED, receiver="llama"):
    (_, rtok), (_, stok) = models[receiver], models[sharer]
    return build_pair_examples(rows, rtok, stok, 256)


@pytest.mark.parametrize("receiver,sharer", [("llama", "qwen2"), ("llama", "gemma3_text"),
                                             ("gemma3_text", "llama")])
def test_batched_losses_equal_one_at_a_time(models, receiver, sharer):
    """Left-padded caches + right-padded continuations in one forward give each example the
    loss it has alone (the per-example path is pair_loss, the query-time computation); a
    sliding-window receiver (Gemma 3) too."""
    recv, share = models[receiver][0], models[sharer][0]
    examples = _examples(models, sharer, receiver=receiver)[:6]
    assert len({len(ex.receiver_prompt_ids) for ex in examples}) > 1  # padding is exercised
    fuser = _fuser(recv, share).eval()
    with torch.no_grad():
        alone = [float(pair_loss(fuser, recv, share, ex)[0]) for ex in examples]
        ev = evaluate_pair(fuser, recv, share, examples, gate="on", micro_batch=6)
        r_pre, s_pre = Prefiller(recv), Prefiller(share)
        caches = [fuser(r_pre(ex.receiver_prompt_ids), s_pre(ex.sharer_prompt_ids), ex.mapping) for ex in examples]
        sums, counts = batch_losses(recv, caches, examples)
    assert counts.tolist() == [ex.num_tokens for ex in examples]
    assert ev["per_example"] == pytest.approx(alone, abs=1e-4)
    assert (sums / counts).tolist() == pytest.approx(alone, abs=1e-4)
    assert ev["loss"] == pytest.approx(sum(a * ex.num_tokens for a, ex in zip(alone, examples))
                                       / sum(ex.num_tokens for ex in examples), abs=1e-4)


def test_store_round_trip_is_exact_and_counts_hits(models, tmp_path):
    recv = models["llama"][0]
    ids = _examples(models)[0].receiver_prompt_ids
    store = PrefillStore(tmp_path, "float32")
    first = store.get(recv, "llama@base", ids)
    again = PrefillStore(tmp_path, "float32").get(recv, "llama@base", ids)  # a new process reads disk
    fresh = prefill(recv, ids)
    for a, b, c in zip(first.layers, again.layers, fresh.layers):
        assert torch.equal(a.keys, c.keys) and torch.equal(b.keys, c.keys) and torch.equal(b.values, c.values)
    assert (store.hits, store.misses) == (0, 1)
    store.get(recv, "llama@base", ids)
    assert (store.hits, store.misses) == (1, 1)
    assert len(list(store.folder("llama@base").glob("*.safetensors"))) == 2  # the probe + one prompt


def test_a_changed_adapter_or_model_never_serves_stale_caches(models, tmp_path):
    """A new adapter hash reads another folder; a model changed under the SAME key is caught
    by the probe, which empties the folder; either way the cache is the new model's."""
    recv = tiny_model("llama", seed=0)[0]
    ids = _examples(models)[1].receiver_prompt_ids
    store = PrefillStore(tmp_path)
    old = store.get(recv, "llama@aaaa", ids)
    with torch.no_grad():
        recv.model.layers[0].self_attn.k_proj.weight.add_(0.1)  # the adapter changed
    new_key = PrefillStore(tmp_path).get(recv, "llama@bbbb", ids)
    fresh = prefill(recv, ids)
    assert torch.equal(new_key.layers[0].keys, fresh.layers[0].keys)
    assert not torch.equal(new_key.layers[0].keys, old.layers[0].keys)
    reopened = PrefillStore(tmp_path)
    with pytest.warns(UserWarning, match="from another model or adapter"):
        same_key = reopened.get(recv, "llama@aaaa", ids)
    assert torch.equal(same_key.layers[0].keys, fresh.layers[0].keys)
    assert (reopened.hits, reopened.misses) == (0, 1)


def test_unreadable_cache_file_is_recomputed(models, tmp_path):
    recv = models["llama"][0]
    ids = _examples(models)[2].receiver_prompt_ids
    store = PrefillStore(tmp_path)
    store.get(recv, "m", ids)
    for f in store.folder("m").glob("*.safetensors"):
        if f.name != "probe.safetensors":
            f.write_bytes(b"torn")
    again = PrefillStore(tmp_path)
    cache = again.get(recv, "m", ids)
    assert again.misses == 1 and torch.equal(cache.layers[1].values, prefill(recv, ids).layers[1].values)


def test_store_refuses_unknown_dtype_and_empty_prompt(models, tmp_path):
    with pytest.raises(ValueError, match="unknown prefill cache dtype"):
        PrefillStore(tmp_path, "int3")
    with pytest.raises(ValueError, match="empty"):
        prefill(models["llama"][0], [])


@pytest.mark.parametrize("control,dtype", [("none", "float32"), ("shuffled", "float16"), ("zero", "float32")])
def test_cached_and_uncached_training_give_identical_fusers(models, tmp_path, control, dtype):
    recv, share = models["llama"][0], models["qwen2"][0]
    examples = _examples(models)

    def run(store):
        fuser = _fuser(recv, share, control, randomize=False)
        kw = {}
        if store is not None:
            kw = {"receiver_prefill": Prefiller(recv, "r", store), "sharer_prefill": Prefiller(share, "s", store)}
        else:
            kw = {"receiver_prefill": Prefiller(recv, dtype=dtype), "sharer_prefill": Prefiller(share, dtype=dtype)}
        out = train_fuser(fuser, recv, share, examples, steps=6, batch_size=4, lr=1e-2, seed=3, progress=False,
                          micro_batch=2, length_group=2, **kw)
        return fuser, out

    store = PrefillStore(tmp_path, dtype)
    cold, out_cold = run(store)           # fills the store
    warm, out_warm = run(store)           # reads it
    plain, out_plain = run(None)          # no store at all
    assert store.misses == 2 * len(examples) and store.hits > 0
    for a, b, c in zip(cold.state_dict().values(), warm.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert out_cold["losses"] == out_warm["losses"] == out_plain["losses"]
    assert any(not torch.equal(p, q) for p, q in zip(cold.state_dict().values(),
                                                        _fuser(recv, share, control, randomize=False).state_dict().values()))


def test_length_grouped_steps_are_deterministic_epochs_of_similar_lengths():
    lengths = [int(x) for x in torch.randint(5, 200, (64,), generator=torch.Generator().manual_seed(0))]
    epoch = [step_indices(64, 8, seed=1, step=s, lengths=lengths, length_group=4) for s in range(8)]
    assert sorted(i for b in epoch for i in b) == list(range(64))  # an epoch visits every example once
    assert epoch == [step_indices(64, 8, seed=1, step=s, lengths=lengths, length_group=4) for s in range(8)]
    plain = [step_indices(64, 8, seed=1, step=s) for s in range(8)]

    def spread(batches):
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)

    assert spread(epoch) < spread(plain) / 2
    assert plain == [step_indices(64, 8, seed=1, step=s, lengths=lengths, length_group=0) for s in range(8)]


def test_shuffled_partners_is_a_derangement():
    for n in (2, 3, 17):
        p = shuffled_partners(n, seed=4)
        assert sorted(p) == list(range(n)) and all(p[i] != i for i in range(n))
        assert p == shuffled_partners(n, seed=4)
    assert shuffled_partners(17, 4) != shuffled_partners(17, 5)


def test_controls_feed_what_they_say(models):
    """zero: the fuser sees an all-zero sharer cache; shuffled: another prompt's cache, the
    mapping scaled onto its length; so the zero control's loss ignores the sharer."""
    recv, share = models["llama"][0], models["qwen2"][0]
    examples = _examples(models)[:4]
    s_pre = Prefiller(share)
    a, b = s_pre(examples[0].sharer_prompt_ids), s_pre(examples[1].sharer_prompt_ids)
    zero, m = control_sharer("zero", a, examples[0].mapping)
    assert m == examples[0].mapping and all(float(layer.keys.abs().sum()) == 0 for layer in zero.layers)
    shuf, m2 = control_sharer("shuffled", a, examples[0].mapping, b)
    assert shuf is b and max(j for x in m2 for j in x) < b.get_seq_length()
    with pytest.raises(ValueError, match="another prompt"):
        control_sharer("shuffled", a, examples[0].mapping)
    fz = _fuser(recv, share, "zero").eval()
    other_sharer = tiny_model("qwen2", seed=9)[0]
    with torch.no_grad():
        l1 = evaluate_pair(fz, recv, share, examples)["per_example"]
        l2 = evaluate_pair(fz, recv, other_sharer, examples)["per_example"]
        real = evaluate_pair(_fuser(recv, share, "none").eval(), recv, share, examples)["per_example"]
        real2 = evaluate_pair(_fuser(recv, share, "none").eval(), recv, other_sharer, examples)["per_example"]
    assert l1 == l2 and real != real2


def test_resume_with_store_and_grouping_matches_uninterrupted(models, tmp_path):
    recv, share = models["llama"][0], models["qwen2"][0]
    examples = _examples(models, rows=VARIED + VAL_ROWS)
    store = PrefillStore(tmp_path / "store")
    kw = dict(batch_size=4, lr=1e-2, seed=2, progress=False, micro_batch=4, length_group=2,
              receiver_prefill=Prefiller(recv, "r", store), sharer_prefill=Prefiller(share, "s", store))
    full = _fuser(recv, share, randomize=False)
    train_fuser(full, recv, share, examples, steps=6, checkpoint_dir=tmp_path / "a", checkpoint_every=3, **kw)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "step-000003.pt").write_bytes((tmp_path / "a" / "step-000003.pt").read_bytes())
    resumed = _fuser(recv, share, randomize=False)
    out = train_fuser(resumed, recv, share, examples, steps=6, checkpoint_dir=tmp_path / "b", **kw)
    assert out["resumed_from"] == 3
    assert all(torch.equal(x, y) for x, y in zip(full.state_dict().values(), resumed.state_dict().values()))
    with pytest.raises(ValueError, match="length_group"):
        train_fuser(_fuser(recv, share), recv, share, examples, steps=6, checkpoint_dir=tmp_path / "b",
                    **{**kw, "length_group": 0})


def test_batched_sliding_window_receiver_within_its_window(models):
    """Gemma 3's sliding layers hold the whole prompt when it is shorter than the window:
    then the padded batch runs in one forward, and still equals one at a time."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(models["gemma3_text"][0].config)
    config.sliding_window = 256
    torch.manual_seed(2)
    recv, share = AutoModelForCausalLM.from_config(config).eval(), models["llama"][0]
    examples = _examples(models, "llama", receiver="gemma3_text")
    window = recv.config.sliding_window
    assert all(len(ex.receiver_prompt_ids) + len(ex.continuation_ids) < window for ex in examples)
    assert len({len(ex.receiver_prompt_ids) for ex in examples}) > 1
    fuser = _fuser(recv, share).eval()
    with torch.no_grad():
        alone = [float(pair_loss(fuser, recv, share, ex)[0]) for ex in examples]
        r_pre, s_pre = Prefiller(recv), Prefiller(share)
        caches = [fuser(r_pre(ex.receiver_prompt_ids), s_pre(ex.sharer_prompt_ids), ex.mapping) for ex in examples]
        from edgefuse.c2c.train import _stack_left_padded
        assert _stack_left_padded(caches, recv.config) is not None  # the one-forward path
        sums, counts = batch_losses(recv, caches, examples)
    assert (sums / counts).tolist() == pytest.approx(alone, abs=1e-4)


def test_a_checkpoint_of_another_fuser_config_is_refused(models, tmp_path):
    """A zero-control checkpoint has the real fuser's shapes: resuming the real one from it
    must be refused, not silently continued."""
    recv, share = models["llama"][0], models["qwen2"][0]
    examples = _examples(models)
    kw = dict(steps=4, batch_size=2, lr=1e-2, seed=0, progress=False, checkpoint_dir=tmp_path, checkpoint_every=2)
    train_fuser(_fuser(recv, share, "zero"), recv, share, examples, until=2, **kw)
    with pytest.raises(ValueError, match="another config"):
        train_fuser(_fuser(recv, share, "none"), recv, share, examples, **kw)
    out = train_fuser(_fuser(recv, share, "zero"), recv, share, examples, **kw)
    assert out["resumed_from"] == 2 and len(out["losses"]) == 4


def test_two_model_keys_never_share_a_folder_or_a_probe(tmp_path):
    """Attack: two models whose keys differ only by a character the folder name cannot hold
    ('org/m' vs 'org_m'). Each must get its own folder, and even under one key a second model
    is probed again: neither is ever served the other's caches."""
    a, b = tiny_model("llama", seed=0)[0], tiny_model("llama", seed=7)[0]
    ids = list(range(5, 30))
    store = PrefillStore(tmp_path)
    assert store.folder("org/m@base") != store.folder("org_m@base")
    got_a = store.get(a, "org/m@base", ids)
    got_b = store.get(b, "org_m@base", ids)
    assert torch.equal(got_a.layers[0].keys, prefill(a, ids).layers[0].keys)
    assert torch.equal(got_b.layers[0].keys, prefill(b, ids).layers[0].keys)
    with pytest.warns(UserWarning, match="from another model or adapter"):
        same_key = store.get(b, "org/m@base", ids)  # one key, another model: probed, not trusted
    assert torch.equal(same_key.layers[0].keys, prefill(b, ids).layers[0].keys)
    for key in ("..", ".", "../x", "a/../../b"):
        folder = store.folder(key)
        assert folder.parent.parent == store.root and not folder.parent.name.startswith(".")


def _crafted(t):
    """Cache files of the wrong shape, dtype, length or names, built from a real one ``t``."""
    k1 = t["k1"]
    return {
        "a layer's head_dim doubled": {**t, "k1": torch.zeros(*k1.shape[:3], 2 * k1.shape[3])},
        "a layer's time axis cut": {**t, "k1": k1[:, :, :3].contiguous()},
        "batch of two": {**t, "k0": torch.cat([t["k0"]] * 2), "v0": torch.cat([t["v0"]] * 2)},
        "float16 in a float32 store": {k: v.half() if k != "length" else v for k, v in t.items()},
        "int32 keys": {k: v.to(torch.int32) if k != "length" else v for k, v in t.items()},
        "a huge declared length": {**t, "length": torch.tensor([10 ** 12])},
        "an extra tensor for a missing one": {**{k: v for k, v in t.items() if k != "v1"},
                                              "extra": torch.zeros(1)},
    }


@pytest.mark.parametrize("case", list(_crafted({f"{x}{i}": torch.zeros(1, 2, 4, 16) for x in "kv"
                                                 for i in range(3)} | {"length": torch.tensor([4])})))
def test_crafted_cache_file_is_a_miss_never_served(models, tmp_path, case):
    """Attack: a cache file in the store's folder replaced by one of the wrong shape, dtype,
    declared length or tensor names. It is recomputed (a miss) and rewritten, never served."""
    import hashlib

    from safetensors.torch import load, save

    recv = models["llama"][0]
    ids = _examples(models)[0].receiver_prompt_ids
    PrefillStore(tmp_path).get(recv, "m", ids)
    digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
    path = PrefillStore(tmp_path).folder("m") / f"{digest}.safetensors"
    path.write_bytes(save(_crafted(load(path.read_bytes()))[case]))
    store = PrefillStore(tmp_path)
    got = store.get(recv, "m", ids)
    fresh = prefill(recv, ids)
    assert (store.hits, store.misses) == (0, 1)
    assert all(x.keys.shape == y.keys.shape and torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
               for x, y in zip(got.layers, fresh.layers))
    again = PrefillStore(tmp_path)
    again.get(recv, "m", ids)
    assert (again.hits, again.misses) == (1, 0)  # the rewritten file is served next time


def test_crafted_cache_file_of_a_sliding_window_model_is_checked_per_layer(tmp_path):
    """Gemma 3's sliding layers hold the last window - 1 tokens: a file whose sliding layer
    holds the whole prompt (or a full layer only the window) is a miss."""
    import hashlib

    from safetensors.torch import load, save

    model = tiny_model("gemma3_text", seed=2)[0]
    window = model.config.sliding_window
    ids = list(range(3, 3 + window + 10))
    store = PrefillStore(tmp_path)
    store.get(model, "g", ids)
    digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
    path = store.folder("g") / f"{digest}.safetensors"
    t = load(path.read_bytes())
    assert t["k0"].shape[2] == window - 1 and t[f"k{len(t) // 2 - 1}"].shape[2] == len(ids)
    last = len(t) // 2 - 1
    path.write_bytes(save({**t, f"k{last}": t[f"k{last}"][:, :, -(window - 1):].contiguous(),
                           f"v{last}": t[f"v{last}"][:, :, -(window - 1):].contiguous()}))
    again = PrefillStore(tmp_path)
    got = again.get(model, "g", ids)
    assert (again.hits, again.misses) == (0, 1)
    assert got.layers[last].keys.shape[2] == len(ids)


def test_resume_refuses_a_checkpoint_of_another_schedule_or_data(models, tmp_path):
    """A checkpoint of a run with another step count (another temperature schedule), learning
    rate, optimiser setting or training set is refused, not resumed into a different run."""
    recv, share = models["llama"][0], models["qwen2"][0]
    examples = _examples(models)
    kw = dict(batch_size=2, lr=1e-2, seed=2, progress=False, checkpoint_dir=tmp_path, steps=6)
    train_fuser(_fuser(recv, share, randomize=False), recv, share, examples, until=3, **kw)
    for change, what in ((dict(steps=8), "steps"), (dict(lr=2e-2), "lr"), (dict(weight_decay=0.1), "weight_decay"),
                         (dict(max_grad_norm=0.5), "max_grad_norm")):
        with pytest.raises(ValueError, match=what):
            train_fuser(_fuser(recv, share, randomize=False), recv, share, examples, **{**kw, **change})
    with pytest.raises(ValueError, match="examples"):
        train_fuser(_fuser(recv, share, randomize=False), recv, share, examples[1:] + examples[:1], **kw)
    out = train_fuser(_fuser(recv, share, randomize=False), recv, share, examples, **kw)
    assert out["resumed_from"] == 3 and len(out["losses"]) == 6


def test_pair_examples_are_kept_and_keyed_by_rows_tokenizers_and_length(models, tmp_path, monkeypatch):
    """The tokenizations and alignments are built once: the second call reads the file (the
    builder is not called); other rows, another tokenizer or another max_seq_len build anew;
    a torn file is rebuilt."""
    from edgefuse.c2c import prefill as prefill_mod

    (_, rtok), (_, qtok), (_, gtok) = models["llama"], models["qwen2"], models["gemma3_text"]
    store = PrefillStore(tmp_path)
    first = store.pair_examples(VARIED, rtok, qtok, 256)
    assert first == build_pair_examples(VARIED, rtok, qtok, 256)
    calls = []
    real = prefill_mod.build_pair_examples
    monkeypatch.setattr(prefill_mod, "build_pair_examples", lambda *a: calls.append(a) or real(*a))
    assert store.pair_examples(VARIED, rtok, qtok, 256) == first and calls == []
    store.pair_examples(VARIED[:3], rtok, qtok, 256)
    store.pair_examples(VARIED, rtok, gtok, 256)
    store.pair_examples(VARIED, rtok, qtok, 64)
    assert len(calls) == 3 and len(list((tmp_path / "examples").glob("*.json"))) == 4
    for f in (tmp_path / "examples").glob("*.json"):
        f.write_text('[{"receiver_prompt_ids": 1}]')
    assert store.pair_examples(VARIED, rtok, qtok, 256) == first and len(calls) == 4


def test_a_cache_file_larger_than_its_cache_is_never_read(models, tmp_path, monkeypatch):
    """Attack: a (sparse) 1 GiB file in place of a prompt's cache. It is recomputed without
    being read into memory (its size is checked against the cache's first)."""
    import hashlib
    from pathlib import Path

    recv = models["llama"][0]
    ids = _examples(models)[0].receiver_prompt_ids
    PrefillStore(tmp_path).get(recv, "m", ids)
    digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
    path = PrefillStore(tmp_path).folder("m") / f"{digest}.safetensors"
    with open(path, "r+b") as f:
        f.truncate(1 << 30)
    read = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or real(self))
    store = PrefillStore(tmp_path)
    got = store.get(recv, "m", ids)
    assert path.name not in read and (store.hits, store.misses) == (0, 1)
    assert torch.equal(got.layers[0].keys, prefill(recv, ids).layers[0].keys)
    assert path.stat().st_size < 1 << 20  # rewritten
