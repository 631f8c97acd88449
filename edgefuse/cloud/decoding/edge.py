"""The device's language model with a rollback-able KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from edgefuse.cloud.decoding.batcher import DraftBatcher
from edgefuse.kvcache import cache_from_layers


def crop(cache: DynamicCache, n: int) -> None:
    """Keep the first ``n`` positions of ``cache`` (transformers 5 ``crop`` takes a negative
    count of positions to drop)."""
    drop = cache.get_seq_length() - n
    if drop > 0:
        cache.crop(-drop)


class EdgeLM:
    """The device's language model with a rollback-able KV cache.

    ``tokens`` are the committed (+ drafted) ids; the cache holds all of them but possibly
    the last few, which :meth:`hidden` feeds. The edge's own tokens (``edge`` and fusion
    modes, the fallback) always come from the full head (:meth:`logits`). ``head``: the
    pruned draft head (:class:`edgefuse.cloud.decoding.drafters.DraftHead`) a
    :class:`~edgefuse.cloud.decoding.decoder.Decoder` given no drafter drafts with (None: the
    full head). ``batcher``: a :class:`DraftBatcher` shared by simulated devices that share
    this model."""

    def __init__(self, model, tok, head=None, batcher: DraftBatcher | None = None):
        self.model = model.eval()
        self.head = head
        self.batcher = batcher
        self.cache = DynamicCache()
        self._init_tokens(tok, int(model.config.vocab_size))

    def _init_tokens(self, tok, vocab_size: int) -> None:
        self.tok = tok
        self.vocab_size = vocab_size
        self.tokens: list[int] = []
        eos = tok.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        for extra in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>"):
            i = tok.convert_tokens_to_ids(extra) if extra in tok.get_vocab() else None
            if i is not None:
                self.eos_ids.add(int(i))

    def start(self, prompt: list[int]) -> None:
        """Prefill ``prompt`` (all ids but the last go into the cache)."""
        self.tokens = list(prompt)
        self.cache = DynamicCache()
        self.hidden()

    def push(self, token: int) -> None:
        self.tokens.append(int(token))

    def rollback(self, n: int) -> None:
        """Keep the first ``n`` tokens; the cache is cropped to match."""
        self.tokens = self.tokens[:n]
        crop(self.cache, n)

    def sync(self, tokens: Sequence[int]) -> None:
        """Make ``tokens`` the sequence, keeping the cache of the prefix it shares with the
        current one (the rest is fed lazily by the next :meth:`hidden`)."""
        n = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            n += 1
        self.rollback(n)
        self.tokens.extend(int(t) for t in tokens[n:])

    @torch.no_grad()
    def hidden(self) -> torch.Tensor:
        """Feed the uncached tokens (at least the last one); the final-normed hidden state of
        the last position, ``[H]``."""
        past = self.cache.get_seq_length()
        if past >= len(self.tokens):
            past = len(self.tokens) - 1
            crop(self.cache, past)
        if self.batcher is not None:
            layers = [(la.keys, la.values) for la in self.cache.layers] if past else None
            hidden, kv = self.batcher.run(layers, past, self.tokens[past:])
            self.cache = cache_from_layers(kv)
            return hidden[-1]
        dev = self.model.device
        ids = torch.tensor([self.tokens[past:]], device=dev)
        pos = torch.arange(past, len(self.tokens), device=dev).unsqueeze(0)
        out = self.model.get_decoder()(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.last_hidden_state[0, -1]

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        """Full-vocabulary next-token logits ``float32[V]`` on the CPU (soft-capped as the
        model does, e.g. Gemma)."""
        out = self.model.get_output_embeddings()(self.hidden()).float().cpu()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(out / cap) * cap if cap else out


class OnnxEdgeLM(EdgeLM):
    """:class:`EdgeLM` on ONNX Runtime (the ``edge`` device profile, :mod:`edgefuse.runtime`):
    the same tokens, rollback and logits, over an :class:`~edgefuse.runtime.OnnxDecoder` whose
    KV cache (numpy arrays ``[1, kv_heads, P, head_size]`` per layer) this object holds.
    Devices may share one decoder; each holds its own cache.

    The export returns logits only, so there is no :meth:`hidden` (a pruned draft head has
    nothing to score: the ``edge`` profile drafts with the full head, already int8 in the
    graph)."""

    def __init__(self, decoder, tok):
        self.decoder = decoder
        self.head = None
        self.batcher = None
        self.past = decoder.empty()
        self._init_tokens(tok, decoder.vocab_size)

    def start(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.past = self.decoder.empty()
        self._feed()

    def rollback(self, n: int) -> None:
        self.tokens = self.tokens[:n]
        if self.decoder.length(self.past) > n:
            self.past = self.decoder.crop(self.past, n)

    def hidden(self) -> torch.Tensor:
        raise NotImplementedError("the ONNX edge runtime exports logits, not hidden states")

    def _feed(self):
        """Feed the uncached tokens (at least the last one); their logits ``[S, V]``."""
        past = self.decoder.length(self.past)
        if past >= len(self.tokens):
            past = len(self.tokens) - 1
            self.past = self.decoder.crop(self.past, past)
        logits, self.past = self.decoder.forward(self.tokens[past:], self.past)
        return logits

    def logits(self) -> torch.Tensor:
        """Full-vocabulary next-token logits ``float32[V]``."""
        return torch.from_numpy(self._feed()[-1])
