"""Device side of the privacy phase: run the privacy probe on this client's model.

The probe (:mod:`edgefuse.attacks.probe`) protects canary prompts on the device, builds every
payload type with the real encoders, counts canary hits and runs the inversion attackers. Only
the figures leave the device; the canary prompts and their protected forms do not.

Device floors (:mod:`edgefuse.privacy.floors`): the probe opens no link, so its offline
measurements under every ``privacy.probe.modes`` mode (``none`` included: synthetic canaries
that never leave) run whatever the floor; ``query.privacy`` is checked for ``debug_text``
only. The live canaries go through the cloud link in ``query.decode``
(:func:`edgefuse.app.handlers.decoding.decode`), protected with the same mode as the prompts,
which the floor check of that message has already accepted.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict

from edgefuse.attacks.probe import run_probe


def probe(msg: Message, context: Context, client) -> RecordDict:
    """Run the probe with this client's model (its LoRA loaded) and adapter bytes."""
    cfg = client.cfg
    model, tok = client.slot["peft"], client.slot["tok"]
    arrays, index = client.packed_adapter()
    adapter = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values()) + index.encode()
    res = run_probe(model, tok, cfg.privacy, cfg.data.mirror, cfg.data, int(cfg.seed), adapter=adapter)
    return RecordDict({"privacy": ConfigRecord({
        "rows": json.dumps(res.rows), "layers": json.dumps(res.layers),
        "seconds": json.dumps(res.seconds), "fallbacks": json.dumps(res.rephrase_fallbacks),
        "ner_recall": json.dumps(res.ner_recall), "ner_recall_by_kind": json.dumps(res.ner_recall_by_kind),
        "hits_by_kind": json.dumps(res.hits_by_kind)})})
