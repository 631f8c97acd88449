"""Device decoders against the real service over real sockets (tiny random qwen2 models)."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from edgefuse.cloud.decoding import MODES, DecodeConfig, Decoder, DrafterSpec, EdgeLM
from edgefuse.cloud.devices import prompt_ids, run_devices, summarize
from edgefuse.cloud.fusion import FusionConfig
from edgefuse.cloud.link import CloudLink
from edgefuse.cloud import split as S
from edgefuse.cloud.decoding.split import SplitDevice, SplitSettings
from edgefuse.cloud.split_target import SplitTarget
from edgefuse.cloud.target import tokenizer_fingerprint
from edgefuse.eval.queries import Query
from edgefuse.models import tiny_model
from edgefuse.transport.wan import WanProfile
from tests.cloud.conftest import device_keys, perturbed_copy, target_greedy


@pytest.fixture
def service(start_service):
    target, tok = tiny_model("qwen2", seed=1)
    split = SplitTarget(target, tok, "tiny-target", max_context=2048, max_batch_tokens=8192)
    return start_service(target, tok, max_batch=8, max_wait_ms=20, split=split), target, tok


def _edge(tok):
    model, _ = tiny_model("qwen2", seed=0)
    edge = EdgeLM(model, tok)
    edge.eos_ids = set()  # random weights: always generate the full length
    return edge


def test_two_devices_in_every_mode_through_the_service(service):
    svc, target, tok = service
    model, _ = tiny_model("qwen2", seed=0)
    queries = [Query(qid=f"dolly/{i}", kind="dolly", instruction=f"tell me about item {i}", context="",
                     choices=None, answer=None, reference="an item", category="c") for i in range(4)]
    # split modes: the target's first layer and head on the devices (shared), float16 rows
    settings = SplitSettings(k=1, m=0, act="float16")
    split = SplitDevice(S.free_unused(S.split_model(target, 1, 0), "device"), settings, tok,
                        svc.target.fingerprint)
    recs, wall = run_devices(model, tok, queries, list(MODES), DecodeConfig(max_new_tokens=6),
                             "127.0.0.1", svc.port, WanProfile(5.0, 100.0), 2, svc.target.fingerprint,
                             max_prompt_tokens=64, device_keys=[tuple(device_keys(p).values()) for p in (0, 1)],
                             split=split)
    rows = {r["mode"]: r for r in summarize(recs, wall, tok, 5.0, 2, greedy=True)}
    assert set(rows) == set(MODES) and len(recs) == 4 * len(MODES)
    assert all(r["fallbacks"] == 0 for r in rows.values())
    assert rows["split"]["split"] == rows["split_spec"]["split"] == "k1 m0 float16"
    assert svc.stats()["split_sessions_total"] == 2 * 4
    assert rows["spec_sync"]["identical_to_target"] and rows["spec_async"]["identical_to_target"]
    assert svc.stats()["max_batch_size"] >= 2
    deadline = time.monotonic() + 5  # the worker frees closed sessions right after the last reply
    while svc.stats()["sessions_open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.stats()["sessions_open"] == 0
    # every cloud-mode output is the target's own greedy continuation
    for r in recs:
        if r.mode == "cloud":
            q = next(q for q in queries if q.qid == r.qid)
            assert r.result.tokens == target_greedy(target, prompt_ids(q, tok, 64), 6)
    assert rows["spec_sync"]["drafter"] == "full_head" and rows["cloud"]["drafter"] is None


@pytest.mark.parametrize("name", ["shallow", "ngram"])
def test_configured_drafter_on_batched_devices_through_the_service(service, name):
    """run_devices gives each of two batched devices its own drafter of the spec (the shallow
    view and its batcher shared); speculative output stays the target's, the rows name it."""
    svc, target, tok = service
    model = perturbed_copy(target, 0.1)
    queries = [Query(qid=f"dolly/{i}", kind="dolly", instruction=f"repeat item {i} item {i} item {i}",
                     context="", choices=None, answer=None, reference="", category="c") for i in range(2)]
    cfg = DecodeConfig(max_new_tokens=12, gamma0_fallback=False)  # every block drafts: the drafter is used
    recs, wall = run_devices(model, tok, queries, ["cloud", "spec_sync", "spec_async"],
                             cfg, "127.0.0.1", svc.port, WanProfile(5.0, 100.0),
                             2, svc.target.fingerprint, max_prompt_tokens=64,
                             drafter=DrafterSpec(name, shallow_layers=1), **device_keys())
    rows = {r["mode"]: r for r in summarize(recs, wall, tok, 5.0, 2, greedy=True)}
    assert rows["spec_sync"]["identical_to_target"] and rows["spec_async"]["identical_to_target"]
    assert rows["spec_sync"]["drafter"] == rows["spec_async"]["drafter"] == name
    assert all(r.result.drafter == name for r in recs if r.mode.startswith("spec"))
    assert rows["spec_sync"]["acceptance_rate"] is not None


@pytest.mark.parametrize("mode", ["spec_sync", "spec_async", "fusion_static"])
def test_service_stopped_mid_generation_falls_back_to_edge(service, mode):
    """The service is stopped after the link's third round trip: the k tokens committed
    before it went (as the fallback note counts them, k >= 1) are the target's greedy ones,
    the rest is the edge's own greedy continuation of the prompt and that prefix (fusion at
    w = 0 with a deadline no answer misses, so each fused token is the cloud's top-1)."""
    svc, target, tok = service
    edge = _edge(tok)
    prompt = [5, 6, 7, 8]
    link = CloudLink.connect("127.0.0.1", svc.port, **device_keys(), wan=WanProfile(20.0, 100.0))
    def stop_after_round_trips():  # OPEN and two decode round trips, however slow the machine
        deadline = time.monotonic() + 120
        while link.round_trips < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        svc.stop()

    stopper = threading.Thread(target=stop_after_round_trips)
    stopper.start()
    res = Decoder(edge, link, svc.target.fingerprint).generate(
        mode, prompt, DecodeConfig(max_new_tokens=200, gamma=2, timeout_s=10, deadline_ms=10_000,
                                   fusion=FusionConfig(weight=0.0)))
    stopper.join()
    link.close()
    assert len(res.tokens) == 200 and res.deadline_misses == 0
    m = re.fullmatch(r"cloud unavailable after (\d+) tokens \(.*\); the rest is edge only", res.fallback or "")
    assert m, res.fallback
    k = int(m.group(1))
    assert 1 <= k < 200  # the cloud answered before it went
    assert res.tokens[:k] == target_greedy(target, prompt, k)
    rest = Decoder(_edge(tok)).generate("edge", prompt + res.tokens[:k], DecodeConfig(max_new_tokens=200 - k))
    assert res.tokens[k:] == rest.tokens


def test_late_cloud_answers_meet_the_deadline_path(service):
    """RTT 200 ms, deadline 20 ms: every token is the edge's own; the session stays usable."""
    svc, _, tok = service
    edge = _edge(tok)
    alone = Decoder(edge).generate("edge", [5, 6, 7], DecodeConfig(max_new_tokens=5))
    link = CloudLink.connect("127.0.0.1", svc.port, **device_keys(), wan=WanProfile(200.0, 100.0))
    dec = Decoder(edge, link, svc.target.fingerprint)
    cfg = DecodeConfig(max_new_tokens=5, deadline_ms=20, fusion=FusionConfig(weight=0.0))
    res = dec.generate("fusion_static", [5, 6, 7], cfg)
    assert res.deadline_misses == 5 and res.tokens == alone.tokens and res.fallback is None
    # the same link opens the next session although five late answers are still in flight
    again = dec.generate("cloud", [5, 6, 7], DecodeConfig(max_new_tokens=3))
    assert again.fallback is None and again.round_trips == 3
    link.close()


@pytest.mark.integration
def test_real_smollm2_speculative_is_lossless_and_fusion_runs(start_service):
    """Real weights (SmolLM2-135M, the model CI already fetches): the cloud serves the base
    model, the device drafts with a LoRA-perturbed copy (so drafts are sometimes rejected);
    greedy speculative output equals the base model's own greedy continuation."""
    from edgefuse.lora import attach_lora
    from edgefuse.models import load_model

    torch.manual_seed(0)
    target, tok = load_model("smollm2-135m")
    svc = start_service(target, tok, "smollm2-135m")
    base, _ = load_model("smollm2-135m")
    draft = attach_lora(base, rank=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"], seed=0)
    with torch.no_grad():  # a visible but small perturbation of the draft
        for name, p in draft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                     add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    edge = EdgeLM(draft, tok)
    link = CloudLink.connect("127.0.0.1", svc.port, **device_keys())
    dec = Decoder(edge, link, svc.target.fingerprint)
    cfg = DecodeConfig(max_new_tokens=16)
    want = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(want) if t in edge.eos_ids), len(want))
    want = want[:cut]  # the decoder stops at the end of turn and does not return it
    assert len(want) >= 4
    for mode in ("spec_sync", "spec_async"):
        res = dec.generate(mode, prompt, cfg)
        assert res.tokens == want and res.fallback is None
        assert 0 < res.acceptance_rate <= 1 and res.round_trips < len(res.tokens)
    fused = dec.generate("fusion_adaptive", prompt, cfg)
    assert fused.fallback is None and fused.round_trips == len(fused.tokens) + (len(fused.tokens) < 16)
    assert 0 < fused.edge_weight_mean < 1
    link.close()


@pytest.mark.integration
def test_every_default_device_speculates_losslessly_with_the_cloud(start_service):
    """The default cloud (Qwen2.5-Coder-1.5B) and each default device model, fetched once if
    not cached: Qwen2.5-Coder-0.5B shares its tokenizer, SmolLM2-135M and Gemma-3-270M decode
    across tokenizers. Greedy speculative decoding through the service, sync and async, equals
    the 1.5B's own greedy ``generate`` on two short prompts for 8 tokens, and every device's
    drafts are accepted at least once (the cloud did not decode alone)."""
    import gc

    from edgefuse.cloud.crossvocab import CrossVocab
    from edgefuse.config import compose
    from edgefuse.models import fetch, load_model

    cfg = compose("default")
    c = cfg.cloud
    devices = list(dict.fromkeys(str(x.model) for x in cfg.federation.clients))
    for name in (c.model, *devices):
        fetch(name)  # nothing to do when cached; never a skip
    target, tok = load_model(c.model)
    svc = start_service(target, tok, c.model)
    ends = set(CrossVocab(tok, tok).cloud.ends)
    for name in devices:
        draft, dtok = load_model(name)
        cross = None if tokenizer_fingerprint(dtok) == svc.target.fingerprint else CrossVocab(dtok, tok)
        link = CloudLink.connect("127.0.0.1", svc.port, **device_keys())
        dec = Decoder(EdgeLM(draft, dtok), link, svc.target.fingerprint, cross=cross)
        accepted = 0
        for text in ("def fibonacci(n):", "The three primary colours are"):
            ids = tok(text)["input_ids"]
            want = target_greedy(target, ids, 8)
            want = want[:next((i for i, t in enumerate(want) if t in ends), len(want))]
            for mode in ("spec_sync", "spec_async"):
                res = dec.generate(mode, dtok(text)["input_ids"] if cross else ids, DecodeConfig(max_new_tokens=8),
                                   cloud_prompt=ids if cross else None)
                assert res.tokens == want and res.fallback is None, (name, mode, text)
                assert res.tokenizer == ("cross" if cross else "same")
                accepted += res.accepted
        link.close()
        assert accepted > 0, name
        del draft, dec
        gc.collect()
