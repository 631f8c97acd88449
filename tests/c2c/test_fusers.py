"""C2C fusers: layer mapping, token alignment, gathering, fuser shapes, exactness, gradients.

All on the tiny random-weight llama / gemma3_text / qwen2 models (3 / 6 / 2 layers; gemma3
has sliding-window layers with window 16, so its sliding caches keep 15 of a 24-token prompt).
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from edgefuse.models import tiny_model, tiny_tokenizer
from edgefuse.c2c import (
    C2CFuser,
    FuserConfig,
    KVSpec,
    align_formatted,
    align_spans,
    align_tokens,
    format_size_table,
    fused_forward,
    fuser_size,
    fuser_size_table,
    gather_aligned,
    kv_spec_from_cache,
    kv_spec_from_config,
    layer_mapping,
)
from edgefuse.c2c.fuser import REAL_SPECS

ARCHS = ("llama", "gemma3_text", "qwen2")
PAIRS = list(itertools.permutations(ARCHS, 2))
PROMPT_LEN = 24  # > gemma3's window of 16: its sliding layers keep only the last 15 tokens


# ---------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def tiny():
    """{arch: (model, tokenizer, prompt cache)} for one 24-token prompt, models frozen (one
    tokenizer for all: the prompt's ids feed every model)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        model, tok = tiny_model(arch, seed=i, tokenizer="bpe")
        model.requires_grad_(False)
        out[arch] = (model, tok)
    ids = prompt_ids(out["llama"][1])
    return {a: (m, t, prefill(m, ids)) for a, (m, t) in out.items()}


def prompt_ids(tok, n=PROMPT_LEN):
    text = ("The quick brown fox jumps over the lazy dog. Federated learning trains a model "
            "across devices without sharing their data. Instruction: answer the question.")
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :n]
    assert ids.shape[1] == n
    return ids


def prefill(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=True).cache


def make_fuser(recv, share, seed=0, randomize=True, **cfg):
    """A fuser for tiny models ``recv`` <- ``share``; ``randomize``: nonzero projections."""
    fuser = C2CFuser(kv_spec_from_config(recv.config), kv_spec_from_config(share.config), FuserConfig(**cfg))
    if randomize:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in fuser.layers.values():
                for branch in (layer.key, layer.value):
                    branch.up.weight.copy_(torch.randn(branch.up.weight.shape, generator=g) * 0.5)
                    branch.up.bias.copy_(torch.randn(branch.up.bias.shape, generator=g) * 0.5)
    return fuser.eval()


def unchanged_positions(a, b):
    """[T] bool per position: keys and values equal in every batch row and head."""
    same_k = (a.keys == b.keys).all(dim=(0, 1, 3))
    same_v = (a.values == b.values).all(dim=(0, 1, 3))
    return same_k & same_v


def char_tokenizer(chars):
    """A character-level fast tokenizer (WordLevel over single characters), unlike tiny BPE."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(sorted(set(chars)))}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")


CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ #:\n.<|>"


# ---------------------------------------------------------------- layer mapping


def test_layer_mapping_hand_checked():
    assert layer_mapping(6, 3) == [None, None, None, 0, 1, 2]
    assert layer_mapping(3, 6) == [3, 4, 5]
    assert layer_mapping(4, 4) == [0, 1, 2, 3]
    assert layer_mapping(30, 18)[:12] == [None] * 12 and layer_mapping(30, 18)[12:] == list(range(18))
    assert layer_mapping(6, 3, "first_aligned") == [0, 1, 2, None, None, None]
    assert layer_mapping(3, 6, "first_aligned") == [0, 1, 2]
    # round(i * (n_s - 1) / (n_r - 1)): 3 <- 6: 0, 2.5 -> 2, 5; 6 <- 3: 0, .4, .8, 1.2, 1.6, 2
    assert layer_mapping(3, 6, "proportional") == [0, 2, 5]
    assert layer_mapping(6, 3, "proportional") == [0, 0, 1, 1, 2, 2]
    assert layer_mapping(1, 4, "proportional") == [3]


def test_layer_mapping_errors():
    with pytest.raises(ValueError, match="last_aligned, first_aligned, proportional"):
        layer_mapping(3, 3, "diagonal")
    with pytest.raises(ValueError, match=">= 1"):
        layer_mapping(0, 3)


# ---------------------------------------------------------------- token alignment


def test_align_tokens_bpe_vs_char():
    bpe, ch = tiny_tokenizer(), char_tokenizer(CHARS)
    text = "The quick brown foxes"  # bpe: The | Ġquick | Ġbrown | Ġfox | es ; char: one per char
    assert bpe.convert_ids_to_tokens(bpe(text, add_special_tokens=False).input_ids) == \
        ["The", "Ġquick", "Ġbrown", "Ġfox", "es"]
    # receiver = BPE: each token -> the characters it covers; the space glued to a word
    # is trimmed, so the char-level space tokens (3, 9, 15) belong to no BPE word.
    assert align_tokens(text, bpe, ch) == [[0, 1, 2], [4, 5, 6, 7, 8], [10, 11, 12, 13, 14],
                                           [16, 17, 18], [19, 20]]
    # receiver = chars: "foxes" splits over two BPE tokens; a space maps to the BPE token
    # that holds it (" quick" -> 1).
    assert align_tokens(text, ch, bpe) == [[0]] * 3 + [[1]] * 6 + [[2]] * 6 + [[3]] * 4 + [[4]] * 2
    assert align_tokens("fox", bpe, ch) == [[0, 1], [2]]  # bpe: "fo" | "x"


def test_align_formatted_skips_template_tokens():
    bpe, ch = tiny_tokenizer(), char_tokenizer(CHARS)
    content = "The quick brown foxes"
    r_text = bpe.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                     add_generation_prompt=True)
    s_text = "### Instruction:\n" + content + "\n### Response:\n"
    assert r_text == "<|user|>The quick brown foxes<|end|><|assistant|>"
    base = s_text.find(content)  # 17
    got = align_formatted(r_text, s_text, content, bpe, ch)
    # <|user|> | The | Ġquick | Ġbrown | Ġfox | es | <|end|> | <|assistant|>
    assert got == [[], [base + i for i in (0, 1, 2)], [base + i for i in range(4, 9)],
                   [base + i for i in range(10, 15)], [base + i for i in (16, 17, 18)],
                   [base + 19, base + 20], [], []]
    # the other way: template characters map to nothing, content characters to BPE tokens
    back = align_formatted(s_text, r_text, content, ch, bpe)
    assert len(back) == len(s_text)
    assert back[:base] == [[]] * base and back[base + len(content):] == [[]] * (len(s_text) - base - len(content))
    assert back[base:base + len(content)] == [[1]] * 3 + [[2]] * 6 + [[3]] * 6 + [[4]] * 4 + [[5]] * 2
    assert align_spans(r_text, (8, 29), s_text, (base, base + 21), bpe, ch) == got


def test_align_formatted_errors():
    bpe, ch = tiny_tokenizer(), char_tokenizer(CHARS)
    with pytest.raises(ValueError, match="not found in the formatted sharer"):
        align_formatted("<|user|>hello fox", "### hello dog", "hello fox", bpe, ch)
    with pytest.raises(ValueError, match="different text"):
        align_spans("abc", (0, 2), "abd", (1, 3), bpe, ch)


def test_gather_aligned_hand_values():
    kv = torch.tensor([[t, 10.0 * t] for t in range(4)]).view(1, 1, 4, 2)  # token t: [t, 10t]
    mapping = [[0, 2], [], [3], [1, 2, 3]]
    first, mask = gather_aligned(kv, mapping, "first")
    last, _ = gather_aligned(kv, mapping, "last")
    mean, _ = gather_aligned(kv, mapping, "mean")
    assert mask.tolist() == [True, False, True, True]
    assert first[0, 0].tolist() == [[0, 0], [0, 0], [3, 30], [1, 10]]
    assert last[0, 0].tolist() == [[2, 20], [0, 0], [3, 30], [3, 30]]
    assert torch.allclose(mean[0, 0], torch.tensor([[1.0, 10], [0, 0], [3, 30], [2, 20]]))
    assert first.shape == (1, 1, 4, 2)
    with pytest.raises(ValueError, match="first, last, mean"):
        gather_aligned(kv, mapping, "max")
    with pytest.raises(ValueError, match="outside"):
        gather_aligned(kv, [[4]], "first")


# ---------------------------------------------------------------- specs and config


def test_kv_specs_of_tiny_models(tiny):
    g = kv_spec_from_config(tiny["gemma3_text"][0].config)
    assert (g.num_layers, g.kv_heads, g.head_dim) == (6, [1] * 6, [32] * 6)
    assert g.sliding == [True] * 5 + [False] and g.sliding_window == 16
    ll = kv_spec_from_config(tiny["llama"][0].config)
    q = kv_spec_from_config(tiny["qwen2"][0].config)  # no config.head_dim: 64 hidden / 4 heads
    assert (ll.num_layers, ll.kv_heads, ll.head_dim, ll.sliding) == (3, [2] * 3, [16] * 3, [False] * 3)
    assert (q.num_layers, q.kv_heads, q.head_dim) == (2, [2, 2], [16, 16])
    for arch in ARCHS:
        assert kv_spec_from_cache(tiny[arch][2]) == kv_spec_from_config(tiny[arch][0].config)


def test_config_round_trip_and_validation():
    cfg = FuserConfig(bottleneck=32, reduction="last", gate_init=1.5)
    assert FuserConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown FuserConfig keys"):
        FuserConfig.from_dict({"bottleneck": 8, "rank": 4})
    with pytest.raises(ValueError, match="reduction"):
        FuserConfig(reduction="sum")
    with pytest.raises(ValueError, match="temperature"):
        FuserConfig(init_temperature=0.1, min_temperature=1.0)
    spec = KVSpec.uniform(3, 2, 16)
    assert KVSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="entries"):
        KVSpec(3, [2, 2], [16, 16, 16])


# ---------------------------------------------------------------- fuser on caches


@pytest.mark.parametrize("recv,share", PAIRS)
def test_fused_cache_shapes_every_pair(tiny, recv, share):
    r_model, _, r_cache = tiny[recv]
    s_model, _, s_cache = tiny[share]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in r_cache.layers]
    fuser = make_fuser(r_model, s_model, gate_init=10.0)
    fused = fuser(r_cache, s_cache)
    assert fused is not r_cache and len(fused.layers) == len(r_cache.layers)
    for i, (f, r) in enumerate(zip(fused.layers, r_cache.layers)):
        assert type(f) is type(r) and f is not r
        assert f.keys.shape == r.keys.shape and f.values.shape == r.values.shape, i
        assert f.get_seq_length() == r.get_seq_length() == PROMPT_LEN
        fused_here = fuser.layer_map[i] is not None
        assert (not torch.equal(f.keys, r.keys)) == fused_here, i
    # the receiver's own cache is untouched
    for (k, v), layer in zip(before, r_cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    if recv == "gemma3_text":
        assert [f.keys.shape[2] for f in fused.layers] == [15] * 5 + [PROMPT_LEN]


@pytest.mark.parametrize("recv,share", [("gemma3_text", "llama"), ("llama", "gemma3_text"), ("qwen2", "llama")])
def test_hard_gate_off_is_exactly_the_receiver(tiny, recv, share):
    r_model, tok, r_cache = tiny[recv]
    s_model, _, s_cache = tiny[share]
    fuser = make_fuser(r_model, s_model, gate_init=-10.0)  # nonzero projections, gate off
    fused = fuser(r_cache, s_cache)
    for f, r in zip(fused.layers, r_cache.layers):
        assert torch.equal(f.keys, r.keys) and torch.equal(f.values, r.values)
    cont = tok("jumps over", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        got = fused_forward(r_model, fused, cont)
        alone = r_model(cont, cache=copy.deepcopy(r_cache)).logits
        full = r_model(torch.cat([prompt_ids(tok), cont], dim=1)).logits[:, -cont.shape[1]:]
    assert torch.equal(got, alone)
    assert torch.allclose(got, full, atol=1e-5)
    assert fused.get_seq_length() == PROMPT_LEN  # fused_forward copied, did not grow it


@pytest.mark.parametrize("recv,share", PAIRS)
def test_untrained_fuser_changes_nothing(tiny, recv, share):
    r_model, _, r_cache = tiny[recv]
    s_model, _, s_cache = tiny[share]
    fuser = make_fuser(r_model, s_model, randomize=False, gate_init=10.0)  # zero-init projection, gate on
    fused = fuser(r_cache, s_cache)
    for f, r in zip(fused.layers, r_cache.layers):
        assert torch.equal(f.keys, r.keys) and torch.equal(f.values, r.values)


def test_changes_only_masked_in_tokens(tiny):
    r_model, _, r_cache = tiny["llama"]
    s_model, _, s_cache = tiny["qwen2"]
    fuser = make_fuser(r_model, s_model, gate_init=10.0)
    mapping = [[t] for t in range(PROMPT_LEN)]
    mapping[2], mapping[5] = [], []             # no sharer token
    mapping[9] = [8, 9, 10]                     # several sharer tokens
    mask = torch.ones(PROMPT_LEN, dtype=torch.bool)
    mask[7] = False                             # masked out by the caller
    fused = fuser(r_cache, s_cache, mapping, mask)
    expect_same = torch.zeros(PROMPT_LEN, dtype=torch.bool)
    expect_same[[2, 5, 7]] = True
    for i, (f, r) in enumerate(zip(fused.layers, r_cache.layers)):
        if fuser.layer_map[i] is None:          # llama 3 <- qwen2 2: layer 0 not fused
            assert torch.equal(f.keys, r.keys)
            continue
        assert torch.equal(unchanged_positions(f, r), expect_same), i


def test_sliding_layers_fuse_the_overlap_from_the_end(tiny):
    # receiver llama (full, 24) <- sharer gemma3: layers 0, 1 read gemma3 sliding layers 3, 4
    # (last 15 prompt tokens, i.e. 9..23), layer 2 reads the full layer 5.
    r_model, _, r_cache = tiny["llama"]
    s_model, _, s_cache = tiny["gemma3_text"]
    fuser = make_fuser(r_model, s_model, gate_init=10.0)
    assert fuser.layer_map == [3, 4, 5]
    fused = fuser(r_cache, s_cache)
    out_of_window = torch.arange(PROMPT_LEN) < PROMPT_LEN - 15
    for i in (0, 1):
        assert torch.equal(unchanged_positions(fused.layers[i], r_cache.layers[i]), out_of_window)
    assert not unchanged_positions(fused.layers[2], r_cache.layers[2]).any()
    # receiver gemma3 <- llama: gemma3 sliding layers 3, 4 fuse all 15 cached slots, the
    # full layer 5 all 24; layers 0-2 have no sharer layer.
    r_model, tok, r_cache = tiny["gemma3_text"]
    fuser = make_fuser(r_model, tiny["llama"][0], gate_init=10.0)
    fused = fuser(r_cache, tiny["llama"][2])
    for i, layer in enumerate(fused.layers):
        same = unchanged_positions(layer, r_cache.layers[i])
        assert same.all() if i < 3 else not same.any(), i
    # decoding continues after the fused sliding cache (window bookkeeping intact)
    cont = tok("over the", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = fused_forward(r_model, fused, cont)
    assert logits.shape == (1, cont.shape[1], r_model.config.vocab_size) and torch.isfinite(logits).all()


def test_mismatches_raise(tiny):
    r_model, tok, r_cache = tiny["llama"]
    s_model, _, s_cache = tiny["qwen2"]
    fuser = make_fuser(r_model, s_model)
    short = prefill(s_model, prompt_ids(tok)[:, :10])
    with pytest.raises(ValueError, match="sequence lengths differ"):
        fuser(r_cache, short)
    batch2 = prefill(s_model, prompt_ids(tok).repeat(2, 1))
    with pytest.raises(ValueError, match="batch sizes differ"):
        fuser(r_cache, batch2)
    with pytest.raises(ValueError, match="mapping has 3 entries"):
        fuser(r_cache, s_cache, [[0], [1], [2]])
    with pytest.raises(ValueError, match="outside the sharer prompt"):
        fuser(r_cache, short, [[t] for t in range(PROMPT_LEN)])
    with pytest.raises(ValueError, match="mask must be"):
        fuser(r_cache, s_cache, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="receiver cache has 2 layers"):
        fuser(s_cache, s_cache)
    # a token mapping makes different prompt lengths fine
    fused = fuser(r_cache, short, [[t % 10] for t in range(PROMPT_LEN)])
    assert fused.layers[-1].keys.shape == r_cache.layers[-1].keys.shape


# ---------------------------------------------------------------- size, annealing, gradients


def test_fuser_size_at_most_ten_percent_of_receiver(capsys):
    rows = fuser_size_table(FuserConfig(bottleneck=64))
    assert len(rows) == 6
    with capsys.disabled():
        print("\nC2C fuser sizes, bottleneck 64 (float32):\n" + format_size_table(rows))
    for row in rows:
        assert row["ratio"] <= 0.10, row
        assert row["bytes"] == 4 * row["params"]
    # the closed form agrees with a built fuser (SmolLM2 <- Gemma3: 18 fused layers)
    r, s = REAL_SPECS["smollm2-135m"][0], REAL_SPECS["gemma3-270m"][0]
    fuser = C2CFuser(r, s, FuserConfig(bottleneck=64))
    assert len(fuser.layers) == 18
    assert fuser.num_parameters() == fuser_size(r, s) == rows[0]["params"]
    # per layer and branch: (192+256)*64+64 + 64*192+192 + 64*3+3 + 1 = 41412
    assert fuser.num_parameters() == 18 * 2 * 41412
    assert fuser.nbytes() == 4 * fuser.num_parameters()


def test_anneal_is_monotonic_from_init_to_min():
    fuser = C2CFuser(KVSpec.uniform(2, 1, 8), KVSpec.uniform(2, 1, 8),
                     FuserConfig(init_temperature=2.0, min_temperature=0.1))
    assert fuser.temperature == 2.0
    temps = [fuser.anneal(s, 50) for s in range(51)]
    assert temps[0] == pytest.approx(2.0) and temps[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(temps, temps[1:]))
    assert temps[25] == pytest.approx((2.0 * 0.1) ** 0.5)  # geometric midpoint
    assert fuser.anneal(80, 50) == pytest.approx(0.1) and fuser.temperature == pytest.approx(0.1)


def test_gumbel_gate_training_vs_inference():
    fuser = C2CFuser(KVSpec.uniform(1, 1, 4), KVSpec.uniform(1, 1, 4), FuserConfig(gate_init=0.5))
    branch = fuser.layers["0"].key
    fuser.eval()
    assert branch.gate(1.0).item() == 1.0
    fuser.train()
    torch.manual_seed(0)
    samples = torch.stack([branch.gate(1.0) for _ in range(200)])
    assert ((samples > 0) & (samples < 1)).all() and samples.std() > 0.1
    with torch.no_grad():
        branch.gate_logit.fill_(-8.0)
    assert torch.stack([branch.gate(0.1) for _ in range(50)]).max() < 1e-3


def test_backward_reaches_only_fuser_params(tiny):
    r_model, tok, r_cache = tiny["llama"]
    s_model, _, s_cache = tiny["gemma3_text"]
    fuser = make_fuser(r_model, s_model).train()
    fuser.anneal(0, 10)
    cont = tok(" jumps over the dog", return_tensors="pt", add_special_tokens=False).input_ids
    logits = fused_forward(r_model, fuser(r_cache, s_cache), cont[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), cont[:, 1:].flatten())
    loss.backward()
    for model in (r_model, s_model):
        assert all(p.grad is None for p in model.parameters())
    for name, p in fuser.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    for layer in r_cache.layers:  # the prefill cache never joined the graph
        assert not layer.keys.requires_grad

    # zero-init (untrained) fuser: the projection's output layer is where learning starts
    fresh = make_fuser(r_model, s_model, randomize=False).train()
    logits = fused_forward(r_model, fresh(r_cache, s_cache), cont[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), cont[:, 1:].flatten()).backward()
    assert all(layer.key.up.weight.grad.abs().sum() > 0 for layer in fresh.layers.values())
