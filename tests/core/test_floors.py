"""Device privacy floors (edgefuse.privacy.floors) without Flower: the protection order (all
16 pairs, written out by hand), loading floors.yaml and node_config keys, malformed files
refused with the file and key named, and :func:`check`: a server config that loosens a
field is refused naming the field, the key, the server's value, the floor and its source;
a tighter one passes."""

import pytest

from edgefuse.config import client_entry, compose
from edgefuse.privacy.redact import DEFAULT_ENTITIES
from edgefuse.privacy.floors import (DEFAULT, FIELDS, FloorError, FloorViolation, PrivacyFloor, check,
                                     load, protection_at_least, violations)

# (server's mode, floor) -> accepted, by hand: off < redact < both, off < rephrase < both
ORDER = {
    ("off", "off"): True, ("redact", "off"): True, ("rephrase", "off"): True, ("both", "off"): True,
    ("off", "redact"): False, ("redact", "redact"): True, ("rephrase", "redact"): False,
    ("both", "redact"): True,
    ("off", "rephrase"): False, ("redact", "rephrase"): False, ("rephrase", "rephrase"): True,
    ("both", "rephrase"): True,
    ("off", "both"): False, ("redact", "both"): False, ("rephrase", "both"): False,
    ("both", "both"): True,
}


def test_protection_order_all_16_pairs():
    assert len(ORDER) == 16
    for (mode, floor), ok in ORDER.items():
        assert protection_at_least(mode, floor) is ok, (mode, floor)
    with pytest.raises(ValueError):
        protection_at_least("bogus", "off")


def _cfg(*over):
    cfg = compose("tiny", list(over))
    return cfg, client_entry(cfg, 0)


def test_default_floor_and_the_default_configs_pass(tmp_path):
    floor = load(tmp_path / "floors.yaml")  # no file
    assert floor == DEFAULT
    assert (floor.protection, floor.debug_text, floor.flag_cache, floor.l_cache, floor.cloud,
            floor.c2c_share) == ("redact", False, True, None, True, True)
    # the redaction floor is what the shipped privacy config does
    shipped = compose("default").privacy.redact
    assert floor.redact_entities == tuple(shipped.entities) == DEFAULT_ENTITIES
    assert (floor.redact_max_threshold, floor.redact_known_identities) == \
        (shipped.score_threshold, shipped.known_identities) == (0.4, True)
    assert floor.source("protection") == f"default (no {tmp_path / 'floors.yaml'})"
    # the main job's default experiment and the tests' tiny experiment (protection both)
    for exp in ("default", "tiny"):
        cfg = compose(exp)
        for pid in range(len(cfg.federation.clients)):
            check(cfg, client_entry(cfg, pid), floor, requests=("cloud", "c2c_share"))
    # a device that never configured anything refuses plain text toward the cloud
    cfg, entry = _cfg("privacy=disabled")
    with pytest.raises(FloorViolation, match="protection: the server's privacy.enabled=false"):
        check(cfg, entry, floor)


@pytest.mark.parametrize("over,floor_yaml,needle", [
    (["privacy.protection=off"], "protection: redact",
     "protection: the server's privacy.protection='off' is looser than this device's floor protection='redact'"),
    (["privacy.protection=rephrase"], "protection: redact",
     "privacy.protection='rephrase' is looser than this device's floor protection='redact'"),
    (["privacy.protection=redact"], "protection: both",
     "privacy.protection='redact' is looser than this device's floor protection='both'"),
    (["+federation.clients.0.protection=off"], "protection: rephrase",
     "federation.clients.0.protection='off' is looser"),
    (["privacy.debug_text=true"], "debug_text: false",
     "debug_text: the server's privacy.debug_text=true is looser than this device's floor debug_text=false"),
    (["privacy.cloud_auth.flag_cache=true"], "cloud_cache: {flag_cache: false}",
     "cloud_cache: the server's privacy.cloud_auth.flag_cache=true is looser than this device's floor "
     "flag_cache=false"),
    (["privacy.cloud_auth.l_cache=65"], "cloud_cache: {l_cache: 64}",
     "cloud_cache: the server's privacy.cloud_auth.l_cache=65 is looser than this device's floor l_cache=64"),
    ([], "cloud_cache: {l_cache: 64}",  # null = unlimited, above any window
     "privacy.cloud_auth.l_cache=null is looser than this device's floor l_cache=64"),
    ([], "cloud: false", "cloud: the server's cloud.enabled=true is looser than this device's floor cloud=false"),
    ([], "c2c_share: false",
     "c2c_share: the server's c2c.enabled=true is looser than this device's floor c2c_share=false"),
    # redaction switched off while the mode still says redact
    (["privacy.redact.entities=[PERSON]"], "redact: {entities: [PERSON, EMAIL_ADDRESS, PHONE_NUMBER]}",
     "protection: the server's privacy.redact.entities leaves out EMAIL_ADDRESS, PHONE_NUMBER, which this "
     "device's floor redact.entities requires"),
    (["privacy.redact.score_threshold=0.99"], "redact: {score_threshold: 0.5}",
     "protection: the server's privacy.redact.score_threshold=0.99 is looser than this device's floor "
     "redact.score_threshold=0.5"),
    (["privacy.redact.known_identities=false"], "protection: both\nredact: {known_identities: true}",
     "protection: the server's privacy.redact.known_identities=false is looser than this device's floor "
     "redact.known_identities=true"),
])
def test_a_looser_config_is_refused_naming_field_key_values_and_file(tmp_path, over, floor_yaml, needle):
    path = tmp_path / "floors.yaml"
    path.write_text(floor_yaml + "\n")
    cfg, entry = _cfg(*over)
    with pytest.raises(FloorViolation) as err:
        check(cfg, entry, load(path), entry_key="federation.clients.0")
    assert needle in str(err.value)
    assert f"(from {path})" in str(err.value)
    assert len(violations(cfg, entry, load(path))) == 1  # only the loosened field


@pytest.mark.parametrize("over,floor_yaml", [
    (["privacy.protection=both"], "protection: redact"),          # tighter protection
    (["privacy.protection=both"], "protection: rephrase"),
    (["privacy.protection=redact"], "protection: redact"),        # equal
    (["+federation.clients.0.protection=both", "privacy.protection=off"], "protection: both"),
    (["privacy.cloud_auth.flag_cache=false"], "cloud_cache: {flag_cache: false}"),
    (["privacy.cloud_auth.l_cache=32"], "cloud_cache: {l_cache: 64}"),
    (["privacy.cloud_auth.l_cache=64"], "cloud_cache: {l_cache: 64}"),
    (["cloud=disabled"], "cloud: false"),
    (["c2c=disabled"], "c2c_share: false"),
    (["privacy.debug_text=false"], "debug_text: true"),           # the floor allows, the server does not
    (["privacy=disabled"], "protection: off"),                      # an explicit opt-out on the device
    (["privacy.redact.entities=[PERSON,URL]"], "redact: {entities: [PERSON]}"),  # more than required
    (["privacy.redact.entities=null"], "redact: {entities: [PERSON]}"),  # null = the shipped list
    (["privacy.redact.score_threshold=0.2"], "protection: redact"),
    (["privacy.redact.known_identities=false"], "redact: {known_identities: false}"),
    # redaction settings do not matter when the floor asks for none
    (["privacy.protection=rephrase", "privacy.redact.entities=[URL]"], "protection: rephrase"),
    (["privacy.protection=both", "privacy.redact.known_identities=false"], "protection: off"),
])
def test_a_tighter_or_equal_config_passes(tmp_path, over, floor_yaml):
    path = tmp_path / "floors.yaml"
    path.write_text(floor_yaml + "\n")
    cfg, entry = _cfg(*over)
    check(cfg, entry, load(path))
    assert violations(cfg, entry, load(path)) == []


def test_a_message_that_uses_the_cloud_or_a_peer_is_refused_whatever_the_config_says(tmp_path):
    """A server that switches cloud.enabled / c2c.enabled off in the config but still sends the
    request is refused: the message itself is the request."""
    cfg, entry = _cfg("cloud=disabled", "c2c=disabled")
    floor = PrivacyFloor(cloud=False, c2c_share=False)
    check(cfg, entry, floor)  # the config alone asks for neither
    with pytest.raises(FloorViolation, match="cloud: the server's message contacts the cloud"):
        check(cfg, entry, floor, ("cloud",), requests=("cloud",))
    with pytest.raises(FloorViolation, match="c2c_share: the server's message shares with a peer"):
        check(cfg, entry, floor, ("c2c_share",), requests=("c2c_share",))
    # fields not checked for a message are not refused
    check(*_cfg("privacy=disabled"), DEFAULT, fields=("debug_text",))
    with pytest.raises(ValueError, match="unknown floor fields"):
        check(cfg, entry, floor, ("nope",))


def test_malformed_server_values_are_refused(tmp_path):
    cfg, entry = _cfg()
    cfg.privacy.cloud_auth.flag_cache = "yes"
    cfg.privacy.cloud_auth.l_cache = -3
    found = violations(cfg, entry, DEFAULT)
    assert found == ["cloud_cache: the server's privacy.cloud_auth.flag_cache='yes' is not a bool",
                     "cloud_cache: the server's privacy.cloud_auth.l_cache=-3 is not null or an integer >= 0"]
    cfg, entry = _cfg()
    cfg.privacy.protection = "sometimes"
    with pytest.raises(FloorViolation, match="protection: the server's privacy.protection='sometimes' is not one "
                                             "of off, redact, rephrase, both"):
        check(cfg, entry, DEFAULT)
    cfg, entry = _cfg()
    cfg.privacy.debug_text = "x" * 1_000_000  # a huge value is quoted short
    (line,) = violations(cfg, entry, DEFAULT)
    assert line.startswith("debug_text: the server's privacy.debug_text='xxx") and len(line) < 300


def test_file_then_node_config_keys(tmp_path):
    path = tmp_path / "floors.yaml"
    path.write_text("protection: both\ndebug_text: true\ncloud: false\n"
                    "cloud_cache:\n  flag_cache: false\n  l_cache: 128\nc2c_share: false\n")
    floor = load(path)
    assert floor.to_dict() == {"protection": "both", "debug_text": True, "cloud": False,
                               "cloud_cache": {"flag_cache": False, "l_cache": 128}, "c2c_share": False,
                               "redact": {"entities": list(DEFAULT_ENTITIES), "score_threshold": 0.4,
                                          "known_identities": True}}
    assert {floor.source(a) for a in ("protection", "debug_text", "l_cache", "c2c_share")} == {str(path)}
    # node_config keys override the field they name, and say so
    over = load(path, {"floor-protection": "redact", "floor-l-cache": "none", "floor-cloud": True,
                       "floor-debug-text": "false", "partition-id": 0})
    assert (over.protection, over.l_cache, over.cloud, over.debug_text, over.c2c_share) == \
        ("redact", None, True, False, False)
    assert over.source("protection") == "node_config floor-protection"
    assert over.source("c2c_share") == str(path)
    keyed = load(None, {"floor-redact-entities": "PERSON, EMAIL_ADDRESS", "floor-redact-threshold": "0.3",
                        "floor-known-identities": False})
    assert (keyed.redact_entities, keyed.redact_max_threshold, keyed.redact_known_identities) == \
        (("PERSON", "EMAIL_ADDRESS"), 0.3, False)
    # unquoted YAML `off` is false: read as protection off
    path.write_text("protection: off\n")
    assert load(path).protection == "off"
    path.write_text("")  # an empty file is the defaults
    assert load(path).to_dict() == DEFAULT.to_dict()


@pytest.mark.parametrize("text,needle", [
    ("protection: [redact\n", "not valid YAML"),
    ("- redact\n", "expected a mapping of floor keys, got list"),
    ("protection: maximal\n", "protection: expected one of off, redact, rephrase, both, got 'maximal'"),
    ("protections: redact\n",
     "unknown keys 'protections'; known: c2c_share, cloud, cloud_cache, debug_text, protection, redact"),
    ("debug_text: yes please\n", "debug_text: expected true or false, got 'yes please'"),
    ("cloud: 1\n", "cloud: expected true or false, got 1"),
    ("cloud_cache: 64\n", "cloud_cache: expected a mapping"),
    ("cloud_cache: {l_cache: -1}\n", "cloud_cache.l_cache: expected null or an integer"),
    ("cloud_cache: {l_cache: true}\n", "cloud_cache.l_cache: expected null or an integer"),
    ("cloud_cache: {keep: all}\n", "cloud_cache: unknown keys 'keep'; known: flag_cache, l_cache"),
    ("redact: {entities: [person]}\n", "redact.entities: expected a list of entity type names"),
    ("redact: {entities: PERSON}\n", "redact.entities: expected a list of entity type names"),
    ("redact: {score_threshold: 2}\n", "redact.score_threshold: expected a number in [0, 1], got 2"),
    ("redact: {spacy_model: big}\n", "redact: unknown keys 'spacy_model'"),
])
def test_a_malformed_floor_file_is_a_clear_error(tmp_path, text, needle):
    path = tmp_path / "floors.yaml"
    path.write_text(text)
    with pytest.raises(FloorError) as err:
        load(path)
    assert str(err.value).startswith(str(path)) and needle in str(err.value)


def test_a_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    """Billion laughs: nine levels of aliases, each nine times the one below (9**9 leaves if
    expanded), as the value of a known key. The error quotes a bounded repr."""
    import time

    levels = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = tmp_path / "floors.yaml"
    path.write_text("protection: [" + ", ".join(levels) + "]\n")
    t0 = time.perf_counter()
    with pytest.raises(FloorError) as err:
        load(path)
    assert time.perf_counter() - t0 < 5 and len(str(err.value)) < 300
    assert f"{path}: protection: expected one of off, redact, rephrase, both, got [['x', 'x', 'x', 'x', ...], " \
        in str(err.value)


def test_floor_file_limits_and_bad_node_keys(tmp_path):
    big = tmp_path / "floors.yaml"
    big.write_text("# " + "x" * (64 * 1024) + "\n")
    with pytest.raises(FloorError, match="more than the 65536 bytes a floor file may hold"):
        load(big)
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(FloorError, match="not a regular file"):
        load(tmp_path / "dir.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"protection: \xff\xfe\n")
    with pytest.raises(FloorError, match="not valid YAML"):
        load(tmp_path / "bin.yaml")
    with pytest.raises(FloorError, match="node_config floor-protection: expected one of"):
        load(None, {"floor-protection": "none-at-all"})
    with pytest.raises(FloorError, match="node_config floor-l-cache: expected null or an integer"):
        load(None, {"floor-l-cache": "lots"})
    assert FIELDS == ("protection", "debug_text", "cloud_cache", "cloud", "c2c_share")


def test_a_nan_threshold_from_a_server_that_skips_compose_is_refused(tmp_path):
    """Compose refuses NaN, but a hostile server sends whatever JSON it likes: NaN compares
    false both ways, so the floor's check must not read "not above the floor" as "within it"."""
    path = tmp_path / "floors.yaml"
    path.write_text("redact: {score_threshold: 0.5}\n")
    cfg, entry = _cfg()
    cfg.privacy.redact.score_threshold = float("nan")
    with pytest.raises(FloorViolation, match="score_threshold=nan is looser than this device's floor"):
        check(cfg, entry, load(path), entry_key="federation.clients.0")
