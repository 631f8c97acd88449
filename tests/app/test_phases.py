"""The ServerApp's main loop and its phases, driven through ``server_app.main`` with a fake
Grid: rounds first, then each enabled phase of ``PHASES`` in list order; sections into
results.json; a phase appended to the list runs with no other edit; a failing phase fails the
run and keeps what came before. Also :func:`edgefuse.app.messages.ask` (one error for every
way a node fails) and the group fields every message carries.

The fake Grid answers ``query.info`` / ``train`` / ``evaluate`` like the tiny federation's
four clients (one-module adapters, hand-made), and any other message type from a table.
"""

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from edgefuse.app import phases, server_app
from edgefuse.app.messages import NodeError, ask
from edgefuse.app.phases import Phase
from edgefuse.app.phases.privacy import Privacy
from edgefuse.app.strategy import GroupedLoRA, NodeInfo
from edgefuse.config import compose
from edgefuse.lora import pack_adapter
from edgefuse.results import JSON_NAME
from tests.app.test_strategy import KEY

CLIENTS = {101: (0, "tiny-llama", 4), 102: (1, "tiny-llama", 8), 103: (2, "tiny-qwen2", 4),
           104: (3, "tiny-gemma3", 4)}  # node id -> the tiny experiment's federation entry
OFF = "c2c=disabled cloud=disabled privacy=disabled outputs.save_adapters=false"
AUDIT = {"adapter": {"payloads": 1, "bytes": 40, "canary_hits": 0, "hit_kinds": {}}}


@pytest.fixture(autouse=True)
def server_identity(monkeypatch):
    """What Flower sets in a ServerApp process (messages are created with it)."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class FakeGrid:
    """Flower's Grid with four tiny clients answering in-process.

    ``log`` gets every message type sent (a phase may append its own events to it);
    ``sent`` every message; ``answers`` maps other message types to ``fn(msg) -> RecordDict``
    (raising makes an error reply, as Flower's runtime does). Every reply carries a
    ``privacy_audit`` record of one 40-byte adapter payload."""

    def __init__(self, log: list, answers: dict | None = None):
        self.log, self.sent, self.answers = log, [], dict(answers or {})

    def get_node_ids(self):
        return list(CLIENTS)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            kind = msg.metadata.message_type
            self.log.append(kind)
            self.sent.append(msg)
            try:
                content = self._answer(kind, msg)
            except Exception as ex:  # as Flower's runtime reports a ClientApp exception
                replies.append(Message(Error(code=2, reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg))
                continue
            content["privacy_audit"] = ConfigRecord({"stats": json.dumps(AUDIT)})
            replies.append(Message(content, reply_to=msg))
        return replies

    def _answer(self, kind: str, msg: Message) -> RecordDict:
        pid, model, rank = CLIENTS[msg.metadata.dst_node_id]
        if kind == "query.info":
            return RecordDict({"info": ConfigRecord({"partition_id": pid, "model": model,
                                                     "lora_rank": rank, "public_key": bytes(32)})})
        if kind == "train":
            rng = np.random.default_rng(pid)
            arrays, index = pack_adapter({
                f"{KEY}.lora_A.weight": rng.normal(0, 0.01, (rank, 16)).astype(np.float32),
                f"{KEY}.lora_B.weight": rng.normal(0, 0.01, (16, rank)).astype(np.float32)})
            return RecordDict({
                "adapter": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                "meta": ConfigRecord({"partition_id": pid, "model": model, "lora_rank": rank,
                                      "lora_alpha": 16.0, "adapter_index": index}),
                "metrics": MetricRecord({"train_loss": 2.0 - 0.1 * pid, "seconds": 0.1,
                                         "num_examples": 8})})
        if kind == "evaluate":
            return RecordDict({"metrics": MetricRecord({
                "eval_loss": 1.5, "eval_ppl": float(np.exp(1.5)), "base_eval_loss": 2.0,
                "base_eval_ppl": float(np.exp(2.0)), "seconds": 0.1})})
        return self.answers[kind](msg)


def recording(name: str, log: list, sections=None, on: bool = True, fail: str | None = None):
    """A phase class named ``name`` that logs each call into ``log``; ``run`` returns
    ``sections`` (or raises RuntimeError(``fail``)); ``after_round`` returns a per-round
    section on even rounds only."""

    class Recording(Phase):
        def enabled(self, cfg):
            return on

        def start(self, ctx):
            log.append(f"{name}.start")

        def after_round(self, ctx, r):
            log.append(f"{name}.after_round {r}")
            return {f"{name}_round": {"round": r}} if r % 2 == 0 else {}

        def run(self, ctx):
            log.append(f"{name}.run (round {ctx.round} of {ctx.last_round})")
            if fail:
                raise RuntimeError(fail)
            return sections or {}

    Recording.name = name
    return Recording


def run_main(tmp_path, grid, overrides: str = OFF, rounds: int = 2) -> dict:
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={
        "experiment": "tiny", "overrides": f"{overrides} federation.num_rounds={rounds}",
        "output-dir": str(tmp_path / "run")})
    server_app.main(grid, context)
    return json.loads((tmp_path / "run" / JSON_NAME).read_text())


def test_phases_run_in_list_order_after_the_rounds_and_a_disabled_one_never(tmp_path, monkeypatch):
    log = []
    monkeypatch.setattr(phases, "PHASES", [recording("b", log), recording("off", log, on=False),
                                           recording("a", log)])
    res = run_main(tmp_path, FakeGrid(log), rounds=2)
    assert res["status"] == "completed"
    one_round = ["train"] * 4 + ["evaluate"] * 4
    # round 2 sends no query.info: every node was identified in round 1
    assert log == (["b.start", "a.start"] + ["query.info"] * 4 + one_round
                   + ["b.after_round 1", "a.after_round 1"] + one_round
                   + ["b.after_round 2", "a.after_round 2",
                      "b.run (round 2 of 2)", "a.run (round 2 of 2)"])
    assert not any(e.startswith("off") for e in log)
    assert list(res["summary"]["phase_seconds"]) == ["b", "a"]


def test_sections_land_in_results_json_with_their_seconds(tmp_path, monkeypatch):
    log = []
    rows = [{"mode": "edge", "n": 3}, {"mode": "cloud", "n": 3}]
    monkeypatch.setattr(phases, "PHASES", [recording("a", log, {"a": rows, "a_records": [1, 2],
                                                                 "summary": {"a_service": {"port": 9}}})])
    res = run_main(tmp_path, FakeGrid(log), rounds=2)
    assert res["a"] == rows and res["a_records"] == [1, 2]
    assert res["summary"]["a_service"] == {"port": 9}
    assert res["a_round"] == {"round": 2}  # after_round's sections too
    first, last = res["rounds"]
    assert "a" not in first["seconds"]  # round 1's after_round returned nothing
    assert last["seconds"]["a"] == res["summary"]["phase_seconds"]["a"] >= 0
    # the round itself is intact: four clients trained and evaluated
    assert [c["status"] for c in last["clients"]] == ["ok"] * 4
    assert [c["eval_loss"] for c in last["clients"]] == [1.5] * 4
    assert last["seconds"]["total"] >= last["seconds"]["train"] + last["seconds"]["a"]


def test_a_phase_appended_to_the_list_runs_with_no_other_edit(tmp_path, monkeypatch):
    """The real privacy phase (its probe answered by the fake client), then one more phase
    added by one line: both run, in order, each with its sections."""
    log = []
    probe_rows = [{"payload": "kv", "protection": "none", "canary_hits": 3},
                  {"payload": "kv", "protection": "redact", "canary_hits": 0}]

    def probe(msg):
        log.append("probe")
        return RecordDict({"privacy": ConfigRecord({
            "rows": json.dumps(probe_rows), "layers": json.dumps([{"layer": 1}]),
            "seconds": json.dumps({"attack": 0.5}), "fallbacks": json.dumps({"rephrase": 0}),
            "ner_recall": json.dumps({"PERSON": 1.0})})})

    monkeypatch.setattr(phases, "PHASES", phases.PHASES + [recording("extra", log, {"extra": [7]})])
    grid = FakeGrid(log, {"query.privacy": probe})
    res = run_main(tmp_path, grid, overrides="c2c=disabled cloud=disabled outputs.save_adapters=false",
                   rounds=1)
    assert res["status"] == "completed"
    assert log[-3:] == ["query.privacy", "probe", "extra.run (round 1 of 1)"]
    assert res["extra"] == [7]
    assert res["privacy"] == probe_rows and res["privacy_layers"] == [{"layer": 1}]
    # the live audit as it stood before the probe: 4 + 4 + 4 replies (info, train, evaluate)
    assert res["privacy_audit"]["adapter"]["payloads"] == 12
    assert res["privacy_audit"]["adapter"]["bytes"] == 12 * 40
    s = res["summary"]["privacy"]
    assert (s["probe_partition"], s["probe_model"]) == (0, "tiny-llama")
    assert s["canary_hits_with_redaction"] == 0 and s["live_canary_hits"] == 0
    assert s["ner_recall"] == {"PERSON": 1.0}
    assert list(res["summary"]["phase_seconds"]) == ["privacy", "extra"]
    assert res["rounds"][-1]["seconds"]["privacy"] == res["summary"]["phase_seconds"]["privacy"]
    # the probe message names partition 0's group and carries its adapter
    (msg,) = [m for m in grid.sent if m.metadata.message_type == "query.privacy"]
    conf = msg.content["config"]
    assert (conf["adapter_model"], conf["adapter_rank"]) == ("tiny-llama", 4)
    assert "adapter" in msg.content.array_records


def test_a_failing_phase_fails_the_run_and_keeps_the_earlier_sections(tmp_path, monkeypatch):
    log = []
    monkeypatch.setattr(phases, "PHASES", [recording("a", log, {"a": [1]}),
                                           recording("boom", log, fail="the service died"),
                                           recording("c", log, {"c": [3]})])
    with pytest.raises(RuntimeError, match="the service died"):
        run_main(tmp_path, FakeGrid(log), rounds=1)
    res = json.loads((tmp_path / "run" / JSON_NAME).read_text())
    assert res["status"] == "failed" and res["error"] == "RuntimeError: the service died"
    assert res["a"] == [1] and "c" not in res
    assert "c.run (round 1 of 1)" not in log
    assert len(res["rounds"]) == 1 and res["rounds"][0]["clients"][0]["status"] == "ok"
    assert list(res["summary"]["phase_seconds"]) == ["a"]


def test_config_checks_run_for_enabled_phases_only(monkeypatch):
    seen = []

    class Checked(recording("checked", [])):
        def check(self, cfg):
            seen.append(self.name)

    class Off(Checked):
        name = "off"

        def enabled(self, cfg):
            return False

    monkeypatch.setattr(phases, "PHASES", [Checked, Off])
    phases.compose("tiny", OFF)
    assert seen == ["checked"]


# ----------------------------------------------------------------------------- ask


@pytest.fixture
def strategy():
    s = GroupedLoRA(compose("tiny", OFF))
    s.nodes = {n: NodeInfo(n, *entry) for n, entry in CLIENTS.items()}
    return s


def test_ask_sends_the_group_and_raises_one_clear_error(strategy):
    def boom(msg):
        raise ValueError("no fuser installed for sharer 'tiny-qwen2'")

    grid = FakeGrid([], {"query.answer": boom,
                         "query.share": lambda msg: RecordDict({"c2c": ConfigRecord({"ms": [1.5]})})})
    node = strategy.nodes[103]
    reply = ask(grid, strategy, node, "query.share", {"c2c": ConfigRecord({"kind": "kv"})},
                timeout=5, round_idx=3)
    assert list(reply["c2c"]["ms"]) == [1.5]
    msg = grid.sent[-1]
    conf = msg.content["config"]
    # no global adapter yet for tiny-qwen2: no adapter travels, the group does
    assert (conf["adapter_model"], conf["adapter_rank"], conf["round"]) == ("tiny-qwen2", 4, 3)
    assert "adapter" not in msg.content.array_records and msg.content["c2c"]["kind"] == "kv"

    with pytest.raises(NodeError) as err:
        ask(grid, strategy, node, "query.answer", timeout=5, round_idx=3)
    assert str(err.value) == ("partition 2 (tiny-qwen2, node 103) query.answer: <class 'ValueError'>:"
                              "<'no fuser installed for sharer 'tiny-qwen2''>")

    class Silent(FakeGrid):
        def send_and_receive(self, messages, *, timeout=None):
            return []

    with pytest.raises(NodeError, match=r"^partition 2 \(tiny-qwen2, node 103\) did not answer "
                                        r"query.decode within 5 s$"):
        ask(Silent([]), strategy, node, "query.decode", timeout=5, round_idx=3)
    # a reply that does not parse names the node and the message too
    with pytest.raises(NodeError, match=r"^partition 2 .* query.share: the reply has no record 'privacy'$"):
        reply.json("privacy", "rows")
    with pytest.raises(NodeError, match=r"^partition 2 .* query.share: the reply has no c2c.results$"):
        reply.json("c2c", "results")
    reply["c2c"]["results"] = "[{'qid': 1}]"
    with pytest.raises(NodeError, match=r"query.share: c2c.results is not JSON \(Expecting property name"):
        reply.json("c2c", "results")


def test_the_privacy_phase_stops_on_a_node_error(tmp_path, monkeypatch):
    """The privacy phase through the real list: the device's error becomes the run's."""
    def fail(msg):
        raise RuntimeError("spaCy model en_core_web_sm is not installed")

    monkeypatch.setattr(phases, "PHASES", [Privacy])
    with pytest.raises(NodeError, match="query.privacy: .*spaCy model en_core_web_sm"):
        run_main(tmp_path, FakeGrid([], {"query.privacy": fail}),
                 overrides="c2c=disabled cloud=disabled outputs.save_adapters=false", rounds=1)
    res = json.loads((tmp_path / "run" / JSON_NAME).read_text())
    assert res["status"] == "failed" and "partition 0 (tiny-llama, node 101)" in res["error"]
    assert "privacy" not in res and len(res["rounds"]) == 1


def test_query_kinds_are_defined_once_and_unknown_kinds_refused():
    from edgefuse.app import messages as M

    assert [M.query_type(k) for k in M.QUERY_KINDS] == [
        "query.info", "query.fusers", "query.share", "query.refine", "query.answer",
        "query.forget", "query.decode", "query.privacy"]
    with pytest.raises(ValueError, match="unknown query kind 'bogus'"):
        M.query_type("bogus")
