"""The decoder's split modes through the real service on a socket: ``split`` (one round trip
per token) and ``split_spec`` (a drafted block verified through the split on the device),
with a tiny random-weight 4-layer Qwen2 target and a perturbed copy of it as the device's
draft. Greedy output equals the unsplit target's (float16 rows: identical; int8: measured),
rollback of rejected drafts keeps both halves consistent, the cache tuple is honoured
(flag_cache off re-sends the window), the split head never emits a masked token, and a
cloud that dies mid-way leaves an edge-only continuation."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from edgefuse.cloud import protocol as P
from edgefuse.cloud import split as S
from edgefuse.cloud import vocab as V
from edgefuse.cloud.decoding import DecodeConfig, Decoder, EdgeLM, FullHeadDrafter
from edgefuse.cloud.decoding.config import DecodeError
from edgefuse.cloud.decoding.split import SplitDevice, SplitSettings, load_split_device
from edgefuse.cloud.link import CloudLink
from edgefuse.cloud.service import CloudService
from edgefuse.cloud.split_target import SplitTarget
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.models import tiny_tokenizer
from edgefuse.transport.wan import WanProfile
from tests.cloud.conftest import device_keys, perturbed_copy, service_keys, target_greedy

PROMPTS = [[5, 17, 33, 60, 91, 7, 250], [40, 41, 42], [100, 7, 100, 7, 100, 7, 100, 7]]
N = 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def tiny():
    """(target, draft, tokenizer, fingerprint): a 4-layer Qwen2 and a perturbed copy."""
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(num_hidden_layers=4, vocab_size=len(tok), hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    return target, perturbed_copy(target, 0.1), tok, tokenizer_fingerprint(tok)


@pytest.fixture(scope="module")
def service(tiny):
    target, _, tok, _ = tiny
    svc = CloudService(Target(target, tok, "tiny"), "127.0.0.1", 0,
                       split=SplitTarget(copy.deepcopy(target), tok, "tiny", max_context=256,
                                         max_batch_tokens=512), **service_keys())
    svc.start_in_thread()
    yield svc
    svc.stop()


def decoder(tiny, service, settings: SplitSettings | None, link=None) -> tuple[Decoder, CloudLink]:
    target, draft, tok, fp = tiny
    link = link or CloudLink.connect("127.0.0.1", service.port, timeout_s=10, **device_keys())
    edge = EdgeLM(draft, tok)
    edge.eos_ids = set()  # random models: generate the full length
    split = None
    if settings is not None:
        parts = S.free_unused(S.split_model(target, settings.k, settings.m), "device")
        split = SplitDevice(parts, settings, tok, fp)
    return Decoder(edge, link, fp, drafter=FullHeadDrafter(edge), split=split), link


@pytest.mark.parametrize("mode, gamma, pipeline", [("split", None, True), ("split_spec", None, False),
                                                    ("split_spec", 3, False), ("split_spec", None, True),
                                                    ("split_spec", 3, True)])
def test_split_float16_equals_the_unsplit_target(tiny, service, mode, gamma, pipeline):
    """float16 rows: both split modes give the unsplit target's greedy tokens exactly, and
    split_spec accepts some drafts but not all (so rollback of both halves ran); pipelined,
    some blocks go out with the front rows the look-ahead ran while the block before was in
    flight, and the tokens are still the target's."""
    target = tiny[0]
    # an emulated 30 ms RTT: the look-ahead has time to run while a block is in flight
    link = CloudLink.connect("127.0.0.1", service.port, WanProfile(30.0, float("inf")),
                             timeout_s=10, **device_keys())
    dec, link = decoder(tiny, service, SplitSettings(k=1, m=1, act="float16"), link=link)
    drafted = accepted = ahead = 0
    real_session = dec.split.session

    def session(*a, **kw):
        nonlocal sess
        sess = real_session(*a, **kw)
        return sess
    sess = None
    dec.split.session = session
    with link:
        for prompt in PROMPTS:
            res = dec.generate(mode, prompt, DecodeConfig(max_new_tokens=N, gamma=gamma,
                                                          split_pipeline=pipeline))
            assert res.fallback is None
            assert res.tokens == target_greedy(target, prompt, N), (mode, prompt)
            drafted, accepted = drafted + res.drafted, accepted + res.accepted
            ahead += sess.ahead_blocks
            if mode == "split":
                # one round trip per token (and one for the prompt's prefill)
                assert res.round_trips == N
    if mode == "split_spec":
        assert 0 < accepted < drafted
    assert (ahead > 0) == (mode == "split_spec" and pipeline)


def test_split_int8_logits_within_their_bound_and_rows_cost_d_plus_2_bytes(tiny, service):
    """Through the service, the split's logits after the prompt and a 3-token block (the
    session's own ``score``) against the unsplit model's: float16 rows within 1e-3, int8
    rows (per-row scales) within 2e-2 and visibly worse than float16 (so int8 really ran);
    tiny random models have near-ties (margins ~5e-4), so int8's greedy tokens are not
    compared here (the benchmark measures agreement on the real target). Uplink: an int8
    row is D + 2 bytes, a float16 row 2·D."""
    target, _, tok, fp = tiny
    prompt, block = PROMPTS[0], [9, 8, 7]
    with torch.no_grad():
        full = target(torch.tensor([prompt + block])).logits[0, len(prompt) - 1:]
    err, up = {}, {}
    for act in ("int8", "float16"):
        dev, link = decoder(tiny, service, SplitSettings(k=2, m=1, act=act))
        with link:
            sess = dev.split.session(link, P.CloudAuth(), 10.0)
            sess.open(prompt)
            before = link.bytes_up
            got = sess.score(prompt, block)
            up[act] = link.bytes_up - before
            sess.close()
        err[act] = float((got - full).abs().max())
    assert err["float16"] < 1e-3
    assert err["int8"] < 2e-2
    assert err["int8"] > 3 * err["float16"]
    rows = 1 + len(block)
    assert up["float16"] - up["int8"] == rows * (2 * 64 - (64 + 2))


def test_split_spec_without_cache_authorization_resends_the_window(tiny, service):
    """flag_cache off: the cloud keeps no middle row between requests, every MID re-sends
    the whole window, and the output is still the target's."""
    target = tiny[0]
    dec, link = decoder(tiny, service, SplitSettings(k=1, m=1, act="float16"))
    with link:
        res = dec.generate("split_spec", PROMPTS[0],
                           DecodeConfig(max_new_tokens=N, auth=P.CloudAuth(False, None)))
    assert res.tokens == target_greedy(target, PROMPTS[0], N)
    sess_up_keep = None
    dec2, link2 = decoder(tiny, service, SplitSettings(k=1, m=1, act="float16"))
    with link2:
        keep = dec2.generate("split_spec", PROMPTS[0], DecodeConfig(max_new_tokens=N))
        sess_up_keep = keep.bytes_up
    # the re-sent windows cost many more uplink bytes than the kept cache
    assert res.bytes_up > 2 * sess_up_keep


def test_split_head_never_emits_a_masked_token(tiny, service):
    """A split head whose mask excludes the target's favourite tokens: none of them is
    emitted, every token is in the mask, and with the full mask the output is the target's
    up to the 8-bit downlink."""
    target, _, tok, fp = tiny
    ref = target_greedy(target, PROMPTS[0], N)
    dec, link = decoder(tiny, service, SplitSettings(k=1, m=1, head_split=40, act="float16", mask="full"))
    with link:
        full = dec.generate("split", PROMPTS[0], DecodeConfig(max_new_tokens=N))
    first = next((i for i, (a, b) in enumerate(zip(full.tokens, ref)) if a != b), N)
    assert first >= N // 2
    english = set(V.vocab_mask(tok, "english", vocab_size=target.config.vocab_size).tolist())
    dec, link = decoder(tiny, service, SplitSettings(k=1, m=1, head_split=40, act="float16", mask="english"))
    with link:
        res = dec.generate("split_spec", PROMPTS[0], DecodeConfig(max_new_tokens=N))
    assert res.tokens and set(res.tokens) <= english
    outside = [t for t in ref if t not in english]
    assert outside, "the test needs a target whose greedy output leaves the mask"
    assert not set(outside) & set(res.tokens)


def test_corpus_mask_goes_once_as_a_bitmap_and_bounds_the_output(tiny, service):
    """``mask=corpus``: the device sends its id set once (MASK, ceil(V/8) bytes; the cloud
    answers its size, special ids added), the cloud scores only those ids, and every token
    emitted is in the set, though the target's own greedy output leaves it. Without its
    ids the session refuses to start."""
    target, _, tok, fp = tiny
    ref = target_greedy(target, PROMPTS[0], N)
    V_ = target.config.vocab_size
    allowed = np.setdiff1d(np.arange(V_), np.asarray(sorted(set(ref[: N // 2]))))  # not the favourites
    settings = SplitSettings(k=1, m=1, head_split=40, act="float16", mask="corpus", mask_size=len(allowed))
    assert settings.request().mask == V.EXPLICIT and "corpus" in settings.label()
    dec, link = decoder(tiny, service, settings)
    dec.split.mask_ids = allowed
    want = V.vocab_mask(tok, V.EXPLICIT, vocab_size=V_, ids=allowed)
    with link:
        up0 = link.bytes_up
        res = dec.generate("split_spec", PROMPTS[0], DecodeConfig(max_new_tokens=N))
        assert res.fallback is None
        assert res.prefill_bytes_up >= V.bitmap_nbytes(V_)  # the bitmap went with the OPEN
        assert link.bytes_up > up0
    assert res.tokens and set(res.tokens) <= set(want.tolist())
    assert not set(ref[: N // 2]) & set(res.tokens) - set(V.special_ids(tok))
    dec.split.mask_ids = None
    with pytest.raises(ValueError, match="corpus mask needs its ids"):
        dec.split.session(link, P.CloudAuth(), 10.0)


def test_a_late_answer_or_a_refused_split_never_breaks_the_next_generation(tiny, service):
    """A fusion answer that misses its 1 ms deadline arrives during the next split OPEN: it
    is skipped, and the split gives the target's tokens. A split the service refuses (its
    policy takes float16 rows only) raises, leaves no split session behind, and the next
    plain generation on the same decoder and link gives the target's tokens."""
    from edgefuse.cloud.split_target import SplitPolicy

    target, _, tok, _ = tiny
    link = CloudLink.connect("127.0.0.1", service.port, WanProfile(40.0, float("inf")),
                             timeout_s=10, **device_keys())
    dec, link = decoder(tiny, service, SplitSettings(k=1, m=1, act="float16"), link=link)
    with link:
        dec.generate("fusion_static", PROMPTS[1], DecodeConfig(max_new_tokens=3, deadline_ms=1))
        res = dec.generate("split", PROMPTS[0], DecodeConfig(max_new_tokens=N))
        assert res.fallback is None and res.tokens == target_greedy(target, PROMPTS[0], N)
    strict = CloudService(Target(target, tok, "tiny"), "127.0.0.1", 0,
                          split=SplitTarget(copy.deepcopy(target), tok, "tiny", SplitPolicy(acts=("float16",)),
                                            max_context=256, max_batch_tokens=512), **service_keys())
    strict.start_in_thread()
    try:
        dec, link = decoder(tiny, strict, SplitSettings(k=1, m=1, act="int8"))
        with link:
            with pytest.raises(P.RemoteError, match="split"):
                dec.generate("split", PROMPTS[0], DecodeConfig(max_new_tokens=N))
            assert dec._session is None
            res = dec.generate("cloud", PROMPTS[0], DecodeConfig(max_new_tokens=N))
            assert res.fallback is None and res.tokens == target_greedy(target, PROMPTS[0], N)
    finally:
        strict.stop()


def test_split_cloud_gone_mid_generation_falls_back_to_the_edge(tiny, service):
    """The cloud refuses a request mid-way (its session was revoked under it): the tokens
    before are the target's, the rest the edge model's greedy continuation, and the
    result says so."""
    target, draft, tok, _ = tiny
    dec, link = decoder(tiny, service, SplitSettings(k=1, m=1, act="float16"))
    session_verify = None

    with link:
        real = dec._verify
        calls = [0]

        def dying(committed, d, cfg):
            calls[0] += 1
            if calls[0] == 4:
                link.close()
            return real(committed, d, cfg)

        dec._verify = dying
        res = dec.generate("split", PROMPTS[0], DecodeConfig(max_new_tokens=N))
    assert res.fallback and "edge only" in res.fallback
    cut = 3  # three tokens came through the split before the link closed
    ref = target_greedy(target, PROMPTS[0], cut)
    assert res.tokens[:cut] == ref
    assert res.tokens[cut:] == target_greedy(draft, PROMPTS[0] + ref, N - cut)
    del session_verify


def test_split_mode_needs_the_device_layers(tiny, service):
    dec, link = decoder(tiny, service, None)
    with link, pytest.raises(DecodeError, match="cloud.split"):
        dec.generate("split", PROMPTS[0], DecodeConfig(max_new_tokens=2))


def test_split_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="mask"):
        SplitSettings(mask="klingon", head_split=8)
    with pytest.raises(ValueError, match="split head"):
        SplitSettings(mask="english")
    with pytest.raises(ValueError, match="head_topk"):
        SplitSettings(head_split=8, head_topk=-1)
    with pytest.raises(ValueError, match="fill"):
        SplitSettings(fill="guess")
    with pytest.raises(ValueError):
        SplitSettings(k=0)


def test_the_device_loads_only_its_layers_and_computes_what_the_whole_model_does(tiny, tmp_path):
    """``load_split_device`` on a model folder: the middle layers' weights are never read
    (Identity in their place), and the device's front / back around the whole model's
    middle give the whole model's logits."""
    target, _, tok, _ = tiny
    folder = tmp_path / "tiny-target"
    target.save_pretrained(folder)
    tok.save_pretrained(folder)
    dev = load_split_device(str(folder), SplitSettings(k=1, m=1, act="float16"))
    assert dev.parts.middle is None
    assert dev.parts.front.layers[0].self_attn.q_proj.weight.equal(target.model.layers[0].self_attn.q_proj.weight)
    assert dev.parts.back.layers[0].mlp.up_proj.weight.equal(target.model.layers[3].mlp.up_proj.weight)
    middle = S.split_model(target, 1, 1).middle
    ds = S.DeviceSplit(dev.parts, S.SplitSpec(1, 1, None, "float16"))
    ids = PROMPTS[0]
    x = ds.front(ids)
    y = middle(inputs_embeds=x.unsqueeze(0), position_ids=torch.arange(len(ids)).unsqueeze(0)).last_hidden_state[0]
    with torch.no_grad():
        full = target(torch.tensor([ids])).logits[0]
    assert torch.allclose(ds.logits(ds.back(y)), full, atol=1e-5)


@pytest.mark.parametrize("auth", [P.CloudAuth(), P.CloudAuth(False, None)])
def test_streamed_prefill_in_blocks_gives_the_same_tokens(tiny, service, auth):
    """``stream_block`` = 3: a 7-token prompt's rows go as MIDs of 3, 3 and 1 rows, the next
    sent before the previous one's answer is read (each commits the one before it); the
    output is the target's, with the cache kept or not (then each block re-sends the rows
    before it)."""
    target = tiny[0]
    dec, link = decoder(tiny, service, SplitSettings(k=1, m=1, act="float16", stream_block=3))
    with link:
        up0 = link.bytes_up
        res = dec.generate("split_spec", PROMPTS[0], DecodeConfig(max_new_tokens=N, auth=auth))
        assert res.tokens == target_greedy(target, PROMPTS[0], N)
        assert res.prefill_bytes_up > 0 and link.bytes_up > up0
        sess = dec.split.session(link, auth, 10.0)
        sess.open(PROMPTS[0])  # 6 prompt rows before the last token: blocks of 3 and 3
        assert sess.mids == 2 and sess.ledger.committed == 3 and sess.ledger.pending == 3
        assert sess.resent_rows == (0 if auth.flag_cache else 3)
        with torch.no_grad():
            full = target(torch.tensor([PROMPTS[0]])).logits[0, -1]
        assert torch.allclose(sess.score(PROMPTS[0], [])[0], full, atol=1e-3)
        sess.close()
    with pytest.raises(ValueError, match="stream_block"):
        SplitSettings(stream_block=-1)


def _lora_folder(base, path, layers, seed=1):
    """A PEFT LoRA on ``q_proj`` / ``v_proj`` of ``layers`` of a copy of ``base``, with
    random (non-zero) B so that it changes the model; saved to ``path``."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=list(layers)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    peft.save_pretrained(str(path))
    return peft.merge_and_unload().eval()


def test_device_lora_on_its_own_layers_gives_the_merged_model_and_stays_on_the_device(tiny, service, tmp_path):
    """The device merges its own LoRA into the layers it runs (k = 1: layer 0, m = 1: layer
    3); the cloud's middle stays the base model's, so the split gives exactly the greedy
    tokens of the whole model with that LoRA merged (float16 rows), which differ from the
    base model's. The service's weights are untouched and nothing but activations crossed.
    An adapter on a middle layer is refused, naming the weight."""
    from edgefuse.lora import merge_local_adapter

    target, _, tok, fp = tiny
    merged = _lora_folder(target, tmp_path / "lora", [0, 3])
    before = {k: v.clone() for k, v in service.split.model.state_dict().items()}
    device_model = merge_local_adapter(copy.deepcopy(target), tmp_path / "lora", [0, 3])
    settings = SplitSettings(k=1, m=1, act="float16", adapter=str(tmp_path / "lora"))
    parts = S.free_unused(S.split_model(device_model, 1, 1), "device")
    link = CloudLink.connect("127.0.0.1", service.port, timeout_s=10, **device_keys())
    edge = EdgeLM(tiny[1], tok)
    edge.eos_ids = set()
    dec = Decoder(edge, link, fp, drafter=FullHeadDrafter(edge), split=SplitDevice(parts, settings, tok, fp))
    differs = False
    with link:
        for prompt in PROMPTS:
            res = dec.generate("split_spec", prompt, DecodeConfig(max_new_tokens=N))
            assert res.split.endswith("+ device LoRA")
            assert res.tokens == target_greedy(merged, prompt, N), prompt
            differs |= res.tokens != target_greedy(target, prompt, N)
    assert differs  # the adapter changed the output: the test could fail
    after = service.split.model.state_dict()
    assert all(after[k].equal(v) for k, v in before.items())
    _lora_folder(target, tmp_path / "middle", [1])
    with pytest.raises(ValueError, match=r"layers\.1\..*outside the device's layers \[0, 3\]"):
        merge_local_adapter(copy.deepcopy(target), tmp_path / "middle", [0, 3])
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        merge_local_adapter(copy.deepcopy(target), tmp_path, [0, 3])
    # weights the config does not use, or a config wider than its weights: refused, not
    # merged as a silent no-op or with random deltas
    from safetensors.torch import load_file, save_file

    good = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    for name, state in (("renamed", {k.replace("self_attn", "xattn"): v for k, v in good.items()}),
                        ("partial", {k: v for k, v in good.items() if "layers.0." in k})):
        shutil.copytree(tmp_path / "lora", tmp_path / name)
        save_file(state, str(tmp_path / name / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match="unused by its config" if name == "renamed" else "missing from the file"):
            merge_local_adapter(copy.deepcopy(target), tmp_path / name, [0, 3])
    (tmp_path / "partial" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable"):
        merge_local_adapter(copy.deepcopy(target), tmp_path / "partial", [0, 3])
