"""The C2C controls and the response NLL through the real phase and the real device handlers.

Server: :class:`edgefuse.app.phases.c2c.C2C` with a real fuser registry; devices: the real
handlers (:mod:`edgefuse.app.handlers.c2c`) on tiny random-weight models (tiny-llama as
partition 0, tiny-qwen2 as partition 2), behind the in-process relay of
``tests/app/test_server_units.py``. Each pair's zero- and shuffled-sharer control fusers
carry the *same weights* as its real fuser (only ``sharer_control`` differs), so any
difference between the rows comes from what the receiver feeds the fuser.
"""

import json

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from edgefuse.app.handlers import c2c as handlers
from edgefuse.app.messages import fuser_key, fuser_meta_key
from edgefuse.app.phases import c2c as c2c_phase
from edgefuse.app.phases.c2c import C2C, check_eval, control_version
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.hub import FuserService, Side
from edgefuse.c2c.registry import FuserCard, FuserRegistry, FuserVersionError, pack_state
from edgefuse.config import ConfigError, compose
from edgefuse.lora import get_adapter_state
from tests.app.test_phases import server_identity  # noqa: F401
from tests.app.test_server_units import (DEVICES, Device, RelayGrid, _one_thread,  # noqa: F401
                                         planted_queries, relay_phase)

pytestmark = pytest.mark.usefixtures("server_identity")
PAIRS = [("tiny-qwen2", "tiny-llama"), ("tiny-llama", "tiny-qwen2")]


def controls_cfg(controls: bool = True):
    return compose("tiny", ["c2c.eval.batch_queries=2", "c2c.eval.modes=[alone,c2c]",
                            f"c2c.eval.controls={str(controls).lower()}", "c2c.eval.max_new_tokens=2",
                            "c2c.eval.nll_max_tokens=32", "c2c.fuser.bottleneck=8",
                            "c2c.fuser.gate_init=1.0"])


class FuserGrid(RelayGrid):
    """The relay, also delivering ``query.fusers`` to the device's install handler."""

    HANDLERS = {**RelayGrid.HANDLERS, "query.fusers": lambda msg, ctx, client: RecordDict(
        {"c2c": ConfigRecord({"installed": handlers.install_fusers(msg, ctx, client)["installed"]})})}


def side(dev: Device) -> Side:
    """The server's view of a device: its model and the adapter it holds."""
    return Side(dev.model_name, dev.node.partition_id, get_adapter_state(dev.client.slot["peft"]), 4, 16.0)


def register(service: FuserService, devs: dict, controls=("zero", "shuffled")) -> None:
    """Save each pair's fuser (random weights) and its controls (the same weights) in the
    service's registry, at the versions the phase looks up."""
    sd = {d.model_name: side(d) for d in devs.values()}
    models = {d.model_name: d.client.slot["peft"] for d in devs.values()}
    for seed, (s, r) in enumerate(PAIRS):
        torch.manual_seed(seed)
        fuser = C2CFuser(kv_spec_from_config(models[r].config), kv_spec_from_config(models[s].config),
                         service.fcfg)
        with torch.no_grad():
            for p in fuser.parameters():
                p.add_(0.3 * torch.randn(p.shape))  # large enough for the sharer to matter
        for control in ("none",) + tuple(controls):
            version = (service.version(sd[s], sd[r]) if control == "none"
                       else control_version(service, sd[s], sd[r], control))
            config = {**service.fcfg_dict, "sharer_control": control}
            fuser.config = FuserConfig.from_dict(config)
            service.registry.save(fuser, config, version, FuserCard.for_version(version, train_steps=1))


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """``make(controls)`` -> (phase, grid, devices) with the fusers registered and sent."""

    def make(controls: bool = True, registered=("zero", "shuffled")):
        cfg = controls_cfg(controls)
        devs = {n: Device(cfg, n) for n in DEVICES}
        grid = FuserGrid(devs)
        phase = relay_phase(cfg, devs, grid, tmp_path, monkeypatch)
        phase.service = FuserService(cfg, FuserRegistry(tmp_path / "registry"))
        register(phase.service, devs, registered)
        monkeypatch.setattr(c2c_phase, "sides", lambda strategy, reps: {d.model_name: side(d) for d in devs.values()})
        status = phase._distribute()
        assert status == {"tiny-llama": "installed", "tiny-qwen2": "installed"}
        return phase, grid, devs

    return make


def fusers_messages(grid):
    return [m for m in grid.sent if m.metadata.message_type == "query.fusers"]


def test_controls_off_no_control_rows_and_no_control_fusers(setup):
    phase, grid, devs = setup(controls=False)
    for msg in fusers_messages(grid):
        assert not any("@" in k for k in msg.content.array_records)  # only the real fusers
        assert not any(k.startswith("controls.") or "@" in k for k in msg.content["c2c"].keys())
    for dev in devs.values():
        assert [k for k in dev.context.state.array_records if k.startswith("fuser.")] == [
            fuser_key(m) for m in ("tiny-qwen2", "tiny-llama") if m != dev.model_name]
    rows = phase.evaluate()
    assert [(r["receiver"], r["mode"]) for r in rows] == [(r, m) for r in ("tiny-llama", "tiny-qwen2")
                                                          for m in ("alone", "c2c")]
    assert all("nll_vs_zero" not in r and "nll_vs_shuffled" not in r for r in rows)
    assert all(r["n_nll"] == 2 and r["nll"] > 0 for r in rows)  # the two Dolly rows, every mode
    asked = {str(m.content["c2c"]["mode"]) for m in grid.sent if m.metadata.message_type == "query.answer"}
    assert asked == {"alone", "c2c"}


def test_control_rows_beside_c2c_differ_from_it_and_are_paired_with_it(setup):
    phase, grid, devs = setup(controls=True)
    (msg, *_) = fusers_messages(grid)
    conf = msg.content["c2c"]
    sharer = list(conf["sharers"])[0]
    assert list(conf[f"controls.{sharer}"]) == ["zero", "shuffled"]
    assert {fuser_key(sharer, c) for c in ("none", "zero", "shuffled")} <= set(msg.content.array_records)
    for c in ("none", "zero", "shuffled"):  # each slot holds the fuser of its own sharer_control
        assert json.loads(str(conf[fuser_meta_key(sharer, c)]))["config"]["sharer_control"] == c

    rows = phase.evaluate()
    modes = ("alone", "c2c", "c2c_zero", "c2c_shuffled")
    assert [(r["receiver"], r["mode"]) for r in rows] == [(r, m) for r in ("tiny-llama", "tiny-qwen2") for m in modes]
    assert all("error" not in r and r["n"] == 5 and r["n_nll"] == 2 for r in rows)
    by = {(r["receiver"], r["mode"]): r for r in rows}
    for receiver in ("tiny-llama", "tiny-qwen2"):
        c2c, zero, shuf = (by[(receiver, m)] for m in ("c2c", "c2c_zero", "c2c_shuffled"))
        # the same weights: the rows differ only because the sharer input was zeroed / swapped
        assert abs(c2c["nll"] - zero["nll"]) > 1e-4 and abs(c2c["nll"] - shuf["nll"]) > 1e-4
        for control, row in (("zero", zero), ("shuffled", shuf)):
            assert c2c[f"nll_vs_{control}"] == pytest.approx(c2c["nll"] - row["nll"], abs=1e-9)
            assert c2c[f"nll_vs_{control}_n"] == 2
            assert c2c[f"nll_vs_{control}_ci95_low"] <= c2c[f"nll_vs_{control}"] <= c2c[f"nll_vs_{control}_ci95_high"]
            assert row["nll_vs_alone"] == pytest.approx(row["nll"] - by[(receiver, "alone")]["nll"], abs=1e-9)
        assert "nll_vs_zero" not in zero and "nll_vs_zero" not in by[(receiver, "alone")]
    # the controls run on c2c's exchange; the shuffled one in messages of at least two
    # queries (5 queries by 2: [2, 2, 1] for the others, [2, 3] for it)
    sizes = {}
    for m in grid.sent:
        if m.metadata.message_type == "query.answer" and m.metadata.dst_node_id == 101:
            sizes.setdefault(str(m.content["c2c"]["mode"]), []).append(
                len(json.loads(str(m.content["c2c"]["queries"]))))
    assert sizes == {"alone": [2, 2, 1], "c2c": [2, 2, 1], "c2c_zero": [2, 2, 1], "c2c_shuffled": [2, 3]}
    shares = [m for m in grid.sent if m.metadata.message_type == "query.share" and m.metadata.dst_node_id == 103]
    assert len(shares) == 3 + 3 + 2 and all(str(m.content["c2c"]["kind"]) == "kv" for m in shares)


def test_a_missing_control_fuser_fails_only_its_rows(setup):
    phase, grid, devs = setup(controls=True, registered=("zero",))  # no shuffled control trained
    rows = phase.evaluate()
    by = {(r["receiver"], r["mode"]): r for r in rows}
    for receiver in ("tiny-llama", "tiny-qwen2"):
        assert "no shuffled-sharer control fuser installed" in by[(receiver, "c2c_shuffled")]["error"]
        assert all("error" not in by[(receiver, m)] for m in ("alone", "c2c", "c2c_zero"))
        assert "nll_vs_zero" in by[(receiver, "c2c")] and "nll_vs_shuffled" not in by[(receiver, "c2c")]


def _swap_slots(msg, sharer: str, a: str, b: str) -> None:
    """The server's attack: put the fuser of slot ``a`` into slot ``b`` (arrays and meta)."""
    conf = msg.content["c2c"]
    msg.content[fuser_key(sharer, b)] = msg.content[fuser_key(sharer, a)]
    conf[fuser_meta_key(sharer, b)] = conf[fuser_meta_key(sharer, a)]


@pytest.mark.parametrize("real, control", [("none", "zero"), ("zero", "none"), ("none", "shuffled")])
def test_a_fuser_sent_in_another_slot_is_refused_and_nothing_installed(setup, real, control):
    """A server that passes the real fuser off as a control (so the control rows would
    secretly be c2c), or a control as the real fuser, is refused: every check of the card
    still passes (the fuser is genuine), only its sharer_control gives it away."""
    phase, grid, devs = setup(controls=True)
    dev = devs[101]
    msg = next(m for m in fusers_messages(grid) if m.metadata.dst_node_id == 101)
    before = dict(dev.context.state.array_records)
    _swap_slots(msg, "tiny-qwen2", real, control)
    with pytest.raises(FuserVersionError, match=rf"sharer_control='{real}' fuser, sent as "
                                                rf"'{fuser_key('tiny-qwen2', control)}'"):
        handlers.install_fusers(msg, dev.context, dev.client)
    assert dict(dev.context.state.array_records).keys() == before.keys()


@pytest.mark.parametrize("controls", [["zero", "zero"], ["zero", "other"], "zero", ["zero", "shuffled", "zero"]])
def test_a_bad_control_list_is_refused(setup, controls):
    phase, grid, devs = setup(controls=True)
    dev = devs[101]
    msg = next(m for m in fusers_messages(grid) if m.metadata.dst_node_id == 101)
    msg.content["c2c"]["controls.tiny-qwen2"] = controls
    with pytest.raises(FuserVersionError, match="controls.tiny-qwen2 must list distinct controls"):
        handlers.install_fusers(msg, dev.context, dev.client)


def test_a_control_fuser_for_another_adapter_is_refused(setup, tmp_path):
    """As for the real fuser: a control trained for another receiver adapter is refused."""
    phase, grid, devs = setup(controls=True)
    dev = devs[101]
    msg = next(m for m in fusers_messages(grid) if m.metadata.dst_node_id == 101)
    other = Side("tiny-llama", 0, None, 4, 16.0)  # the base model: another adapter hash
    s = side(devs[103])
    version = control_version(phase.service, s, other, "zero")
    state, config, card = phase.service.registry.load_state(
        control_version(phase.service, s, side(dev), "zero"))
    reg = FuserRegistry(tmp_path / "elsewhere")
    fuser = C2CFuser(kv_spec_from_config(dev.client.slot["peft"].config),
                     kv_spec_from_config(devs[103].client.slot["peft"].config), FuserConfig.from_dict(config))
    fuser.load_state_dict(state)
    reg.save(fuser, config, version, FuserCard.for_version(version, train_steps=1))
    state, config, card = reg.load_state(version)
    packed, index = pack_state(state)
    msg.content[fuser_key("tiny-qwen2", "zero")] = ArrayRecord({k: Array(v) for k, v in packed.items()})
    meta = json.loads(str(msg.content["c2c"][fuser_meta_key("tiny-qwen2", "zero")]))
    meta.update(card=card.to_json(), index=index)
    msg.content["c2c"][fuser_meta_key("tiny-qwen2", "zero")] = json.dumps(meta)
    with pytest.raises(FuserVersionError, match="base"):
        handlers.install_fusers(msg, dev.context, dev.client)


def test_an_unknown_mode_is_refused_by_the_receiver(setup):
    phase, grid, devs = setup(controls=False)
    msg = next(m for m in grid.sent if m.metadata.message_type == "query.fusers")
    msg.content["c2c"] = ConfigRecord({"mode": "c2c_everything", "queries": "[]"})
    dev = devs[msg.metadata.dst_node_id]
    with pytest.raises(ValueError, match="unknown C2C mode 'c2c_everything'"):
        handlers.answer(msg, dev.context, dev.client)


def test_compose_time_checks_of_the_control_and_nll_keys():
    assert compose("tiny").c2c.eval.controls is False and compose("default").c2c.eval.gsm8k_n == 0
    check_eval(controls_cfg(True))
    with pytest.raises(ConfigError, match="controls: true needs c2c in c2c.eval.modes"):
        check_eval(compose("tiny", ["c2c.eval.controls=true", "c2c.eval.modes=[alone,t2t]"]))
    with pytest.raises(ConfigError, match=r"lists \['c2c_zero'\]: the controls run with c2c.eval.controls: true"):
        check_eval(compose("tiny", ["c2c.eval.modes=[alone,c2c,c2c_zero]"]))
    with pytest.raises(ConfigError, match="c2c.eval.controls must be true or false"):
        check_eval(compose("tiny", ["c2c.eval.controls=1"]))
    with pytest.raises(ConfigError, match="c2c.eval.gsm8k_n must be an integer >= 0"):
        check_eval(compose("tiny", ["c2c.eval.gsm8k_n=-1"]))
    C2C().check(compose("tiny", ["c2c.eval.controls=true", "c2c.eval.modes=[alone,c2c,c2c_zero,c2c_shuffled]"]))


def test_more_gsm8k_questions_than_the_test_split_holds_is_refused_at_compose():
    """c2c.eval.gsm8k_n above the GSM8K test split (in a local mirror) is one line at compose,
    not a failure after the federation has trained."""
    from tests.conftest import mirror_path

    mirror = mirror_path()
    if mirror is None:
        pytest.skip("no data mirror: set EDGEFUSE_DATA_MIRROR or place ../shared/data")
    check_eval(compose("tiny", [f"data.mirror={mirror}", "c2c.eval.gsm8k_n=1319"]))
    with pytest.raises(ConfigError, match=r"c2c.eval.gsm8k_n=1320 .* 1319 questions"):
        check_eval(compose("tiny", [f"data.mirror={mirror}", "c2c.eval.gsm8k_n=1320"]))
