"""The device's decoding handler (edgefuse.app.handlers.decoding) drafts with the drafter the
config names: ``device_drafter`` builds it (the pruned head from the public corpus), and a
``query.decode`` message decoded through a real in-process cloud service (tiny random qwen2
target) yields records of that drafter whose speculative output equals the cloud's.

The client is a stand-in object with the attributes the handler reads (``entry``, ``slot``,
``cfg``); its model is tiny-qwen2 with a LoRA adapter attached (a PEFT model, as on a client)."""

import json
import time
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict

from edgefuse.app.handlers import decoding
from edgefuse.cloud.decoding import DRAFTERS, DraftHead
from edgefuse.cloud.service import CloudService
from edgefuse.cloud.target import Target
from edgefuse.config import compose, lora_targets
from edgefuse.eval.queries import Query
from edgefuse.lora import attach_lora
from edgefuse.models import tiny_model
from edgefuse.transport.identity import CLOUD, TrustStore, UntrustedPeerError, fingerprint, provision
from tests.cloud.conftest import device_keys, service_keys
from tests.conftest import mirror_path


def _cfg(name: str, tmp_path):
    over = [f"cloud.decode.drafter={name}", "cloud.decode.shallow_layers=1", "cloud.decode.draft_head=64",
            "cloud.decode.ngram_n=2", "privacy.enabled=false", "cloud.modes=[cloud,spec_sync,spec_async]",
            f"paths.cache_dir={tmp_path}"]
    if name == "pruned_head":  # its head counts tokens of the public corpus
        if mirror_path() is None:
            pytest.skip("no data mirror: set EDGEFUSE_DATA_MIRROR or place ../shared/data")
        over.append(f"data.mirror={mirror_path()}")
    return compose("tiny", over)


def _device_model(cfg):
    model, tok = tiny_model("qwen2", seed=0)
    return attach_lora(model, rank=4, alpha=16.0, dropout=0.0,
                       target_modules=lora_targets(cfg, "tiny-qwen2"), seed=0), tok


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_device_drafter_is_the_configured_one(name, tmp_path):
    cfg = _cfg(name, tmp_path)
    model, tok = _device_model(cfg)
    spec, head = decoding.device_drafter(cfg, model, tok)
    assert spec.name == name and spec.shallow_layers == 1 and spec.ngram_n == 2
    if name == "pruned_head":
        assert isinstance(head, DraftHead) and head.size == 64
        assert list((tmp_path / "draft_heads").glob("*-64.json"))  # cached where the config says
    else:
        assert head is None


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_decode_message_drafts_with_the_configured_drafter(name, tmp_path, one_thread):
    cfg = _cfg(name, tmp_path)
    target, tok = tiny_model("qwen2", seed=1)
    svc = CloudService(Target(target, tok, "tiny-target"), "127.0.0.1", 0, max_wait_ms=5,
                       **service_keys())
    svc.start_in_thread()
    try:
        model, _ = _device_model(cfg)
        client = SimpleNamespace(entry=SimpleNamespace(model="tiny-qwen2"), cfg=cfg,
                                 slot={"peft": model, "tok": tok})
        queries = [Query(qid=f"dolly/{i}", kind="dolly", instruction=f"say item {i} twice: item {i}",
                         context="", choices=None, answer=None, reference="", category="c") for i in range(2)]
        content = RecordDict({"cloud": ConfigRecord({"host": "127.0.0.1", "port": svc.port,
                                                     "queries": json.dumps([q.to_dict() for q in queries])})})
        meta = Metadata(run_id=1, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="",
                        group_id="", created_at=time.time(), ttl=60.0, message_type="query.decode")
        reply = decoding.decode(Message(content=content, metadata=meta),
                                Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                                        state=RecordDict(), run_config={}),
                                client)
    finally:
        svc.stop()
    records = json.loads(str(reply["decoding"]["records"]))
    cloud = {r["qid"]: r["tokens"] for r in records if r["mode"] == "cloud"}
    spec = [r for r in records if r["mode"] in ("spec_sync", "spec_async")]
    assert len(cloud) == 2 and len(spec) == 4
    for r in spec:
        assert r["drafter"] == name and r["fallback"] is None
        assert r["tokens"] == cloud[r["qid"]]  # lossless whichever drafter
    assert all(r["drafter"] is None for r in records if r["mode"] == "cloud")


@pytest.mark.parametrize("device", ["tiny-gemma3", "tiny-llama"])
def test_a_device_of_another_tokenizer_decodes_every_mode_with_the_cloud(device, tmp_path, one_thread):
    """tiny-gemma3 (a SentencePiece-style tokenizer with byte fallback) and tiny-llama
    (another byte-level BPE) against a tiny-qwen2 cloud: the handler decodes across the
    vocabularies in every mode, split inference included (the device runs the target's own
    first and last layers on the cloud's ids); the records say ``cross`` and carry the cloud's
    ids; the speculative outputs equal the cloud's, and fusion at weight 0 does too (the split
    modes equal the unsplit target up to the int8 activations, so only their ids are checked)."""
    from edgefuse.models import load_model

    cfg = compose("tiny", ["privacy.enabled=false", "cloud.decode.drafter=full_head",
                           "cloud.decode.fusion_weight=0.0", f"paths.cache_dir={tmp_path}",
                           "cloud.modes=[edge,cloud,spec_sync,spec_async,fusion_static,fusion_adaptive,split,split_spec]"])
    from edgefuse.cloud.split_target import SplitTarget

    target, ctok = load_model("tiny-qwen2")  # the split device's layers are this model's
    model, tok = load_model(device)
    assert decoding.cloud_vocabulary(cfg, tok)[1] is not None  # the tokenizers differ
    peft = attach_lora(model, rank=4, alpha=16.0, dropout=0.0, target_modules=lora_targets(cfg, device), seed=0)
    svc = CloudService(Target(target, ctok, "tiny-target"), "127.0.0.1", 0, max_wait_ms=5,
                       split=SplitTarget(target, ctok, "tiny-target", None), **service_keys())
    svc.start_in_thread()
    try:
        client = SimpleNamespace(entry=SimpleNamespace(model=device), cfg=cfg, slot={"peft": peft, "tok": tok})
        reply = decoding.decode(_decode_message(svc.port),
                                Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                                        state=RecordDict(), run_config={}), client)
    finally:
        svc.stop()
    rec = reply["decoding"]
    assert str(rec["tokenizer"]) == "cross"
    records = {r["mode"]: r for r in json.loads(str(rec["records"]))}
    assert set(records) == {"edge", "cloud", "spec_sync", "spec_async", "fusion_static", "fusion_adaptive",
                            "split", "split_spec"}
    assert records["edge"]["tokenizer"] == "own"
    cloud = records["cloud"]
    assert cloud["tokenizer"] == "cross" and cloud["tokens"] and max(cloud["tokens"]) < len(ctok)
    for mode in ("spec_sync", "spec_async", "fusion_static"):
        assert records[mode]["tokenizer"] == "cross" and records[mode]["fallback"] is None
        assert records[mode]["tokens"] == cloud["tokens"], mode
        assert records[mode]["text"] == ctok.decode(cloud["tokens"], skip_special_tokens=True)
    for mode in ("split", "split_spec"):
        assert records[mode]["tokenizer"] == "cross" and records[mode]["fallback"] is None
        assert records[mode]["tokens"] and max(records[mode]["tokens"]) < len(ctok)


def _decode_message(port: int) -> Message:
    q = Query(qid="dolly/0", kind="dolly", instruction="say item 0", context="", choices=None,
              answer=None, reference="", category="c")
    content = RecordDict({"cloud": ConfigRecord({"host": "127.0.0.1", "port": port,
                                                 "queries": json.dumps([q.to_dict()])})})
    meta = Metadata(run_id=1, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="",
                    group_id="", created_at=time.time(), ttl=60.0, message_type="query.decode")
    return Message(content=content, metadata=meta)


def test_the_cloud_key_comes_from_the_device_home_not_the_server(tmp_path, one_thread):
    """A cloud with another identity (a man in the middle), and a server whose config points
    the device at a keys folder that trusts it: the handler still checks the key its own
    device home pins, and refuses."""
    fake_root = tmp_path / "identity"  # the keys root a server-chosen cache_dir would give
    provision(fake_root, 1)  # a whole keys tree whose devices trust the fake cloud
    fake = service_keys_at(fake_root)
    cfg = compose("tiny", ["cloud.decode.drafter=ngram", "privacy.enabled=false",
                           "cloud.modes=[cloud]", f"paths.cache_dir={tmp_path}"])
    target, tok = tiny_model("qwen2", seed=1)
    svc = CloudService(Target(target, tok, "tiny-target"), "127.0.0.1", 0, max_wait_ms=5, **fake)
    svc.start_in_thread()
    try:
        model, _ = _device_model(cfg)
        client = SimpleNamespace(entry=SimpleNamespace(model="tiny-qwen2"), cfg=cfg,
                                 slot={"peft": model, "tok": tok})
        with pytest.raises(UntrustedPeerError) as err:
            decoding.decode(_decode_message(svc.port),
                            Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                                    state=RecordDict(), run_config={}), client)
    finally:
        svc.stop()
    pinned = device_keys(0)["trust"].get(CLOUD)
    assert fingerprint(pinned) in str(err.value)
    assert fingerprint(fake["identity"].public_bytes()) in str(err.value)
    assert svc.stats()["devices_authenticated"] == 0 and svc.stats()["sessions_total"] == 0


def service_keys_at(root) -> dict:
    from edgefuse.transport.identity import AUTHORIZED_FILE, IDENTITY_FILE, cloud_dir, load_identity

    return {"identity": load_identity(cloud_dir(root) / IDENTITY_FILE),
            "authorized": TrustStore.load(cloud_dir(root) / AUTHORIZED_FILE)}


@pytest.mark.parametrize("where", ["entry", "node_config"])
def test_an_edge_profile_device_decodes_on_onnx_runtime(where, tmp_path, one_thread):
    """``device.profile: edge`` (in the federation entry, or the device's own node config):
    the handler exports the model with this round's adapter merged and decodes on ONNX Runtime
    (fp32 here, so its edge-only tokens equal PyTorch's); the pruned-head drafter becomes the
    full head; speculative output still equals the cloud's; the reply says which runtime ran."""
    pytest.importorskip("onnxruntime_genai")
    from omegaconf import OmegaConf

    from edgefuse.lora import get_adapter_state, set_adapter_state

    cfg = compose("tiny", ["cloud.decode.drafter=full_head", "privacy.enabled=false",
                           "cloud.modes=[edge,cloud,spec_async]", f"paths.cache_dir={tmp_path}",
                           "cloud.devices=1"])
    target, tok = tiny_model("qwen2", seed=1)
    svc = CloudService(Target(target, tok, "tiny-target"), "127.0.0.1", 0, max_wait_ms=5, **service_keys())
    svc.start_in_thread()
    model, _ = _device_model(cfg)
    state = get_adapter_state(model)  # a trained adapter: B != 0, so merging it matters
    set_adapter_state(model, {k: v + 0.05 for k, v in state.items()})
    profile = {"profile": "edge", "quant": "fp32"}
    entry = OmegaConf.create({"model": "tiny-qwen2", **({"device": profile} if where == "entry" else {})})
    node = {"partition-id": 0, **({"device-profile": "edge", "device-quant": "fp32"} if where == "node_config" else {})}
    try:
        replies = {}
        for name, ent, nc in (("edge", entry, node), ("torch", OmegaConf.create({"model": "tiny-qwen2"}),
                                                        {"partition-id": 0})):
            client = SimpleNamespace(entry=ent, cfg=cfg, slot={"peft": model, "tok": tok})
            replies[name] = decoding.decode(_decode_message(svc.port),
                                            Context(run_id=1, node_id=1, node_config=nc, state=RecordDict(),
                                                    run_config={}), client)
    finally:
        svc.stop()
    facts = json.loads(str(replies["edge"]["decoding"]["runtime"]))
    assert facts["profile"] == "edge" and facts["runtime"] == "onnxruntime-fp32" and facts["adapter"] != "base"
    assert json.loads(str(replies["torch"]["decoding"]["runtime"]))["runtime"] == "torch-cpu"
    recs = {n: {r["mode"]: r for r in json.loads(str(rep["decoding"]["records"]))} for n, rep in replies.items()}
    assert recs["edge"]["edge"]["tokens"] == recs["torch"]["edge"]["tokens"]  # the adapter was merged
    assert recs["edge"]["spec_async"]["tokens"] == recs["edge"]["cloud"]["tokens"]
    assert recs["edge"]["spec_async"]["drafter"] == "full_head"
    assert list((tmp_path / "onnx" / "tiny-qwen2").glob("fp32-*"))  # cached where the config says
