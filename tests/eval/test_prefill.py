"""edgefuse.eval.queries.prefill keeps the cache only: the same KV as a full forward, with
the output head run on the last position alone."""

import pytest
import torch

from edgefuse.eval.queries import prefill
from edgefuse.models import tiny_model

ARCHS = ["llama", "qwen2", "gemma3_text"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_cache_equals_full_forward_and_head_sees_one_position(arch):
    model, _ = tiny_model(arch, seed=2)
    model.eval()
    ids = [5, 17, 3, 42, 8, 11, 29]
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids]), use_cache=True).cache
    head_inputs = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: head_inputs.append(tuple(args[0].shape)))
    try:
        got = prefill(model, ids)
    finally:
        hook.remove()
    assert head_inputs == [(1, 1, model.config.hidden_size)]  # not (1, 7, hidden)
    assert got.get_seq_length() == len(ids) == len(full.layers[0].keys[0, 0])
    for a, b in zip(got.layers, full.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    with pytest.raises(ValueError, match="empty"):
        prefill(model, [])
