"""Vocabulary masks, the mask bitmap, the masked partial-logit codec and the split head's
fusion (``edgefuse.cloud.vocab``). The head math runs on a tiny random head ``W [V, D]``:
``z_end = h[:, :s] @ W[:, :s].T`` on the device, ``z_cloud = h[:, s:] @ W[:, s:].T`` on the
cloud."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefuse.cloud import vocab as Vb
from edgefuse.cloud.split import head_tail, partial_logits
from edgefuse.models import load_tokenizer, tiny_tokenizer

V, D, S_COLS = 96, 32, 12


def head(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g)


def split_logits(W, h, s=S_COLS):
    """``(z_end [n, V], z_cloud [n, V], z [n, V])`` of hidden states ``h [n, D]``: the
    device's columns by a plain matmul, the cloud's through ``edgefuse.cloud.split``."""
    return h[:, :s] @ W[:, :s].T, partial_logits(head_tail(W, s), h[:, s:]), h @ W.T


# ------------------------------------------------------------------------------ fusion

def test_greedy_over_fused_logits_never_emits_a_masked_token():
    """A toy recurrent LM (next hidden = tanh of the last token's embedding + a drift)
    decoded greedily over the split head: the mask leaves out the unsplit argmax of many
    steps, yet no emitted token is outside the mask, in every codec mode."""
    W = head(1)
    g = torch.Generator().manual_seed(2)
    E, A = torch.randn(V, D, generator=g), torch.randn(D, D, generator=g) / D ** 0.5
    # the mask: half the vocabulary, without the tokens the unmasked model likes best
    z0 = torch.tanh(E) @ W.T
    favourites = set(torch.topk(z0, 3, dim=1).indices.flatten().tolist())
    rest = [i for i in range(V) if i not in favourites]
    mask = np.array(sorted(rest[::2]), dtype=np.int64)
    for k, fill in ((0, "bound"), (5, "bound"), (5, "drop")):
        tok, h_prev, outside = 0, torch.zeros(D), 0
        for _ in range(40):
            h = torch.tanh(E[tok] + A @ h_prev)[None]
            z_end, z_cloud, z = split_logits(W, h)
            outside += int(int(z.argmax()) not in set(mask.tolist()))
            got = Vb.decode_masked(Vb.encode_masked(z_cloud[:, mask], k), 1, mask.size, k)
            fused = Vb.fuse_split_head(z_end, got, mask, fill=fill)
            tok, h_prev = int(fused.argmax()), h[0]
            assert tok in set(mask.tolist()), (k, fill, tok)
            assert torch.isinf(fused[0, np.setdiff1d(np.arange(V), mask)]).all()
        assert outside >= 10, outside  # the case the test is about did occur


def test_full_mask_fusion_equals_unsplit_logits():
    W = head(3)
    h = torch.randn(16, D, generator=torch.Generator().manual_seed(4))
    z_end, z_cloud, z = split_logits(W, h)
    full = np.arange(V)
    fused = Vb.fuse_split_head(z_end, z_cloud, full)
    assert torch.allclose(fused, z, atol=1e-5)
    # masked, exact: the argmax over the mask of the unsplit logits
    mask = np.arange(0, V, 3)
    fused = Vb.fuse_split_head(z_end, z_cloud[:, mask], mask)
    assert torch.equal(fused.argmax(1), torch.from_numpy(mask)[z[:, mask].argmax(1)])
    # 8-bit: within the quantization bound of the exact masked logits
    got = Vb.decode_masked(Vb.encode_masked(z_cloud[:, mask], 0), 16, mask.size, 0)
    q = Vb.fuse_split_head(z_end, got, mask)[:, mask]
    assert (q - z[:, mask]).abs().max() <= float(got.scale.max()) / 2 + 1e-4


def test_softcap_applies_inside_the_mask_only():
    W = head(5)
    h = torch.randn(4, D, generator=torch.Generator().manual_seed(6))
    z_end, z_cloud, z = split_logits(W, h)
    mask = np.arange(10, 60)
    fused = Vb.fuse_split_head(z_end, z_cloud[:, mask], mask, softcap=3.0)
    assert torch.allclose(fused[:, mask], 3.0 * torch.tanh(z[:, mask] / 3.0), atol=1e-5)
    assert torch.isinf(fused[:, :10]).all() and (fused[:, :10] < 0).all()


def _topk_cases(n=400, seed=7):
    W = head(seed)
    h = torch.randn(n, D, generator=torch.Generator().manual_seed(seed + 1))
    z_end, z_cloud, z = split_logits(W, h, s=D // 2)
    mask = np.arange(0, V, 2)
    return z_end, z_cloud[:, mask], z[:, mask], mask


@pytest.mark.parametrize("k", [4, 12])
def test_topk_drop_equals_full_mask_when_the_true_argmax_is_in_the_topk(k):
    z_end, zc, zm, mask = _topk_cases()
    true = zm.argmax(1)  # position in the mask
    in_topk = (torch.topk(zc, k, dim=1).indices == true[:, None]).any(1)
    assert 0 < int(in_topk.sum()) < len(true)  # both kinds of row occur
    full = Vb.fuse_split_head(z_end, zc, mask).argmax(1)
    drop = Vb.fuse_split_head(z_end, zc, mask, k=k, fill="drop").argmax(1)
    assert torch.equal(drop[in_topk], full[in_topk])
    assert not torch.equal(drop[~in_topk], full[~in_topk])  # elsewhere it may not


@pytest.mark.parametrize("k", [4, 12])
def test_topk_bound_is_exact_when_its_argmax_is_a_returned_token(k):
    """``fill="bound"`` scores every unsent token at or above its true fused logit, so an
    argmax among the returned tokens is the exact masked argmax."""
    z_end, zc, zm, mask = _topk_cases()
    top = torch.topk(zc, k, dim=1).indices
    bound = Vb.fuse_split_head(z_end, zc, mask, k=k)
    assert (bound[:, mask] >= zm - 1e-5).all()  # an upper bound everywhere on the mask
    pos = torch.searchsorted(torch.from_numpy(mask), bound.argmax(1))
    returned = (top == pos[:, None]).any(1)
    full = Vb.fuse_split_head(z_end, zc, mask).argmax(1)
    assert 0 < int(returned.sum()) < len(pos)
    assert torch.equal(bound.argmax(1)[returned], full[returned])


def test_topk_through_the_codec_agrees_with_the_dense_topk():
    z_end, zc, zm, mask = _topk_cases(n=64)
    got = Vb.decode_masked(Vb.encode_masked(zc, 8), 64, mask.size, 8)
    want = Vb.fuse_split_head(z_end, zc, mask, k=8, fill="drop")
    fused = Vb.fuse_split_head(z_end, got, mask, fill="drop")
    assert torch.equal(torch.isinf(fused), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert (fused[finite] - want[finite]).abs().max() <= float(got.scale.max()) / 2 + 1e-4


def test_fusion_refuses_mismatched_inputs():
    z_end, zc, _, mask = _topk_cases(n=4)
    got = Vb.decode_masked(Vb.encode_masked(zc, 3), 4, mask.size, 3)
    with pytest.raises(ValueError, match="does not match the cloud's top-3"):
        Vb.fuse_split_head(z_end, got, mask, k=5)
    with pytest.raises(ValueError, match="do not match"):
        Vb.fuse_split_head(z_end[:3], got, mask)
    with pytest.raises(ValueError, match="do not match"):
        Vb.fuse_split_head(z_end, got, mask[:-1])
    with pytest.raises(ValueError, match="shape"):
        Vb.fuse_split_head(z_end, zc[:, :-1], mask)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Vb.fuse_split_head(z_end, zc, mask + 2)
    with pytest.raises(ValueError, match="exceeds"):
        Vb.fuse_split_head(z_end, zc, mask, k=mask.size + 1)
    with pytest.raises(ValueError, match="unknown fill"):
        Vb.fuse_split_head(z_end, zc, mask, fill="zero")


# ------------------------------------------------------------------------------ masks

EDGE_AND_TARGET = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


@pytest.mark.integration
@pytest.mark.parametrize("name", EDGE_AND_TARGET)
def test_named_masks_on_real_tokenizers(name):
    """Tokenizers only, from the model cache: every mask holds EOS; ``english`` holds no
    token with a non-ASCII character, a common English word, no CJK token; english ⊂ ascii
    ⊂ full; cached per tokenizer."""
    tok = load_tokenizer(name)
    n = len(tok)
    eng, asc, full = (Vb.vocab_mask(tok, m) for m in ("english", "ascii", "full"))
    assert tok.eos_token_id in eng and tok.eos_token_id in asc and tok.eos_token_id in full
    assert np.array_equal(full, np.arange(n))
    assert set(eng) < set(asc) < set(full)
    specials = set(Vb.special_ids(tok))
    texts = tok.batch_decode([[int(i)] for i in eng if int(i) not in specials])
    assert not [t for t in texts if any(ord(c) > 127 for c in t)]
    assert not [t for t in texts if set(t) & set("{}<>|\\^`~_")]
    word = tok.encode(" the", add_special_tokens=False)
    assert len(word) == 1 and word[0] in eng
    cjk = tok.encode("的", add_special_tokens=False)
    assert not set(cjk) & set(eng) and not set(cjk) & set(asc)
    brace = tok.encode("{", add_special_tokens=False)
    assert len(brace) == 1 and brace[0] in asc and brace[0] not in eng
    assert 0.2 * n < eng.size < asc.size < n  # SmolLM2 is nearly all ASCII
    again = Vb.vocab_mask(tok, "english")
    again[0] = -1  # the caller's own copy: the cached mask is untouched
    assert np.array_equal(Vb.vocab_mask(tok, "english"), eng)


def test_masks_of_a_tiny_tokenizer_and_bad_names():
    tok = tiny_tokenizer()
    eng = Vb.vocab_mask(tok, "english")
    assert tok.eos_token_id in eng and tok.pad_token_id in eng
    ex = Vb.vocab_mask(tok, Vb.EXPLICIT, ids=[40, 41, 41, 300])
    assert ex.tolist() == sorted({40, 41, 300, *Vb.special_ids(tok)})
    assert Vb.vocab_mask(tok, "full", vocab_size=len(tok) + 8).size == len(tok) + 8
    assert Vb.vocab_mask(tok, "ascii", vocab_size=100).max() < 100
    with pytest.raises(ValueError, match="unknown vocabulary mask 'latin'"):
        Vb.vocab_mask(tok, "latin")
    with pytest.raises(ValueError, match="needs its ids"):
        Vb.vocab_mask(tok, Vb.EXPLICIT)
    with pytest.raises(ValueError, match="takes no ids"):
        Vb.vocab_mask(tok, "english", ids=[1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Vb.vocab_mask(tok, Vb.EXPLICIT, ids=[len(tok)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Vb.vocab_mask(tok, Vb.EXPLICIT, ids=[-1])
    with pytest.raises(ValueError, match="special token id"):
        Vb.vocab_mask(tok, "full", vocab_size=2)


# ------------------------------------------------------------------------------ bitmap

@pytest.mark.parametrize("vocab_size", [1, 8, 1003, 151_936])
def test_bitmap_round_trip(vocab_size):
    rng = np.random.default_rng(vocab_size)
    ids = np.unique(rng.integers(0, vocab_size, size=max(1, vocab_size // 3)))
    buf = Vb.mask_to_bitmap(ids, vocab_size)
    assert len(buf) == Vb.bitmap_nbytes(vocab_size) == -(-vocab_size // 8)
    assert np.array_equal(Vb.mask_from_bitmap(buf, vocab_size), ids)
    # least significant bit first
    assert Vb.mask_to_bitmap([0], 16) == b"\x01\x00" and Vb.mask_to_bitmap([9], 16) == b"\x00\x02"


def test_bitmap_refuses_wrong_length_padding_and_empty():
    buf = Vb.mask_to_bitmap([0, 5, 1000], 1003)  # 126 bytes, 5 padding bits
    with pytest.raises(ValueError, match="is 126 bytes, got 125"):
        Vb.mask_from_bitmap(buf[:-1], 1003)
    with pytest.raises(ValueError, match="is 126 bytes, got 127"):
        Vb.mask_from_bitmap(buf + b"\x00", 1003)
    for bit in range(3, 8):  # ids 1003 .. 1007 do not exist
        bad = buf[:-1] + bytes([buf[-1] | (1 << bit)])
        with pytest.raises(ValueError, match="padding bits"):
            Vb.mask_from_bitmap(bad, 1003)
    assert Vb.mask_from_bitmap(buf[:-1] + bytes([buf[-1] | 0b100]), 1003)[-1] == 1002  # a real id
    with pytest.raises(ValueError, match="empty"):
        Vb.mask_from_bitmap(bytes(126), 1003)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Vb.mask_to_bitmap([1003], 1003)
    with pytest.raises(ValueError, match="vocab_size"):
        Vb.mask_from_bitmap(b"", 0)


# ------------------------------------------------------------------------------ codec

def _partial(n, size, seed=0, spread=8.0):
    return torch.randn(n, size, generator=torch.Generator().manual_seed(seed)) * spread


@pytest.mark.parametrize("offset, spread", [(0.0, 0.01), (0.0, 8.0), (0.0, 3000.0), (1000.0, 0.01)])
def test_whole_subset_codec_round_trips_within_half_a_step(offset, spread):
    """Also a narrow row far from 0 (float16's step at 1000 is 0.5, far above the row's
    range): ``lo`` must be rounded down, else the row's minimum clips above its value."""
    z = _partial(7, 301, spread=spread) + offset
    z[3] = 2.7183 + offset  # a constant row
    buf = Vb.encode_masked(z, 0)
    assert len(buf) == Vb.masked_nbytes(7, 301, 0) == 7 * (4 + 301)
    got = Vb.decode_masked(buf, 7, 301, 0)
    assert got.values.shape == (7, 301) and got.idx is None and got.k == 0
    err = np.abs(got.values - z.numpy())
    assert np.all(err <= got.scale[:, None] / 2 + 1e-6 * float(z.abs().max()))
    lo = np.frombuffer(buf[:14], dtype="<f2").astype(np.float64)
    assert np.all(lo <= z.min(1).values.numpy())
    assert np.all(got.scale <= (z.max(1).values.numpy() - lo) / 255 * (1 + 2**-10) + 1e-7)


@pytest.mark.parametrize("k", [1, 16, 301])
def test_topk_codec_round_trips(k):
    z = _partial(5, 301, seed=k)
    buf = Vb.encode_masked(z, k)
    assert len(buf) == Vb.masked_nbytes(5, 301, k) == 5 * (4 + 5 * k)
    got = Vb.decode_masked(buf, 5, 301, k)
    want = torch.topk(z, k, dim=1)
    for r in range(5):
        assert set(got.idx[r].tolist()) == set(want.indices[r].tolist())
    sent = np.take_along_axis(z.numpy(), got.idx, axis=1)
    assert np.all(np.abs(got.values - sent) <= got.scale[:, None] / 2 + 1e-5)
    assert np.all(np.diff(sent, axis=1) <= 0)  # largest first


def test_downlink_accounting_for_the_default_target():
    full = Vb.full_logits_nbytes(1, 151_936)
    assert full == 151_940
    d = Vb.downlink_per_token(40_000, 0, 151_936)
    assert d == {"bytes": 40_004, "full_bytes": 151_940, "ratio": 40_004 / 151_940}
    assert Vb.downlink_per_token(40_000, 64, 151_936)["bytes"] == 4 + 64 * 5


def _patched(buf, offset, raw):
    return buf[:offset] + raw + buf[offset + len(raw):]


def test_codec_refuses_malformed_input():
    z = _partial(3, 50)
    whole, top = Vb.encode_masked(z, 0), Vb.encode_masked(z, 4)
    with pytest.raises(ValueError, match="are 162 bytes, got 161"):
        Vb.decode_masked(whole[:-1], 3, 50, 0)
    with pytest.raises(ValueError, match="got 163"):
        Vb.decode_masked(whole + b"\x00", 3, 50, 0)
    with pytest.raises(ValueError, match="got 162"):  # another row count than asked
        Vb.decode_masked(whole, 4, 50, 0)
    with pytest.raises(ValueError, match="top-k of 51 exceeds the mask's 50"):
        Vb.decode_masked(top, 3, 50, 51)
    with pytest.raises(ValueError, match="top-k of 51 exceeds"):
        Vb.encode_masked(z, 51)
    nan16 = np.array([np.nan], dtype="<f2").tobytes()
    inf16 = np.array([np.inf], dtype="<f2").tobytes()
    with pytest.raises(ValueError, match="non-finite"):
        Vb.decode_masked(_patched(whole, 2, nan16), 3, 50, 0)  # row 1's lo
    with pytest.raises(ValueError, match="non-finite"):
        Vb.decode_masked(_patched(top, 6, inf16), 3, 50, 4)  # row 0's scale
    with pytest.raises(ValueError, match="negative scale"):
        Vb.decode_masked(_patched(whole, 6, np.array([-1.0], dtype="<f2").tobytes()), 3, 50, 0)
    idx_at = 12  # 3 rows of lo + scale
    with pytest.raises(ValueError, match="index 50 outside the mask of 50"):
        Vb.decode_masked(_patched(top, idx_at + 4, np.array([50], dtype="<u4").tobytes()), 3, 50, 4)
    with pytest.raises(ValueError, match="outside the mask"):
        Vb.decode_masked(_patched(top, idx_at, np.array([2**32 - 1], dtype="<u4").tobytes()), 3, 50, 4)
    first = top[idx_at:idx_at + 4]
    with pytest.raises(ValueError, match="repeat"):
        Vb.decode_masked(_patched(top, idx_at + 4, first), 3, 50, 4)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="n must be"):
            Vb.decode_masked(whole, bad, 50, 0)
    for bad_z in (torch.full((2, 5), float("nan")), torch.tensor([[1.0, float("inf")]])):
        with pytest.raises(ValueError, match="finite"):
            Vb.encode_masked(bad_z, 0)
    with pytest.raises(ValueError, match="float16"):
        Vb.encode_masked(torch.tensor([[1e5, 0.0]]), 0)
    with pytest.raises(ValueError, match="shape"):
        Vb.encode_masked(torch.zeros(4), 0)
