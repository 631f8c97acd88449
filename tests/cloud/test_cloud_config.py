"""The ``cloud`` config section's compose-time check (:func:`edgefuse.cloud.decoding.check_config`):
each unusable value is refused with a message that names its key; the tiny and default
experiments pass."""

from __future__ import annotations

import pytest

from edgefuse.cloud.decoding import check_config
from edgefuse.config import ConfigError, compose


def refused(overrides: list[str]) -> str:
    """The message of the ConfigError ``check_config`` raises for the tiny experiment with
    ``overrides`` (fails the test if none is raised)."""
    cfg = compose("tiny", overrides)
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    return str(e.value)


@pytest.mark.parametrize("experiment", ["tiny", "default"])
def test_the_shipped_experiments_pass(experiment):
    check_config(compose(experiment))


def test_device_model_must_be_a_federation_client():
    msg = refused(["cloud.device_model=qwen2.5-coder-0.5b"])  # tiny runs tiny-* clients only
    assert msg == ("cloud.device_model 'qwen2.5-coder-0.5b' is not a federation client's model "
                   "(tiny-llama, tiny-qwen2, tiny-gemma3) nor all")
    check_config(compose("tiny", ["cloud.device_model=tiny-llama"]))  # another client's model is fine
    check_config(compose("tiny", ["cloud.device_model=all"]))  # every client's model: the default


@pytest.mark.parametrize("modes, named", [("[edge,telepathy,spec_sync]", "['telepathy']"), ("[]", "[]")])
def test_unknown_or_no_modes_are_refused(modes, named):
    msg = refused([f"cloud.modes={modes}"])
    assert msg.startswith(f"cloud.modes has unknown modes {named}: use edge, cloud, spec_sync, spec_async")


@pytest.mark.parametrize("weight", ["1.5", "-0.1"])
def test_fusion_weight_out_of_range_is_refused(weight):
    assert refused([f"cloud.decode.fusion_weight={weight}"]) == \
        f"cloud.decode.fusion_weight must be in [0, 1], got {weight}"
    check_config(compose("tiny", ["cloud.decode.fusion_weight=1.0"]))  # the bounds themselves are fine
    check_config(compose("tiny", ["cloud.decode.fusion_weight=0.0"]))


def test_more_devices_than_sessions_is_refused():
    msg = refused(["cloud.devices=5", "cloud.service.max_sessions=4"])
    assert msg.startswith("cloud.devices (5) must be <= cloud.service.max_sessions (4)")
    check_config(compose("tiny", ["cloud.devices=4", "cloud.service.max_sessions=4"]))


def test_more_unauthenticated_slots_than_connections_are_refused_at_compose():
    assert refused(["cloud.service.max_handshakes=200", "cloud.service.max_connections=128"]).startswith(
        "cloud.service.max_handshakes (200) must be <= cloud.service.max_connections (128)")
    assert "max_handshakes" in refused(["cloud.service.max_handshakes=0"])
    check_config(compose("tiny", ["cloud.service.max_handshakes=128", "cloud.service.max_connections=128"]))


def test_drafts_longer_than_the_service_accepts_are_refused():
    msg = refused(["cloud.decode.gamma_max=32", "cloud.service.max_draft=16"])
    assert msg.startswith("cloud.decode.gamma_max / gamma (32) must be <= cloud.service.max_draft (16)")
    assert refused(["cloud.decode.gamma=20", "cloud.service.max_draft=16"]).startswith(
        "cloud.decode.gamma_max / gamma (20)")
    check_config(compose("tiny", ["cloud.decode.gamma_max=16", "cloud.service.max_draft=16"]))


@pytest.mark.parametrize("override, message", [
    ("cloud.service.max_sessions=0", "cloud.service.max_sessions must be an integer >= 1, got 0"),
    ("cloud.devices=0", "cloud.devices must be an integer >= 1, got 0"),
    ("cloud.service.max_wait_ms=-1", "cloud.service.max_wait_ms must be >= 0, got -1"),
    ("cloud.decode.confidence=vibes", "cloud.decode.confidence must be one of entropy, margin, got 'vibes'"),
    ("cloud.wan=wan9000", "cloud.wan: "),
    ("cloud.decode.temperature=-1", "cloud.decode.temperature must be >= 0, got -1"),
])
def test_other_bad_values_name_their_key(override, message):
    assert refused([override]).startswith(message)


def test_a_disabled_cloud_section_is_not_checked():
    check_config(compose("tiny", ["cloud.enabled=false", "cloud.modes=[telepathy]"]))
