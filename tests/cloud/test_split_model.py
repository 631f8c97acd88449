"""Split inference's model side on tiny random float32 models (Qwen2, Llama/SmolLM2-like and
Gemma 3 text with sliding-window layers): the split computes what the whole model computes
(prefill, cached decoding, greedy generation, rollback, batching over sessions), the
activation codec keeps its stated error bound and exact byte counts and refuses malformed
buffers, the parts share the model's storage, and a bad split is refused naming the field.

Tolerances (max |logit difference|, logits of these models are within about ±1): exact
float32 rows 1e-5 (observed 0: the parts run the very same kernels); float16 activations
1e-3 (observed ~2e-4); int8 activations 2e-2 (observed ~6e-3)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GPT2Config, LlamaConfig,
                          Qwen2Config)

from edgefuse.cloud import split as S
from edgefuse.cloud.target import batched_forward
from tests.cloud.conftest import target_greedy

V, D = 96, 64
TOL = {None: 1e-5, "float16": 1e-3, "int8": 2e-2}
# (architecture, layers, k, m): Gemma's 6 layers are 5 sliding (window 8) + 1 full; its
# logit soft-cap is 2 (not 30) so that a missing cap shows at these logit sizes
ARCHS = [("qwen2", 5, 2, 2), ("llama", 5, 1, 1), ("gemma3_text", 6, 2, 1)]
IDS = [int(x) for x in torch.randint(3, V, (40,), generator=torch.Generator().manual_seed(7))]


@functools.lru_cache(maxsize=None)
def tiny(arch: str, layers: int):
    """A random float32 model of ``arch`` with ``layers`` decoder layers (seeded)."""
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    if arch == "qwen2":
        cfg = Qwen2Config(num_hidden_layers=layers, tie_word_embeddings=False, **common)
    elif arch == "llama":
        cfg = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=True, **common)
    else:
        cfg = Gemma3TextConfig(num_hidden_layers=layers, head_dim=32, sliding_window=8,
                               query_pre_attn_scalar=32, final_logit_softcapping=2.0,
                               **{**common, "num_key_value_heads": 1})
    return AutoModelForCausalLM.from_config(cfg).eval()


def codec(x: torch.Tensor, act: str | None) -> torch.Tensor:
    """``x`` through the wire encoding ``act`` (None: the exact float32 rows)."""
    if act is None:
        return x
    buf = S.encode_acts(x, act)
    assert len(buf) == S.acts_nbytes(x.shape[0], x.shape[1], act)
    return S.decode_acts(buf, x.shape[0], x.shape[1], act)


class Session:
    """One split session: the device's state + the cloud's middle cache (what the cloud
    service would hold), run in process."""

    def __init__(self, parts, spec, act):
        self.parts, self.dev, self.act = parts, S.DeviceSplit(parts, spec), act
        self.kv, self.cached = None, 0

    def step(self, ids: list[int]) -> torch.Tensor:
        """Front → (codec) → middle → (codec) → back → logits ``[len(ids), V]``."""
        rows = codec(self.dev.front(ids), self.act)
        (out,), (kv,) = S.middle_forward(self.parts.middle, [self.kv], [self.cached], [rows])
        self.kv, self.cached = kv, self.cached + len(ids)
        return self.dev.logits(self.dev.back(codec(out, self.act)))

    def crop(self, n: int) -> None:
        self.dev.crop(n)
        self.kv, self.cached = S.crop_layers(self.kv, n), n


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def maxdiff(a, b) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("arch,layers,k,m", ARCHS)
@pytest.mark.parametrize("act", [None, "float16", "int8"])
def test_split_equals_model_prefill_and_cached_steps(arch, layers, k, m, act):
    """Prefill of 12 ids, then 8 single-token steps with every cache (front, middle, back):
    each row's logits equal the whole model's over the same prefix, within TOL[act]. 20
    positions > Gemma's window of 8, so its sliding layers are exercised."""
    model = tiny(arch, layers)
    parts = S.split_model(model, k, m)
    sess = Session(parts, S.SplitSpec(k, m, act=act or "float16"), act)
    ref = full_logits(model, IDS[:20])
    got = [sess.step(IDS[:12])] + [sess.step([t]) for t in IDS[12:20]]
    assert maxdiff(torch.cat(got), ref) <= TOL[act]
    assert sess.dev.length == sess.dev.back_length == sess.cached == 20


@pytest.mark.parametrize("arch,layers,k,m", ARCHS + [("llama", 4, 2, 0)])
@pytest.mark.parametrize("act", [None, "float16"])
def test_split_greedy_equals_generate(arch, layers, k, m, act):
    """Greedy decoding through the split (m = 0: the back is the final norm only) gives
    exactly ``model.generate``'s greedy tokens."""
    model = tiny(arch, layers)
    sess = Session(S.split_model(model, k, m), S.SplitSpec(k, m), act)
    prompt, out = IDS[:6], []
    z = sess.step(prompt)
    for _ in range(14):
        out.append(int(z[-1].argmax()))
        z = sess.step([out[-1]])
    assert out == target_greedy(model, prompt, 14)


def test_codec_error_bounds_and_exact_sizes():
    """int8: every element within half its row's scale (the scale read back from the
    buffer); float16: within 2^-11 relative (+2^-25); byte counts exactly acts_nbytes; an
    all-zero row decodes to zeros."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 37, generator=g) * torch.logspace(-4, 3, 9).unsqueeze(1)
    x[4] = 0.0
    buf = S.encode_acts(x, "int8")
    assert len(buf) == S.acts_nbytes(9, 37, "int8") == 9 * (37 + 2)
    xh = S.decode_acts(buf, 9, 37, "int8")
    scales = torch.from_numpy(np.frombuffer(buf[:18], dtype="<f2").astype(np.float32))
    assert torch.all((x - xh).abs() <= scales.unsqueeze(1) / 2 * (1 + 1e-6) + 1e-12)
    assert torch.all(scales <= x.abs().amax(1) / 127 * (1 + 2 ** -9) + 2 ** -24)  # near-tight
    assert torch.equal(xh[4], torch.zeros(37))
    buf16 = S.encode_acts(x, "float16")
    assert len(buf16) == S.acts_nbytes(9, 37, "float16") == 2 * 9 * 37
    x16 = S.decode_acts(buf16, 9, 37, "float16")
    assert torch.all((x - x16).abs() <= x.abs() * 2 ** -11 + 2 ** -25)
    assert S.decode_acts(S.encode_acts(x[:0], "int8"), 0, 37, "int8").shape == (0, 37)
    # a numpy array (float64) encodes the same as the tensor
    assert S.encode_acts(x.double().numpy(), "int8") == buf


def test_codec_refuses_malformed_buffers():
    """Short, long, NaN / inf / negative scale, an int8 -128, a NaN float16 value, NaN or
    overflowing input, and an unknown encoding: each a ValueError saying what."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    good = S.encode_acts(x, "int8")
    cases = [
        (good[:-1], "29 bytes for 3 rows of 8 int8; expected 30"),
        (good + b"\0", "31 bytes for 3 rows of 8 int8; expected 30"),
        (np.float16(np.nan).tobytes() + good[2:], "scale is NaN, inf or negative"),
        (np.float16(np.inf).tobytes() + good[2:], "scale is NaN, inf or negative"),
        (np.float16(-0.5).tobytes() + good[2:], "scale is NaN, inf or negative"),
        (good[:6] + b"\x80" + good[7:], "int8 value below -127"),
    ]
    for buf, msg in cases:
        with pytest.raises(ValueError, match=msg):
            S.decode_acts(buf, 3, 8, "int8")
    assert torch.equal(S.decode_acts(good, 3, 8, "int8"), S.decode_acts(bytearray(good), 3, 8, "int8"))
    g16 = bytearray(S.encode_acts(x, "float16"))
    g16[4:6] = np.float16(np.nan).tobytes()
    with pytest.raises(ValueError, match="NaN or inf"):
        S.decode_acts(bytes(g16), 3, 8, "float16")
    with pytest.raises(ValueError, match="bytes"):
        S.decode_acts(bytes(g16[:-2]), 3, 8, "float16")
    with pytest.raises(ValueError, match="NaN or inf"):
        S.encode_acts(torch.tensor([[1.0, float("nan")]]), "int8")
    with pytest.raises(ValueError, match="overflows float16"):
        S.encode_acts(torch.tensor([[7e4, 1.0]]), "float16")
    with pytest.raises(ValueError, match="one of"):
        S.decode_acts(good, 3, 8, "fp8")
    with pytest.raises(ValueError, match="float \\[n, D\\]"):
        S.encode_acts(torch.zeros(8), "int8")


@pytest.mark.parametrize("arch,layers,k,m", [ARCHS[0], ARCHS[2]])
def test_split_head_sums_to_full_logits(arch, layers, k, m):
    """z_end (device, columns [:s]) + partial_logits(tail) (cloud, [s:]) = the pre-cap
    logits; soft-capped (Gemma) they are the model's logits; an id subset gives those
    columns; out-of-vocabulary ids and a session without a split head are refused."""
    model = tiny(arch, layers)
    parts = S.split_model(model, k, m)
    s = 20
    sess = Session(parts, S.SplitSpec(k, m, head_split=s), None)
    sess.step(IDS[:10])  # warm the caches: the head is checked on later rows too
    dev = sess.dev
    rows = dev.front(IDS[10:13])
    (mid,), _ = S.middle_forward(parts.middle, [sess.kv], [10], [rows])
    h = dev.back(mid)
    z_end, tail = dev.head_part(h)
    assert tail.shape == (3, D - s)
    tail_w = S.head_tail(parts.head, s)
    z = z_end + S.partial_logits(tail_w, tail)
    with torch.no_grad():
        pre = torch.nn.functional.linear(h, parts.head).float()
    assert maxdiff(z, pre) <= 1e-5
    assert maxdiff(S.softcap(z, parts.softcap), full_logits(model, IDS[:13])[10:]) <= 1e-5
    ids = [5, 0, V - 1, 17]
    assert maxdiff(S.partial_logits(tail_w, tail, ids), S.partial_logits(tail_w, tail)[:, ids]) == 0
    with pytest.raises(ValueError, match="ids must be in"):
        S.partial_logits(tail_w, tail, [V])
    with pytest.raises(ValueError, match="h_tail must be"):
        S.partial_logits(tail_w, h[:, s - 1:])
    with pytest.raises(ValueError, match="no head_split"):
        S.DeviceSplit(parts, S.SplitSpec(k, m)).head_part(h)
    if parts.softcap:  # a masked-out token stays out through the cap
        assert S.softcap(torch.tensor([-float("inf"), 0.0]), parts.softcap)[0] == -float("inf")


@pytest.mark.parametrize("arch,layers,k,m", ARCHS)
def test_rollback_equals_fresh_run(arch, layers, k, m):
    """Prompt of 9, then 5 drafted rows through front, middle and back; 2 accepted: the
    device crops to 11 and the middle cache is cropped to 11 rows (a rollback of drafted
    rows crops; only a sliding window drops). The next step equals the whole model over
    the accepted sequence, and the remembered front rows equal a fresh session's."""
    model = tiny(arch, layers)
    parts = S.split_model(model, k, m)
    sess = Session(parts, S.SplitSpec(k, m), None)
    sess.step(IDS[:9])
    drafted = [IDS[9], IDS[10], 1, 2, 3]  # two agree with the accepted sequence below
    sess.step(drafted)
    assert sess.dev.length == 14
    sess.crop(11)
    accepted = IDS[:11] + [IDS[30]]
    z = sess.step([IDS[30]])
    assert maxdiff(z, full_logits(model, accepted)[-1:]) <= 1e-5
    fresh = Session(parts, S.SplitSpec(k, m), None)
    fresh.step(accepted)
    assert maxdiff(sess.dev.front_rows(0, 12), fresh.dev.front_rows(0, 12)) <= 1e-5
    assert [kv[0].shape[2] for kv in sess.kv] == [12] * (layers - k - m)
    with pytest.raises(ValueError, match="outside"):
        sess.dev.crop(13)
    with pytest.raises(ValueError, match="outside"):
        sess.dev.front_rows(3, 13)


@pytest.mark.parametrize("arch,layers,k,m", [ARCHS[0], ARCHS[2]])
@pytest.mark.parametrize("min_rows", [1, 8])
def test_batched_middle_equals_each_alone_and_does_not_leak(arch, layers, k, m, min_rows):
    """Three sessions (3, 7 and 11 cached rows, the last rebuilt from a window at absolute
    position 5) step 1, 3 and 2 new rows in one middle forward: each equals its own forward
    alone; changing session 1's rows leaves sessions 0 and 2 bit-identical and changes 1's."""
    model = tiny(arch, layers)
    parts = S.split_model(model, k, m)
    mid = parts.middle
    g = torch.Generator().manual_seed(3)
    offsets, pasts, news = [0, 0, 5], [3, 7, 11], [1, 3, 2]
    per = []
    for off, p in zip(offsets, pasts):
        _, (kv,) = S.middle_forward(mid, [None], [0], [torch.randn(p, D, generator=g)], [off])
        per.append(kv)
    rows = [torch.randn(n, D, generator=g) for n in news]
    outs, kvs = S.middle_forward(mid, per, pasts, rows, offsets, padding=min_rows)
    for b in range(3):
        (alone,), (kv,) = S.middle_forward(mid, [per[b]], [pasts[b]], [rows[b]], [offsets[b]])
        assert outs[b].shape == (news[b], D)
        assert maxdiff(outs[b], alone) <= 1e-5
        assert all(x.shape[2] == pasts[b] + news[b] for pair in kvs[b] for x in pair)
        assert max(maxdiff(a, c) for (a, _), (c, _) in zip(kvs[b], kv)) <= 1e-5
    changed = [rows[0], torch.randn(3, D, generator=g), rows[2]]
    outs2, _ = S.middle_forward(mid, per, pasts, changed, offsets, padding=min_rows)
    assert torch.equal(outs2[0], outs[0]) and torch.equal(outs2[2], outs[2])
    assert maxdiff(outs2[1], outs[1]) > 1e-3


def test_offsets_are_absolute_positions():
    """A middle cache rebuilt at absolute position 5 and continued at 5 + 4 equals one pass
    over all 6 rows from 5; continuing it as if it started at 0 does not (positions count)."""
    parts = S.split_model(tiny("qwen2", 5), 2, 2)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(4)) * 3
    (once,), _ = S.middle_forward(parts.middle, [None], [0], [x], [5])
    _, (kv,) = S.middle_forward(parts.middle, [None], [0], [x[:4]], [5])
    (cont,), _ = S.middle_forward(parts.middle, [kv], [4], [x[4:]], [5])
    (wrong,), _ = S.middle_forward(parts.middle, [kv], [4], [x[4:]], [0])
    assert maxdiff(cont, once[4:]) <= 1e-5
    assert maxdiff(wrong, once[4:]) > 1e-4
    (pad,), (kvp,) = S.middle_forward(parts.middle, [kv], [4], [x[4:]], [5], padding=4)
    assert maxdiff(pad, cont) <= 1e-5 and kvp[0][0].shape[2] == 6  # pad rows never returned
    with pytest.raises(ValueError, match="cache 0 holds 4 positions of 1 layers; expected 3 of 1"):
        S.middle_forward(parts.middle, [kv], [3], [x[4:]])
    with pytest.raises(ValueError, match="mix token ids and embeddings"):
        batched_forward(parts.middle, [None, None], [0, 0], [[1, 2], x], 0, output="last_hidden_state")
    with pytest.raises(ValueError, match=r"input 0 must be a float tensor \[n >= 1, 64\]"):
        S.middle_forward(parts.middle, [None], [0], [x[:, :10]])


@pytest.mark.parametrize("arch,layers,k,m", ARCHS + [("llama", 4, 2, 0)])
def test_parts_share_the_models_storage(arch, layers, k, m):
    """Every parameter of the parts is one of the model's (same data_ptr, layer by layer),
    each part's layers count from 0, and the cloud side keeps only the middle and a copy of
    the head's tail columns; the device side has no middle."""
    model = tiny(arch, layers)
    body, parts = model.get_decoder(), S.split_model(model, k, m)
    ptrs = lambda mod: [p.data_ptr() for p in mod.parameters()]  # noqa: E731
    assert parts.front.embed_tokens.weight.data_ptr() == body.embed_tokens.weight.data_ptr()
    assert parts.head.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    for part, lo in ((parts.front, 0), (parts.middle, k), (parts.back, layers - m)):
        assert len(part.layers) == part.config.num_hidden_layers
        for i, layer in enumerate(part.layers):
            assert ptrs(layer) == ptrs(body.layers[lo + i])
            assert layer.self_attn.layer_idx == i
    assert ptrs(parts.back.norm) == ptrs(body.norm)
    assert parts.middle.embed_tokens is None and isinstance(parts.middle.norm, torch.nn.Identity)
    own = {p.data_ptr() for p in model.parameters()}
    for part in (parts.front, parts.middle, parts.back):
        assert {p.data_ptr() for p in part.parameters()} <= own
    if getattr(model.config, "layer_types", None) is not None:
        assert parts.middle.config.layer_types == model.config.layer_types[k:layers - m]
    dev = S.free_unused(parts, "device")
    assert dev.middle is None and dev.front is parts.front and dev.head is parts.head
    cloud = S.free_unused(parts, "cloud", head_split=16)
    assert cloud.front is cloud.back is cloud.head is None and cloud.middle is parts.middle
    assert torch.equal(cloud.tail, parts.head[:, 16:])
    assert cloud.tail.untyped_storage().data_ptr() != parts.head.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="freed"):
        S.DeviceSplit(cloud, S.SplitSpec(k, m))
    with pytest.raises(ValueError, match="side must be"):
        S.free_unused(parts, "edge")


def test_invalid_split_spec_refused_naming_the_field():
    """Each bad field of a SplitSpec (direct, against a model, and from untrusted JSON) and
    an unsupported architecture raise ValueError naming what is wrong."""
    bad = [(dict(k=0, m=1), "SplitSpec.k must be >= 1"), (dict(k=1, m=-1), "SplitSpec.m"),
           (dict(k=True, m=1), "SplitSpec.k must be an int"),
           (dict(k=1, m=1.0), "SplitSpec.m must be an int"),
           (dict(k=1, m=1, head_split=0), "SplitSpec.head_split"),
           (dict(k=1, m=1, head_split="3"), "SplitSpec.head_split"),
           (dict(k=1, m=1, act="fp8"), "SplitSpec.act"), (dict(k=1, m=1, act=None), "SplitSpec.act")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            S.SplitSpec(**kw)
    with pytest.raises(ValueError, match=r"SplitSpec.k \+ SplitSpec.m must be <= 4"):
        S.SplitSpec(3, 2).check(5, D)
    with pytest.raises(ValueError, match=r"SplitSpec.head_split must be None or in 1..63"):
        S.SplitSpec(1, 1, head_split=D).check(5, D)
    spec = S.SplitSpec(2, 1, 8, "float16")
    assert S.SplitSpec.from_dict(spec.to_dict()) == spec.check(5, D)
    assert S.SplitSpec.from_dict({"k": 2, "m": 0}) == S.SplitSpec(2, 0, None, "int8")
    for d, msg in [([2, 1], "JSON object"), ({"k": 2}, "lacks SplitSpec.m"),
                   ({"k": "2", "m": 1}, "SplitSpec.k must be an int"),
                   ({"k": 2, "m": 1, "mask": "english"}, "unknown fields")]:
        with pytest.raises(ValueError, match=msg):
            S.SplitSpec.from_dict(d)
    model = tiny("qwen2", 5)
    with pytest.raises(ValueError, match=r"SplitSpec.k \+ SplitSpec.m"):
        S.split_model(model, 3, 2)
    with pytest.raises(ValueError, match="parts were cut at k=2, m=2"):
        S.DeviceSplit(S.split_model(model, 2, 2), S.SplitSpec(1, 2))
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=V))
    with pytest.raises(ValueError, match="cannot split a 'gpt2' model .supported: qwen2, llama, gemma3"):
        S.split_model(gpt2, 1, 1)


def test_device_split_refuses_bad_calls():
    """Out-of-vocabulary ids, no ids, the back running ahead of the front, or a row of the
    wrong width: ValueError, the session unchanged."""
    parts = S.split_model(tiny("llama", 5), 1, 1)
    dev = S.DeviceSplit(parts, S.SplitSpec(1, 1))
    for ids, msg in (([V], "token ids must be in"), ([-1], "token ids must be in"), ([], "no token ids")):
        with pytest.raises(ValueError, match=msg):
            dev.front(ids)
    rows = dev.front(IDS[:3])
    with pytest.raises(ValueError, match="exceed the 3 rows"):
        dev.back(torch.zeros(4, D))
    with pytest.raises(ValueError, match=r"h must be \[n >= 1, 64\]"):
        dev.back(torch.zeros(2, D - 1))
    assert dev.length == 3 and dev.back_length == 0 and torch.equal(dev.front_rows(0, 3), rows)
