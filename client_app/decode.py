"""Device side of cloud collaboration: decode the server's prompts through the cloud service.

The device opens its own encrypted link(s) to the service named in the message
(:mod:`cloud.link`); its model keeps the LoRA adapter the message carried, which never
leaves the device. ``cloud.devices`` sessions run at once, sharing this model's weights.
"""

from __future__ import annotations

import json

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from cloud.decode import decode_config
from cloud.evaluate import pruned_head, run_devices
from cloud.target import tokenizer_fingerprint
from edgefuse.transport.wan import WanProfile
from fusers.queries import Query


def decode(msg: Message, context: Context, client) -> RecordDict:
    """Run every ``cloud.modes`` mode on the message's queries; reply with the records."""
    cfg = client.cfg
    c = cfg.cloud
    conf = msg.content["cloud"]
    queries = [Query.from_dict(q) for q in json.loads(str(conf["queries"]))]
    model, tok = client.slot["peft"], client.slot["tok"]
    threads = torch.get_num_threads()
    torch.set_num_threads(int(c.threads))
    try:
        records, wall = run_devices(
            model, tok, queries, list(c.modes), decode_config(c), str(conf["host"]), int(conf["port"]),
            WanProfile.from_name(str(c.wan)), int(c.devices), tokenizer_fingerprint(tok),
            max_prompt_tokens=int(c.eval.max_prompt_tokens), head=pruned_head(model, tok, cfg.data, int(cfg.seed),
                                                      int(c.decode.draft_head), cfg.paths.cache_dir))
    finally:
        torch.set_num_threads(threads)
    return RecordDict({"decoding": ConfigRecord({"records": json.dumps([r.to_dict() for r in records]),
                                                 "wall": json.dumps(wall)})})
