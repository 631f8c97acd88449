"""One protection vocabulary (edgefuse.privacy.protect): off | redact | rephrase | both, with
``none`` accepted for ``off`` (the spelling of the privacy probe's results rows)."""

import pytest
from omegaconf import OmegaConf

from edgefuse.privacy import protect


def test_one_vocabulary_with_the_none_alias():
    assert protect.PROTECTIONS == ("off", "redact", "rephrase", "both")
    assert protect.PROTECTION_NAMES == ("off", "redact", "rephrase", "both", "none")
    assert [protect.check_mode(m) for m in protect.PROTECTION_NAMES] == \
        ["off", "redact", "rephrase", "both", "off"]
    with pytest.raises(ValueError, match=r"'Off': use one of off, redact, rephrase, both \(or none\)"):
        protect.check_mode("Off")
    out = protect.protect_batch(["call 555-0100"], "none")
    assert (out[0].text, out[0].mode, out[0].mapping) == ("call 555-0100", "off", {})


def test_none_is_accepted_wherever_a_protection_is_configured():
    cfg = OmegaConf.create({"privacy": {"enabled": True, "protection": "none"}})
    assert protect.client_protection(cfg) == "off"
    assert protect.client_protection(cfg, {"protection": "both"}) == "both"


def test_the_probe_uses_the_core_vocabulary():
    from edgefuse.attacks import probe
    from edgefuse.config import ConfigError, compose

    assert not hasattr(probe, "PROTECTIONS")
    cfg = compose("tiny", "privacy.probe.modes=[none,off,redact]")
    probe.check_config(cfg)  # both spellings of off pass
    bad = compose("tiny", "privacy.probe.modes=[none,encrypt]")
    with pytest.raises(ConfigError, match=r"unknown modes \['encrypt'\]: use off, redact, rephrase, both, none"):
        probe.check_config(bad)
