"""The signed-prekey exchange (edgefuse.c2c.handshake) on its own: both ends agree, and every
value a relay could change (identity, prekey, ephemeral key, session id, names, run id) or
malform is refused with an error that names the peer."""

import pytest

from edgefuse.c2c.handshake import (HANDSHAKE_BYTES, Handshake, PeerPrekey, open_from, seal_for,
                                    sign_prekey)
from edgefuse.transport.crypto import TamperedFrameError, generate_keypair
from edgefuse.transport.identity import (Identity, TrustStore, UntrustedPeerError, fingerprint)

RUN = 42
SID = bytes(range(16))


@pytest.fixture
def ends():
    """Two devices that pin each other, device-0 (sharer) and device-1 (receiver)."""
    a, b = Identity.generate(), Identity.generate()
    trust = TrustStore({"device-0": a.public_bytes(), "device-1": b.public_bytes()})
    prekey = generate_keypair()
    bundle = PeerPrekey("device-1", b.public_bytes(), prekey.public_bytes(),
                        sign_prekey(b, "device-1", prekey.public_bytes(), RUN))
    return a, b, trust, prekey, bundle


def test_both_ends_derive_one_session_and_a_fresh_ephemeral_each_time(ends):
    a, b, trust, prekey, bundle = ends
    tx, hs = seal_for(a, "device-0", trust, bundle, SID, RUN)
    assert hs.nbytes == HANDSHAKE_BYTES == 96 and len(hs.ephemeral) == 32
    rx = open_from(b, "device-1", prekey, trust, "device-0", a.public_bytes(), hs, SID)
    assert [rx.open(tx.seal(m)) for m in (b"kv one", b"kv two")] == [b"kv one", b"kv two"]
    tx2, hs2 = seal_for(a, "device-0", trust, bundle, SID, RUN)
    assert hs2.ephemeral != hs.ephemeral  # a new ephemeral key, so new keys, per exchange
    with pytest.raises(TamperedFrameError):
        open_from(b, "device-1", prekey, trust, "device-0", a.public_bytes(), hs, SID).open(tx2.seal(b"x"))


def test_the_sharer_refuses_a_prekey_of_another_run_or_name_or_an_unpinned_peer(ends):
    a, b, trust, prekey, bundle = ends
    stale = PeerPrekey("device-1", b.public_bytes(), prekey.public_bytes(),
                       sign_prekey(b, "device-1", prekey.public_bytes(), RUN - 1))
    with pytest.raises(UntrustedPeerError, match=f"not signed for run {RUN} by its pinned identity"):
        seal_for(a, "device-0", trust, stale, SID, RUN)
    # device-1's genuine bundle presented as device-0's (a relay re-labelling it)
    relabelled = PeerPrekey("device-0", b.public_bytes(), bundle.prekey, bundle.signature)
    with pytest.raises(UntrustedPeerError, match=f"forwarded identity {fingerprint(b.public_bytes())}, but "
                                                 f"{fingerprint(a.public_bytes())} is pinned"):
        seal_for(a, "device-0", trust, relabelled, SID, RUN)
    with pytest.raises(UntrustedPeerError, match="no key is pinned for 'device-7'"):
        seal_for(a, "device-0", trust, PeerPrekey("device-7", *[getattr(bundle, f) for f in
                                                               ("identity", "prekey", "signature")]), SID, RUN)


@pytest.mark.parametrize("what", ["session_id", "receiver_name", "sharer_name"])
def test_the_receiver_refuses_a_handshake_for_another_session_or_names(what, ends):
    a, b, trust, prekey, bundle = ends
    trust.pin("device-2", a.public_bytes())  # the sharer's key under a second name, too
    _, hs = seal_for(a, "device-0", trust, bundle, SID, RUN)
    kwargs = {"own_name": "device-1", "sharer": "device-0", "session_id": SID}
    kwargs.update({"session_id": {"session_id": bytes(16)}, "receiver_name": {"own_name": "device-2"},
                   "sharer_name": {"sharer": "device-2"}}[what])
    with pytest.raises(UntrustedPeerError, match="is not signed for this exchange by its pinned identity"):
        open_from(b, kwargs["own_name"], prekey, trust, kwargs["sharer"], a.public_bytes(), hs,
                  kwargs["session_id"])


@pytest.mark.parametrize("field,size", [("identity", 31), ("prekey", 33), ("signature", 63)])
def test_malformed_sizes_from_the_relay_are_refused_by_name(field, size, ends):
    a, b, trust, prekey, bundle = ends
    bad = PeerPrekey(**{**bundle.__dict__, field: b"\x01" * size})
    with pytest.raises(UntrustedPeerError, match=f"must be {32 if field != 'signature' else 64} bytes, got {size}"):
        seal_for(a, "device-0", trust, bad, SID, RUN)
    _, hs = seal_for(a, "device-0", trust, bundle, SID, RUN)
    with pytest.raises(UntrustedPeerError, match="ephemeral key forwarded for 'device-0' must be 32 bytes, got 31"):
        open_from(b, "device-1", prekey, trust, "device-0", a.public_bytes(), Handshake(b"\x01" * 31, hs.signature), SID)


def test_a_relay_holding_the_cloud_key_cannot_pose_as_a_peer_called_cloud(ends):
    """The trust store pins the cloud beside the devices, and the operator's server holds the
    cloud's identity key: a relay that names the peer "cloud" and signs its own prekey (or its
    own ephemeral key) with that key must be refused on both sides, not read or forge."""
    a, b, trust, prekey, bundle = ends
    cloud = Identity.generate()
    trust.pin("cloud", cloud.public_bytes())
    relay_prekey = generate_keypair()
    posing = PeerPrekey("cloud", cloud.public_bytes(), relay_prekey.public_bytes(),
                        sign_prekey(cloud, "cloud", relay_prekey.public_bytes(), RUN))
    with pytest.raises(UntrustedPeerError, match="'cloud' does not name a device"):
        seal_for(a, "device-0", trust, posing, SID, RUN)  # the sharer would seal for the relay
    # the receiver side: a payload "from cloud", sealed by the relay under the cloud key
    forged, hs = seal_for(cloud, "cloud", TrustStore({"device-1": b.public_bytes()}), bundle, SID, RUN)
    with pytest.raises(UntrustedPeerError, match="'cloud' does not name a device"):
        open_from(b, "device-1", prekey, trust, "cloud", cloud.public_bytes(), hs, SID)
    for name in ("device-01", "device--1", "device-1x", "Device-1"):
        with pytest.raises(UntrustedPeerError, match="does not name a device"):
            open_from(b, "device-1", prekey, trust, name, a.public_bytes(), hs, SID)
