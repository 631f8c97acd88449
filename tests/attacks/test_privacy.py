"""Privacy: canary prompts, the outbound-payload audit (scan, Flower mod, tally), the
inversion attacks, the probe, protected queries, the results section and the config checks.

The central check: canary prompts protected with ``redact`` (the device knowing its own
identities) and sent through the real encoders (the cloud protocol's OPEN, a C2C peer
payload, a live :class:`edgefuse.cloud.link.CloudLink`) give 0 canary hits; the same prompts with
protection ``off`` are caught, as text and as token ids.
"""

from __future__ import annotations

import csv
import json
import re
import time

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, MetricRecord, RecordDict
from omegaconf import OmegaConf

from edgefuse.privacy import audit as A
from edgefuse.attacks.inversion import (
    RidgeInverter,
    hidden_features,
    kv_features,
    lcs_len,
    token_accuracy,
    topk_features,
    topk_from_payload,
)
from edgefuse.privacy.canaries import load_canary_prompts
from edgefuse.attacks.probe import resolve_layers, run_probe

# ------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def tiny():
    """The tiny random-weight qwen2 and its byte-level BPE tokenizer (vocab 394)."""
    from edgefuse.models import load_model

    return load_model("tiny-qwen2")


@pytest.fixture
def fresh_audit(monkeypatch) -> A.OutboundAudit:
    """A clean process-wide audit: every choke point (``outbound``) reports to it."""
    aud = A.OutboundAudit()
    monkeypatch.setattr(A, "AUDIT", aud)
    return aud


@pytest.fixture
def redactor():
    """A fresh Redactor (``remember`` mutates it, so not the cached default one). Presidio and
    the spaCy model are hard dependencies: when they are missing these tests fail, not skip."""
    from edgefuse.privacy.redact import Redactor

    return Redactor()


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def message(content: RecordDict, message_type: str = "train") -> Message:
    meta = Metadata(run_id=1, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="",
                    group_id="", created_at=time.time(), ttl=60.0, message_type=message_type)
    return Message(content=content, metadata=meta)


def luhn_ok(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d *= 2
            d = d - 9 if d > 9 else d
        total += d
    return total % 10 == 0


def iban_ok(iban: str) -> bool:
    s = iban.replace(" ", "")
    moved = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


# ------------------------------------------------------------------------------ canaries


def test_my_checksums_by_hand():
    assert luhn_ok("4539 1488 0343 6467") and not luhn_ok("4539 1488 0343 6468")
    assert iban_ok("DE89370400440532013000") and not iban_ok("DE89370400440532013001")
    assert iban_ok("GB82 WEST 1234 5698 7654 32")


def test_canary_prompts_are_deterministic_and_hold_their_canaries(mirror):
    a = load_canary_prompts(mirror, 6, seed=3)
    assert len(a) == 6
    assert a == load_canary_prompts(mirror, 6, seed=3)
    assert [p.text for p in a] != [p.text for p in load_canary_prompts(mirror, 6, seed=4)]
    for p in a:
        assert p.canaries and len(p.canaries) == len(p.kinds)
        assert "{{" not in p.text
        for c in p.canaries:
            assert len(c) >= 4 and c in p.text
    # the first prompt of a draw does not depend on how many are drawn
    assert load_canary_prompts(mirror, 1, seed=3)[0] == a[0]


def test_generated_cards_and_ibans_are_valid(mirror):
    prompts = load_canary_prompts(mirror, 300, seed=0)  # > 2x the usable templates: all kinds
    assert len(prompts) == 300
    by_kind: dict[str, list[str]] = {}
    for p in prompts:
        for c, k in zip(p.canaries, p.kinds):
            by_kind.setdefault(k, []).append(c)
    # the templates file writes line breaks as \n: the prompts hold real ones
    assert any("\n" in p.text for p in prompts) and not any("\\n" in p.text for p in prompts)
    cards, ibans = by_kind["credit_card_number"], by_kind["iban"]
    assert cards and ibans
    for c in cards:
        assert re.fullmatch(r"4\d{3}( \d{4}){3}", c) and luhn_ok(c), c
    for i in ibans:
        assert re.fullmatch(r"DE\d{20}", i) and iban_ok(i), i
    # names come with their surname as a canary of its own
    names = by_kind["name"] + by_kind.get("person", [])
    assert names and all(n.split()[-1] in by_kind["last_name"] for n in names if len(n.split()[-1]) >= 4)


def test_canaries_need_the_mirror(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_canary_prompts(tmp_path, 2, 0)
    with pytest.raises(FileNotFoundError):
        load_canary_prompts(None, 2, 0)
    with pytest.raises(ValueError):
        load_canary_prompts(tmp_path, 0, 0)


# ------------------------------------------------------------------------------ audit

CANARY = "quick brown"  # tiny tokenizer: ' quick brown' = 2 ids, 'quick brown' = 3 other ids


def test_a_planted_canary_is_found_as_text_and_as_token_ids(tiny):
    _, tok = tiny
    aud = A.OutboundAudit()
    aud.watch([CANARY, "", CANARY])  # empty and repeated values are ignored
    ids = ids_of(tok, "The quick brown fox jumps over the lazy dog")
    other = ids_of(tok, "The lazy dog jumps over the fox")
    assert aud.scan(b"... the quick brown fox") == {"as_text": 1}
    assert aud.scan(np.asarray(ids, ">i4").tobytes()) == {}  # no tokenizer yet: text only
    aud.use_tokenizer(tok)
    for dtype in (">i4", "<i4", "<i8"):
        assert aud.scan(np.asarray(ids, dtype).tobytes()) == {"as_tokens": 1}, dtype
        assert aud.scan(np.asarray(other, dtype).tobytes()) == {}, dtype
    assert aud.scan(b"the quick fox, brown") == {}
    both = b"quick brown" + np.asarray(ids, "<i4").tobytes()
    assert aud.scan(both) == {"as_text": 1, "as_tokens": 1}


def test_audit_counts_payloads_bytes_and_hits_per_type(tiny):
    _, tok = tiny
    aud = A.OutboundAudit()
    assert aud.outbound("control", b"12345") == 0  # nothing watched: counted, never a hit
    aud.watch([CANARY, "lazy dog"])
    aud.use_tokenizer(tok)
    leak = np.asarray(ids_of(tok, "The quick brown fox"), ">i4").tobytes()
    clean = np.asarray(ids_of(tok, "The fox"), ">i4").tobytes()
    assert aud.outbound("draft_tokens", leak) == 1
    assert aud.outbound("draft_tokens", bytearray(clean)) == 0
    assert aud.outbound("prompt_text", memoryview(b"quick brown and lazy dog")) == 2
    assert aud.outbound("kv", b"\x00" * 100) == 0
    with pytest.raises(ValueError, match="unknown payload type"):
        aud.outbound("text", b"quick brown")
    snap = aud.snapshot()
    canary = {"message_type": "", "canary_kind": "canary", "field": ""}
    assert snap == {
        "control": {"payloads": 1, "bytes": 5, "canary_hits": 0, "hit_kinds": {}, "hits": []},
        "draft_tokens": {"payloads": 2, "bytes": len(leak) + len(clean), "canary_hits": 1,
                         "hit_kinds": {"as_tokens": 1}, "hits": [{**canary, "how": "as_tokens", "n": 1}]},
        "prompt_text": {"payloads": 1, "bytes": 24, "canary_hits": 2, "hit_kinds": {"as_text": 2},
                        "hits": [{**canary, "how": "as_text", "n": 2}]},
        "kv": {"payloads": 1, "bytes": 100, "canary_hits": 0, "hit_kinds": {}, "hits": []},
    }
    assert aud.snapshot(reset=True) == snap
    assert aud.snapshot() == {}


def test_a_canary_counts_once_per_way_it_is_found(tiny):
    _, tok = tiny
    aud = A.OutboundAudit()
    aud.watch(["Keira Forster"])
    aud.use_tokenizer(tok)
    ids = ids_of(tok, "Follow up with Keira Forster in a couple of months.")
    assert aud.scan(np.asarray(ids, ">i4").tobytes()) == {"as_tokens": 1}
    one = A.OutboundAudit()
    one.watch(["Federated"])  # a single id under the tiny tokenizer: scanned as text only
    one.use_tokenizer(tok)
    assert one.scan(np.asarray(ids_of(tok, "Federated learning"), "<i8").tobytes()) == {}
    assert one.scan(b"Federated learning") == {"as_text": 1}


def test_merge_sums_snapshots():
    h = {"message_type": "query.decode", "canary_kind": "email", "how": "as_tokens", "field": ""}
    a = {"kv": {"payloads": 2, "bytes": 100, "canary_hits": 0, "hit_kinds": {}},
         "draft_tokens": {"payloads": 3, "bytes": 30, "canary_hits": 2, "hit_kinds": {"as_tokens": 2},
                          "hits": [{**h, "n": 2}]}}
    b = {"draft_tokens": {"payloads": 1, "bytes": 12, "canary_hits": 3,
                          "hit_kinds": {"as_tokens": 1, "as_text": 2},
                          "hits": [{**h, "n": 1}, {**h, "how": "as_text", "canary_kind": "name", "n": 2}]},
         "metadata": {"payloads": 4, "bytes": 7}}  # counts missing from a snapshot are 0
    assert A.merge([a, b, {}]) == {
        "kv": {"payloads": 2, "bytes": 100, "canary_hits": 0, "hit_kinds": {}, "hits": []},
        "draft_tokens": {"payloads": 4, "bytes": 42, "canary_hits": 5,
                         "hit_kinds": {"as_tokens": 3, "as_text": 2},
                         "hits": [{**h, "n": 3}, {**h, "how": "as_text", "canary_kind": "name", "n": 2}]},
        "metadata": {"payloads": 4, "bytes": 7, "canary_hits": 0, "hit_kinds": {}, "hits": []},
    }
    assert A.merge([]) == {}
    assert a["draft_tokens"]["payloads"] == 3  # inputs untouched


def test_record_bytes_types_every_record():
    w = Array(np.arange(4, dtype=np.float32))
    frame = Array(np.frombuffer(b"sealed-frame", dtype=np.uint8).copy())
    content = RecordDict({
        "adapter": ArrayRecord({"w": w}),
        "frames": ArrayRecord({"f": frame}),  # C2C frames, sealed end to end
        "cfg": ConfigRecord({"a": 1, "s": "hello", "raw": b"\x01\x02"}),
        "metrics": MetricRecord({"loss": 0.5}),
    })
    assert A.record_bytes(content) == [
        ("adapter", "adapter.w", w.data), ("sealed", "frames.f", frame.data),
        ("metadata", "cfg.a", b"a=1"), ("metadata", "cfg.s", b"s=hello"),
        ("metadata", "cfg.raw", b"\x01\x02"), ("metadata", "metrics.loss", b"loss=0.5"),
    ]


def test_flower_mod_attaches_the_handlers_audit(tiny, fresh_audit):
    _, tok = tiny
    fresh_audit.watch([CANARY])
    fresh_audit.use_tokenizer(tok)
    A.outbound("control", b"before the message")  # reset when the handler starts
    ids = np.asarray(ids_of(tok, "a quick brown fox"), dtype=np.int32)  # int32 LE
    arr = Array(ids)
    frame = b"\x03" + np.asarray(ids, ">i4").tobytes()
    seen = {}

    def handler(msg, context):
        seen["ctx"] = context
        A.outbound("draft_tokens", frame)  # e.g. a cloud frame sent while handling
        return Message(RecordDict({"adapter": ArrayRecord({"lora": arr}),
                                   "frames": ArrayRecord({"f": Array(np.zeros(3, np.uint8))}),
                                   "metrics": ConfigRecord({"note": "saw a quick brown fox",
                                                            "n": 3})}), reply_to=msg)

    msg = message(RecordDict({"config": ConfigRecord({"cfg": "{}"})}))
    reply = A.flower_mod(msg, "ctx", handler)
    assert seen["ctx"] == "ctx"
    stats = json.loads(str(reply.content["privacy_audit"]["stats"]))
    note = len(b"note=saw a quick brown fox") + len(b"n=3")
    hit = {"message_type": "train", "canary_kind": "canary", "n": 1}
    assert stats == {
        "draft_tokens": {"payloads": 1, "bytes": len(frame), "canary_hits": 1, "hit_kinds": {"as_tokens": 1},
                         "hits": [{**hit, "how": "as_tokens", "field": ""}]},
        "adapter": {"payloads": 1, "bytes": len(arr.data), "canary_hits": 1, "hit_kinds": {"as_tokens": 1},
                    "hits": [{**hit, "how": "as_tokens", "field": "adapter.lora"}]},
        "sealed": {"payloads": 1, "bytes": len(Array(np.zeros(3, np.uint8)).data), "canary_hits": 0,
                   "hit_kinds": {}, "hits": []},
        "metadata": {"payloads": 2, "bytes": note, "canary_hits": 1, "hit_kinds": {"as_text": 1},
                     "hits": [{**hit, "how": "as_text", "field": "metrics.note"}]},
    }
    assert fresh_audit.message_type == ""  # only while the handler runs
    assert list(reply.content.array_records) == ["adapter", "frames"]  # the reply is unchanged
    assert fresh_audit.snapshot() == {}  # taken with reset: the next message starts afresh

    # an error reply passes through untouched
    err = A.flower_mod(msg, None, lambda m, c: Message(Error(code=1, reason="boom"), reply_to=m))
    assert err.has_error() and not err.has_content()


# ------------------------------------------------- the canary scan vs. redaction, end to end


@pytest.fixture
def canary_setup(mirror, tiny, fresh_audit, redactor):
    """4 canary prompts (seed 0), their values watched by the process-wide audit (as text
    and as tiny-qwen2 ids) and remembered by the redactor, as in the probe with
    ``redact.known_identities``."""
    _, tok = tiny
    prompts = load_canary_prompts(mirror, 4, 0)
    values = sorted({c for p in prompts for c in p.canaries})
    fresh_audit.watch(values)
    fresh_audit.use_tokenizer(tok)
    redactor.remember(values)
    return prompts, values


@pytest.mark.parametrize("mode", ["off", "redact"])
def test_canary_scan_catches_a_planted_leak_and_fails_without_redaction(mode, canary_setup, tiny,
                                                                          fresh_audit, redactor):
    from edgefuse.cloud import protocol as P
    from edgefuse.privacy.protect import protect_batch
    from edgefuse.c2c.peer import encode_payload
    from edgefuse.c2c.registry import ModelVersion

    _, tok = tiny
    prompts, values = canary_setup
    sent = [p.text for p in protect_batch([p.text for p in prompts], mode, redactor=redactor)]
    for i, text in enumerate(sent):
        # what CloudLink.send reports before sealing, and a T2T answer relayed to a peer
        A.outbound("draft_tokens", P.encode(P.Open(ids_of(tok, text), "fp")))
        encode_payload("text", f"pii/{i}", ModelVersion("tiny-qwen2", "base"), text.encode())
    snap = fresh_audit.snapshot()
    assert snap["draft_tokens"]["payloads"] == snap["answer_text"]["payloads"] == len(prompts)
    if mode == "redact":
        assert sent != [p.text for p in prompts]
        assert not any(v in t for v in values for t in sent)
        assert snap["draft_tokens"]["canary_hits"] == 0 and snap["answer_text"]["canary_hits"] == 0
    else:
        # every canary in every prompt is found as text in the relayed answer...
        as_text = sum(v in p.text for p in prompts for v in values)
        assert as_text >= len(prompts)
        assert snap["answer_text"]["hit_kinds"] == {"as_text": as_text}
        # ...and every prompt leaks at least one canary as big-endian ids in its OPEN
        assert snap["draft_tokens"]["hit_kinds"].keys() == {"as_tokens"}
        assert snap["draft_tokens"]["canary_hits"] >= len(prompts)


@pytest.mark.parametrize("mode", ["off", "redact"])
def test_live_cloud_link_frames_are_scanned(mode, canary_setup, tiny, fresh_audit, redactor):
    """OPEN through a real CloudLink to an in-process cloud service."""
    from edgefuse.cloud.link import CloudLink
    from edgefuse.cloud.service import CloudService
    from tests.cloud.conftest import device_keys, service_keys
    from edgefuse.cloud.target import Target, tokenizer_fingerprint
    from edgefuse.models import tiny_model
    from edgefuse.privacy.protect import protect_batch

    _, tok = tiny
    prompts, _ = canary_setup
    sent = [p.text for p in protect_batch([p.text for p in prompts], mode, redactor=redactor)]
    model, ttok = tiny_model("qwen2")
    svc = CloudService(Target(model, ttok, "tiny-qwen2", max_context=1024), "127.0.0.1", 0,
                       **service_keys())
    svc.start_in_thread()
    try:
        for text in sent:
            with CloudLink.connect("127.0.0.1", svc.port, **device_keys()) as link:
                link.open(ids_of(tok, text), tokenizer_fingerprint(tok), max_new=4)
    finally:
        svc.stop()
    snap = fresh_audit.snapshot()
    assert snap["draft_tokens"]["payloads"] == len(prompts)
    assert snap["control"]["canary_hits"] == 0  # CLOSE frames
    if mode == "redact":
        assert snap["draft_tokens"]["canary_hits"] == 0
    else:
        assert snap["draft_tokens"]["canary_hits"] >= len(prompts)
        assert snap["draft_tokens"]["hit_kinds"].keys() == {"as_tokens"}


def test_watch_canaries_follows_the_config(mirror, tiny, fresh_audit):
    _, tok = tiny
    cfg = OmegaConf.create({"seed": 0, "data": {"mirror": str(mirror)},
                            "privacy": {"enabled": False, "probe": {"canaries": 2}}})
    assert A.watch_canaries(cfg, tok) == []
    assert fresh_audit.scan(b"anything") == {}
    cfg.privacy.enabled = True
    values = A.watch_canaries(cfg, tok)
    assert values == sorted({c for p in load_canary_prompts(mirror, 2, 0) for c in p.canaries})
    assert fresh_audit.scan(values[0].encode()).get("as_text", 0) >= 1


# ------------------------------------------------------------------------------ attacks


def test_lcs_and_token_accuracy_by_hand():
    a, b = [ord(c) for c in "ABCBDAB"], [ord(c) for c in "BDCABA"]
    assert lcs_len(a, b) == lcs_len(b, a) == 4  # BCBA
    assert lcs_len([1, 2, 3, 4], [2, 4]) == 2
    assert lcs_len([1, 2, 3], [3, 2, 1]) == 1
    assert lcs_len([], [1]) == lcs_len([1], []) == 0
    assert token_accuracy([1, 2, 9], [1, 2, 3, 4]) == 0.5
    assert token_accuracy([0, 1, 2, 3], [1, 2, 3]) == 1.0  # shift-tolerant
    assert token_accuracy([3, 2, 1], [1, 2, 3]) == pytest.approx(1 / 3)
    assert token_accuracy([1], []) == 0.0
    assert token_accuracy(np.array([5, 6]), np.array([5, 6])) == 1.0


def kv_payload(model, tok, text: str, layer: int = 0) -> tuple[list[int], torch.Tensor]:
    """A prompt's ids and what a C2C receiver holds of it: the KV cache sent through the int8
    wire codec (edgefuse.c2c.exchange), decoded, as layer ``layer``'s per-position features."""
    from edgefuse.c2c.exchange import decode_kv_cache, encode_kv_cache

    ids = ids_of(tok, text)[:64]
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).cache
    blob = encode_kv_cache(cache)
    assert len(blob) < sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values)) * 2
    return ids, kv_features(decode_kv_cache(blob), [layer])[layer]


def test_ridge_inverter_recovers_held_out_prompts_from_int8_kv_payloads(tiny, mirror):
    """Trained on public prompts (the attack_train slice), scored on the private canary
    prompts it never saw, from their layer-0 KV cache as the wire codec delivers it."""
    from edgefuse.config import compose
    from edgefuse.eval.splits import public_slices

    model, tok = tiny
    emb = model.get_input_embeddings().weight.detach()
    inv = RidgeInverter(emb, ridge=1.0)
    with pytest.raises(RuntimeError, match="fit"):
        inv.predict(emb)
    with pytest.raises(ValueError):
        inv.fit(emb[:10], torch.arange(9))
    cfg = compose("tiny", f"data.mirror={mirror} privacy.probe.attack_train_prompts=48")
    train_texts = [r["instruction"] for r in public_slices(cfg.data, 0).rows("attack_train")]
    held_out = [p.text for p in load_canary_prompts(mirror, 8, 0)]
    assert len(train_texts) == 48 and not set(train_texts) & set(held_out)
    train = [kv_payload(model, tok, t) for t in train_texts]
    inv.fit(torch.cat([f for _, f in train]), torch.tensor([i for ids, _ in train for i in ids]))
    scores, exact = [], []
    for text in held_out:
        ids, feats = kv_payload(model, tok, text)
        pred = inv.predict(feats, chunk=7)  # chunked prediction equals one pass
        assert pred.shape == (len(ids),) and torch.equal(pred, inv.predict(feats))
        scores.append(token_accuracy(pred.tolist(), ids))
        exact.append((pred == torch.tensor(ids)).float().mean().item())
    # measured (tiny-qwen2, seed 0): 1.0 both ways, on every one of the 8 prompts
    assert np.mean(scores) >= 0.95 and np.mean(exact) >= 0.95, (scores, exact)
    # the same attacker on another prompt's payload recovers next to nothing: the ids come
    # from the payload, not from what the attacker learned of the public text
    ids_a, feats_a = kv_payload(model, tok, held_out[0])
    ids_b, _ = kv_payload(model, tok, held_out[1])
    assert token_accuracy(inv.predict(feats_a).tolist(), ids_b) < 0.5  # measured 0.22


def test_payload_features_shapes(tiny):
    model, tok = tiny
    cfg = model.config
    ids = ids_of(tok, "The quick brown fox")
    T = len(ids)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, output_hidden_states=True)
    h_kv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    assert (h_kv, d) == (2, 16)
    kv = kv_features(out.cache, [0, 1])
    assert sorted(kv) == [0, 1] and all(v.shape == (T, 2 * h_kv * d) == (T, 64) for v in kv.values())
    k0 = out.cache.layers[1].keys[0]  # [H, T, D]
    assert torch.equal(kv[1][:, :d], k0[0])  # head 0's key first, per position
    hid = hidden_features(out.hidden_states, [1])
    assert list(hid) == [1] and torch.equal(hid[1], out.hidden_states[2][0])
    emb = model.get_input_embeddings().weight
    feats, top_ids, probs = topk_features(out.logits[0], 4, emb)
    assert feats.shape == (T, 2 * cfg.hidden_size) and top_ids.shape == probs.shape == (T, 4)
    assert top_ids.dtype == np.int32 and probs.dtype == np.float16
    assert (top_ids[:, 0] == out.logits[0].argmax(-1).numpy()).all()
    assert np.allclose(probs.astype(np.float32).sum(-1), 1.0, atol=1e-2)
    assert torch.allclose(topk_from_payload(top_ids, probs, emb), feats, atol=1e-2)


# ------------------------------------------------------------------------------ probe


def test_resolve_layers():
    assert resolve_layers([0, 0.5, 1.0], 5) == [0, 2, 4]
    assert resolve_layers([-1, 0.0, 0], 4) == [0, 3]  # deduplicated, sorted
    assert resolve_layers([3, 1], 4) == [1, 3]
    assert resolve_layers(["0.25"], 5) == [1]
    assert resolve_layers([-4], 4) == [0]
    for bad in ([4], [-5], [1.5], [-0.1]):
        with pytest.raises(ValueError):
            resolve_layers(bad, 4)


def test_run_probe_refuses_unknown_modes(tiny, mirror):
    model, tok = tiny
    priv = OmegaConf.create({"probe": {"modes": ["none", "bogus"], "attack_layers": [0], "topk": 4,
                                       "canaries": 2, "attack_train_prompts": 2, "ridge": 1.0,
                                       "task_n": 0}})
    with pytest.raises(ValueError, match="bogus"):
        run_probe(model, tok, priv, mirror, None, 0, protector=lambda t, m: (t, 0))


NAME_KINDS = ("name", "person", "name_male", "name_female", "last_name", "first_name")


def test_run_probe_rows_and_figures(tiny, mirror):
    """The probe with the real redactor (Presidio + the device's known identities, as the
    tiny config sets) and the tiny model as rephraser (random weights: its output keeps no
    word of the prompt, and is accepted since unredacted prompts hold no placeholder)."""
    from edgefuse.config import compose
    from edgefuse.attacks.probe import PAYLOADS

    model, tok = tiny
    cfg = compose("tiny", f"data.mirror={mirror} privacy.probe.modes=[none,redact,rephrase] "
                          "privacy.probe.canaries=8 privacy.probe.attack_train_prompts=48")
    assert cfg.privacy.redact.known_identities is True
    prompts = load_canary_prompts(mirror, 8, int(cfg.seed))
    values = sorted({c for p in prompts for c in p.canaries}, key=len, reverse=True)
    planted = b"\x00" * 8 + values[-1].encode()  # an adapter that leaks one canary as text
    res = run_probe(model, tok, cfg.privacy, mirror, cfg.data, int(cfg.seed), adapter=planted)
    modes = ["none", "redact", "rephrase"]
    assert [(r["payload"], r["protection"]) for r in res.rows] == [(p, m) for m in modes for p in PAYLOADS]
    keys = {"payload", "protection", "canary_hits", "attacker_token_acc", "attacker_exact_match", "task_acc"}
    rows = {(r["payload"], r["protection"]): r for r in res.rows}
    layers = {(x["payload"], x["layer"], x["protection"]): x for x in res.layers}
    n = len(prompts)
    for r in res.rows:
        assert keys <= set(r)
        assert r["task_acc_n"] == int(cfg.privacy.probe.task_n)
        assert r["task_acc_ci95_low"] <= r["task_acc"] <= r["task_acc_ci95_high"]
        if r["payload"] == "adapter":
            assert (r["payloads"], r["bytes"]) == (1, len(planted))
            assert r["canary_hits"] == 1 and r["attacker_token_acc"] is None
        else:
            assert r["payloads"] == n and r["bytes"] > 0 and r["attacker_token_acc_n"] == n
            assert r["attacker_token_acc_ci95_low"] <= r["attacker_token_acc"] <= r["attacker_token_acc_ci95_high"]
    # unprotected: the cloud reads the prompt ids, the layer-0 KV attacker recovers most tokens
    none_draft = rows[("draft_tokens", "none")]
    assert none_draft["attacker_token_acc"] == 1.0 and none_draft["attacker_exact_match"] == 1.0
    as_text = sum(v in p.text for p in prompts for v in values)
    assert none_draft["canary_hits"] > as_text >= n  # the prompt text and its OPEN ids
    kv_none, kv_red = layers[("kv", 0, "none")]["attacker_token_acc"], layers[("kv", 0, "redact")]["attacker_token_acc"]
    # measured (seed 0, 48 public prompts): 1.000 unprotected, 0.613 redacted
    assert kv_none >= 0.95, kv_none
    assert kv_red <= kv_none - 0.2, (kv_none, kv_red)
    assert rows[("draft_tokens", "redact")]["attacker_token_acc"] <= 0.8
    # redaction with the known identities: nothing found in any payload, of any kind
    for p in ("kv", "hidden", "logits_topk", "draft_tokens"):
        assert rows[(p, "redact")]["canary_hits"] == 0
    assert set(res.hits_by_kind["redact"]) == {"adapter"}  # the planted adapter only
    # rephrased by random weights: scored against the raw prompt, almost nothing is left
    # (measured 0.007), and no canary
    assert res.rephrase_fallbacks == {"none": 0, "redact": 0, "rephrase": 0}
    for p in ("kv", "hidden", "draft_tokens"):
        assert rows[(p, "rephrase")]["attacker_token_acc"] <= 0.1
        assert rows[(p, "rephrase")]["canary_hits"] == 0
    # per-layer figures: kv and hidden at layers 0 and 1 (of 2), logits and drafts once
    assert len(res.layers) == 6 * len(modes)
    assert {(x["payload"], x["layer"]) for x in res.layers} == {
        ("kv", 0), ("kv", 1), ("hidden", 0), ("hidden", 1), ("logits_topk", -1), ("draft_tokens", -1)}
    assert set(res.seconds) == {"attack_train", *modes, "total"}


def test_probe_without_known_identities(tiny, mirror):
    """NER alone (``known_identities=false``): structured canaries still give 0 hits in every
    payload, names leak, and each value NER missed is a hit in the text the cloud is sent."""
    from edgefuse.config import compose
    from edgefuse.privacy.canaries import STRUCTURED_KINDS

    model, tok = tiny
    cfg = compose("tiny", f"data.mirror={mirror} privacy.probe.modes=[none,redact] privacy.probe.canaries=24 "
                          "privacy.redact.known_identities=false privacy.probe.task_n=0 privacy.probe.attack_layers=[0]")
    res = run_probe(model, tok, cfg.privacy, mirror, cfg.data, int(cfg.seed))
    by_kind = res.ner_recall_by_kind
    structured = [k for k in by_kind if k in STRUCTURED_KINDS]
    names = [k for k in by_kind if k in NAME_KINDS]
    assert sum(by_kind[k]["values"] for k in structured) >= 8 and sum(by_kind[k]["values"] for k in names) >= 10
    hits = res.hits_by_kind["redact"]
    for payload, kinds in hits.items():
        assert not set(kinds) & set(STRUCTURED_KINDS), (payload, kinds)
    assert all(by_kind[k]["redacted"] == by_kind[k]["values"] for k in structured), by_kind
    # every value NER missed is found in the protected text (as a whole word), and only those
    missed = {k: v["values"] - v["redacted"] for k, v in by_kind.items() if v["values"] > v["redacted"]}
    assert hits["prompt_text"] == missed
    hit_names, n_names = sum(by_kind[k]["redacted"] for k in names), sum(by_kind[k]["values"] for k in names)
    # measured (seed 0, 24 canary prompts): names 14/24 = 0.58 redacted (last names alone 6/11);
    # structured 14/14; a street without city or postcode ("Brixtonlaan 175") 1/2
    assert 0.4 <= hit_names / n_names < 1.0, by_kind
    assert res.ner_recall == pytest.approx(sum(v["redacted"] for v in by_kind.values())
                                           / sum(v["values"] for v in by_kind.values()))
    assert res.hits_by_kind["none"]["prompt_text"] == {k: v["values"] for k, v in by_kind.items()}


# ------------------------------------------------------------------------------ protected queries


def test_protect_queries_restores_the_redacted_values(redactor):
    from edgefuse.app.handlers.decoding import protect_queries
    from edgefuse.privacy.redact import restore
    from edgefuse.eval.queries import Query

    q = Query(qid="dolly/1", kind="dolly",
              instruction="Write a short thank-you note to Keira Forster at keira.forster@example.com.",
              context="Keira Forster organised the charity run last spring.", choices=None,
              answer=None, reference="", category="creative_writing")
    bare = Query(qid="dolly/2", kind="dolly", instruction="Email Taus Korgay at taus@example.org.",
                 context="", choices=None, answer=None, reference="", category="brainstorming")
    sent, maps = protect_queries([q, bare], "redact", None, None, redactor)
    for s in sent:
        assert "Forster" not in s.instruction + s.context and "@" not in s.instruction
    assert "Korgay" not in sent[1].instruction and sent[1].context == ""
    assert (sent[0].qid, sent[0].reference, sent[0].category) == (q.qid, q.reference, q.category)
    ph = {v: k for k, v in maps[0].items()}
    assert ph["Keira Forster"] in sent[0].instruction and ph["Keira Forster"] in sent[0].context
    assert ph["keira.forster@example.com"] in sent[0].instruction
    answer = f"Dear {ph['Keira Forster']}, thanks! (sent to {ph['keira.forster@example.com']})"
    assert restore(answer, maps[0]) == "Dear Keira Forster, thanks! (sent to keira.forster@example.com)"
    core = ph["Keira Forster"].strip("<>")  # a model may drop the angle brackets
    assert restore(f"Hi [{core}]", maps[0]) == "Hi Keira Forster"
    # restoring what was sent gives back what the user wrote
    assert restore(sent[0].instruction, maps[0]) == q.instruction
    assert restore(sent[0].context, maps[0]) == q.context
    assert restore(sent[1].instruction, maps[1]) == bare.instruction
    # protection off: the queries as they are, nothing to restore
    same, none = protect_queries([q], "off", None, None, redactor)
    assert same == [q] and none == [{}]


# ------------------------------------------------------------------------------ results


def privacy_rows() -> list[dict]:
    rows = []
    for mode, acc, hits in (("none", 1.0, 7), ("redact", 0.25, 0)):
        rows.append({"payload": "draft_tokens", "protection": mode, "canary_hits": hits,
                     "attacker_token_acc": acc, "attacker_exact_match": float(mode == "none"),
                     "task_acc": 0.5, "layer": None, "payloads": 4, "bytes": 1520})
        rows.append({"payload": "kv", "protection": mode, "canary_hits": 0,
                     "attacker_token_acc": 0.75, "attacker_exact_match": 0.0,
                     "task_acc": 0.5, "layer": 1, "payloads": 4, "bytes": 34436})
    return rows


def test_privacy_csv_and_plot(tmp_path):
    from edgefuse import results as R

    text = R.privacy_csv_text({"privacy": privacy_rows()})
    lines = text.splitlines()
    assert lines[0] == ",".join(R.PRIVACY_FIELDS) == (
        "payload,protection,canary_hits,attacker_token_acc,attacker_exact_match,task_acc,layer,payloads,bytes,"
        "attacker_token_acc_n,attacker_token_acc_ci95_low,attacker_token_acc_ci95_high,"
        "task_acc_n,task_acc_ci95_low,task_acc_ci95_high")
    assert lines[1] == "draft_tokens,none,7,1.0,1.0,0.5,,4,1520,,,,,,"
    assert lines[4] == "kv,redact,0,0.75,0.0,0.5,1,4,34436,,,,,,"
    assert len(lines) == 5
    assert R.privacy_csv_text({}) == lines[0] + "\n"
    png = R.plot_privacy({"privacy": privacy_rows()}, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    empty = R.plot_privacy({}, tmp_path / "e.png")
    assert empty.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_privacy_section_survives_the_scrubber(tmp_path):
    from edgefuse import results as R

    audit = {kind: {"payloads": 2, "bytes": 10, "canary_hits": 1, "hit_kinds": {"as_text": 1, "as_tokens": 0}}
             for kind in A.PAYLOADS}
    rec = R.RunRecorder(tmp_path, {"privacy": {"debug_text": False}})
    rec.add_round({"round": 1, "clients": [], "groups": []})
    rec.update({"privacy": privacy_rows(),
                "privacy_layers": [{"payload": "kv", "layer": 1, "protection": "none",
                                    "attacker_token_acc": 0.75, "attacker_exact_match": 0.0}],
                "privacy_audit": audit, "summary": {"privacy": {"canary_hits_with_redaction": 0}},
                "decoding": [], "decoding_records": [{"qid": "q", "text": "Keira Forster lives here"}]})
    rec.save()
    res = json.loads((tmp_path / R.JSON_NAME).read_text())
    assert res["privacy_audit"] == audit  # payload names and hit kinds are not free text
    assert res["privacy"] == privacy_rows() and res["privacy_layers"][0]["layer"] == 1
    assert res["summary"]["privacy"] == {"canary_hits_with_redaction": 0}
    assert res["decoding_records"][0]["text"].startswith("<text 24 chars hmac:")  # the scrubber ran
    with open(tmp_path / R.PRIVACY_CSV_NAME, newline="") as f:
        assert [r["protection"] for r in csv.DictReader(f)] == ["none", "none", "redact", "redact"]
    assert (tmp_path / R.PRIVACY_PNG_NAME).read_bytes()[:4] == b"\x89PNG"
    assert "Keira" not in (tmp_path / R.JSON_NAME).read_text()


# ------------------------------------------------------------------------------ config


def test_privacy_config_is_validated():
    from edgefuse.app.phases import compose
    from edgefuse.config import ConfigError

    with pytest.raises(ConfigError, match="bogus"):
        compose("tiny", "privacy.protection=bogus")
    with pytest.raises(ConfigError, match="l_cache"):
        compose("tiny", "privacy.cloud_auth.l_cache=0")
    with pytest.raises(ConfigError, match="max_update_norm"):
        compose("tiny", "privacy.max_update_norm=-1")
    with pytest.raises(ConfigError, match="probe.modes"):
        compose("tiny", "privacy.probe.modes=[none,bogus]")
    with pytest.raises(ConfigError, match="attack_layers"):
        compose("tiny", "privacy.probe.attack_layers=[1.5]")
    with pytest.raises(ConfigError, match="clients"):
        compose("tiny", "+federation.clients.1.protection=bogus")
    ok = compose("tiny", "privacy.cloud_auth.l_cache=1 privacy.max_update_norm=null")
    assert ok.privacy.cloud_auth.l_cache == 1 and ok.privacy.max_update_norm is None


def test_per_client_protection_is_honored():
    from edgefuse.config import compose
    from edgefuse.privacy.protect import client_protection

    cfg = compose("tiny", "+federation.clients.2.protection=redact")
    clients = cfg.federation.clients
    assert [client_protection(cfg, c) for c in clients] == ["both", "both", "redact", "both"]
    assert client_protection(cfg) == "both"
    off = compose("tiny", "privacy=disabled +federation.clients.2.protection=redact")
    assert client_protection(off, off.federation.clients[2]) == "off"
    yaml_off = OmegaConf.create({"privacy": {"enabled": True, "protection": False}})  # unquoted off
    assert client_protection(yaml_off) == "off"
    assert client_protection(yaml_off, {"protection": "rephrase"}) == "rephrase"
    with pytest.raises(ValueError):
        client_protection(yaml_off, {"protection": "bogus"})


# ------------------------------------------------------------------------------ server tally


class FakeGrid:
    run_id = 42

    def __init__(self, batches):
        self.batches = list(batches)
        self.sent = []

    def send_and_receive(self, messages, *, timeout=None):
        self.sent.append((list(messages), timeout))
        return iter(self.batches.pop(0))


def audited_reply(msg: Message, stats: dict | None) -> Message:
    content = RecordDict({"metrics": MetricRecord({"loss": 1.0})})
    if stats is not None:
        content["privacy_audit"] = ConfigRecord({"stats": json.dumps(stats)})
    return Message(content, reply_to=msg)


def test_audit_tally_sums_every_reply():
    from edgefuse.app.phases.privacy import AuditTally

    msg = message(RecordDict({"config": ConfigRecord({"cfg": "{}"})}))
    s1 = {"draft_tokens": {"payloads": 3, "bytes": 30, "canary_hits": 0, "hit_kinds": {}}}
    hit = {"message_type": "query.decode", "canary_kind": "email", "how": "as_tokens", "field": "", "n": 1}
    s2 = {"draft_tokens": {"payloads": 2, "bytes": 20, "canary_hits": 1, "hit_kinds": {"as_tokens": 1},
                           "hits": [hit]},
          "adapter": {"payloads": 1, "bytes": 1000, "canary_hits": 0, "hit_kinds": {}}}
    grid = FakeGrid([
        [audited_reply(msg, s1), audited_reply(msg, None), Message(Error(code=1, reason="x"), reply_to=msg)],
        [audited_reply(msg, s2)],
        [],
    ])
    tally = AuditTally(grid)
    assert tally.run_id == 42  # everything else is the grid's
    replies = tally.send_and_receive([msg], timeout=5.0)
    assert len(replies) == 3 and grid.sent[0][1] == 5.0
    assert tally.totals == {"draft_tokens": {"payloads": 3, "bytes": 30, "canary_hits": 0, "hit_kinds": {},
                                             "hits": []}}
    tally.send_and_receive([msg])
    tally.send_and_receive([msg])
    assert tally.totals == {
        "draft_tokens": {"payloads": 5, "bytes": 50, "canary_hits": 1, "hit_kinds": {"as_tokens": 1},
                         "hits": [hit]},
        "adapter": {"payloads": 1, "bytes": 1000, "canary_hits": 0, "hit_kinds": {}, "hits": []},
    }



def test_join_placeholders_renumbers_a_separately_redacted_context():
    from edgefuse.app.handlers.decoding import join_placeholders

    text, joint = join_placeholders(
        {"<PERSON_1>": "Keira Forster"}, "<PERSON_1> met <PERSON_2> at <EMAIL_ADDRESS_1>",
        {"<PERSON_1>": "Taus Korgay", "<PERSON_2>": "Keira Forster", "<EMAIL_ADDRESS_1>": "k@f.io"})
    assert text == "<PERSON_2> met <PERSON_1> at <EMAIL_ADDRESS_1>"
    assert joint == {"<PERSON_1>": "Keira Forster", "<PERSON_2>": "Taus Korgay",
                     "<EMAIL_ADDRESS_1>": "k@f.io"}


def test_audit_matches_text_case_insensitively_and_through_json_escapes():
    import json as _json

    from flwr.app import ConfigRecord, RecordDict

    aud = A.OutboundAudit()
    aud.watch(["Björn Ødegård", "Keira Forster", "abc"])  # "abc" is too short to watch
    assert aud.scan(b"call KEIRA FORSTER now") == {"as_text": 1}
    assert aud.scan(b"abcdef") == {}
    reply = RecordDict({"r": ConfigRecord({"records": _json.dumps([{"x": "Björn Ødegård"}]),
                                           "notes": _json.dumps({"t": "line one\nKeira Forster"})})})
    assert "\\u00d8" in str(reply["r"]["records"])  # json.dumps escaped the name
    assert "\\nKeira" in str(reply["r"]["notes"])  # ...and the newline, gluing an "n" to the name
    assert [aud.scan(b) for _, _, b in A.record_bytes(reply)] == [{"as_text": 1}, {"as_text": 1}]
    assert aud.scan(b'{"t": "line one\\nKeira Forster"}') == {"as_text": 1}  # an escape is no letter


# ------------------------------------------------- where hits come from, coincidences, known misses


def test_a_public_word_that_contains_a_canary_is_not_a_hit_the_canary_itself_is(mirror, fresh_audit):
    """The main job's one live metadata hit: the run's 16 canaries (seed 0) include the first
    name "Hanna", and the decoding reply's records carry the public GSM8K question
    gsm8k/test/586 ("Hannah needs to drink ...") as reference and answer text."""
    from edgefuse.eval.queries import load_gsm8k

    values = A.canary_values(mirror, 16, 0)
    assert values["Hanna"] == "first_name"
    (q,) = [q for q in load_gsm8k(mirror, 4, 0) if q.qid == "gsm8k/test/586"]
    assert q.instruction.startswith("Hannah needs")
    fresh_audit.watch(list(values), list(values.values()))

    def decoding_reply(text: str) -> RecordDict:  # the shape of handlers.decoding.decode's reply
        rec = {"qid": q.qid, "kind": "gsm8k", "mode": "cloud", "device": 0, "reference": q.reference,
               "tokens": [1, 2, 3], "text": text}
        return RecordDict({"decoding": ConfigRecord({"records": json.dumps([rec]), "protection": "both"})})

    def reply(content: RecordDict) -> dict:
        msg = message(RecordDict({"config": ConfigRecord({"cfg": "{}"})}), "query.decode")
        out = A.flower_mod(msg, None, lambda m, c: Message(content, reply_to=m))
        return json.loads(str(out.content["privacy_audit"]["stats"]))["metadata"]

    clean = reply(decoding_reply(q.instruction + " Hannah drinks 800 ml."))
    assert (clean["canary_hits"], clean["hits"]) == (0, [])
    leak = reply(decoding_reply("Ask Hanna, she knows."))  # the canary as a word: still caught
    assert leak["canary_hits"] == 1
    assert leak["hits"] == [{"message_type": "query.decode", "canary_kind": "first_name", "how": "as_text",
                             "field": "decoding.records", "n": 1}]
    # digits need a boundary too: a date canary inside a longer number is not that date
    dob = [v for v, k in values.items() if k == "date_of_birth"][0]
    assert fresh_audit.scan(f"id 1{dob}0".encode()) == {}
    assert fresh_audit.scan(f"born {dob}.".encode()) == {"as_text": 1}


def test_a_recorded_hit_names_where_it_was_never_the_value(mirror, tiny, fresh_audit):
    from edgefuse.cloud import protocol as P

    _, tok = tiny
    cfg = OmegaConf.create({"seed": 0, "data": {"mirror": str(mirror)},
                            "privacy": {"enabled": True, "probe": {"canaries": 6}}})
    values = A.watch_canaries(cfg, tok)
    kinds = A.canary_values(mirror, 6, 0)
    assert values == list(kinds) and kinds["Forster"] == "last_name"

    def handler(msg, context):  # a cloud OPEN sent while handling, and a metric naming a surname
        A.outbound("draft_tokens", P.encode(P.Open(ids_of(tok, "Follow up with Keira Forster."), "fp")))
        return Message(RecordDict({"metrics": ConfigRecord({"model": "smollm2-135m", "who": "Forster",
                                                            "seconds": 1.5})}), reply_to=msg)

    out = A.flower_mod(message(RecordDict({"config": ConfigRecord({"cfg": "{}"})}), "query.decode"),
                       None, handler)
    text = str(out.content["privacy_audit"]["stats"])
    stats = json.loads(text)
    assert stats["metadata"]["hits"] == [{"message_type": "query.decode", "canary_kind": "last_name",
                                          "how": "as_text", "field": "metrics.who", "n": 1}]
    assert {(h["canary_kind"], h["how"], h["field"]) for h in stats["draft_tokens"]["hits"]} == {
        ("name", "as_tokens", ""), ("last_name", "as_tokens", "")}
    assert stats["draft_tokens"]["canary_hits"] == 2
    assert not any(v.lower() in text.lower() for v in values)  # the audit record holds no canary


def test_reencoded_canaries_are_known_misses(tiny, fresh_audit):
    """Documents a limit (docs/privacy.md): the scan is exact matching of the UTF-8 text and
    the device tokenizer's ids, so the same canary base64- or UTF-16-encoded is NOT found.
    If this test fails, the audit learned an encoding: update the docs, then this test."""
    import base64

    _, tok = tiny
    fresh_audit.watch(["Keira Forster"], ["name"])
    fresh_audit.use_tokenizer(tok)
    plain = b"Follow up with Keira Forster."
    assert fresh_audit.scan(plain) == {"as_text": 1}  # the same text as it is: caught
    misses = [base64.b64encode(plain), base64.b64encode(b"x" + plain),  # every base64 alignment
              base64.b64encode(b"xy" + plain), plain.decode().encode("utf-16-le"),
              plain.decode().encode("utf-16-be"), plain.decode().encode("utf-16"),
              plain.decode().encode("utf-32-le")]
    for data in misses:
        assert fresh_audit.scan(data) == {}, data[:20]
    assert fresh_audit.outbound("metadata", misses[0]) == 0
    assert fresh_audit.snapshot()["metadata"]["canary_hits"] == 0
