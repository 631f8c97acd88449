"""What one generation reports: the tokens and the figures of its cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class DecodeResult:
    """One generation. Times in seconds, bytes as counted on the socket (length prefixes and
    AES-GCM framing included, handshake excluded), tokens = generated tokens. ``drafter``:
    the name of the drafter that proposed the drafts (``spec_sync`` / ``spec_async``; None
    for the modes that draft nothing); ``split``: the split of ``split`` / ``split_spec``
    (e.g. ``k2 m2 int8``, ``+ head 768 english``), None otherwise; ``tokenizer``: which
    tokenizer path the generation took (``own``: the device's ids end to end; ``same``: the
    cloud's ids, which are the device's; ``cross``: the cloud's ids of another tokenizer,
    re-aligned on bytes, :mod:`edgefuse.cloud.crossvocab`) and so whose ids ``tokens`` are
    (the device's for ``own`` and ``same``, the cloud's for ``cross``)."""
    mode: str
    tokens: list[int]
    text: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    prefill_bytes_up: int = 0
    prefill_bytes_down: int = 0
    drafted: int = 0
    accepted: int = 0
    blocks: int = 0
    deadline_misses: int = 0
    edge_weight_mean: float | None = None
    fallback: str | None = None
    drafter: str | None = None
    split: str | None = None
    tokenizer: str = "own"

    @property
    def n(self) -> int:
        return max(len(self.tokens), 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.n

    @property
    def round_trips_per_token(self) -> float:
        return self.round_trips / self.n

    @property
    def bytes_up_per_token(self) -> float:
        return self.bytes_up / self.n

    @property
    def bytes_down_per_token(self) -> float:
        return self.bytes_down / self.n

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeResult":
        """A result back from :meth:`summary` plus ``tokens`` (a decoding record): the fields
        it names; derived figures are recomputed, unknown keys ignored, a field it lacks
        takes its default."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: (list(v) if k == "tokens" else v) for k, v in d.items() if k in names})

    def summary(self) -> dict:
        """A JSON-ready dict of the counters and the per-token figures."""
        out = {k: v for k, v in asdict(self).items() if k != "tokens"}
        out.update(new_tokens=len(self.tokens), tokens_per_s=self.tokens_per_s,
                   ms_per_token=self.ms_per_token, round_trips_per_token=self.round_trips_per_token,
                   bytes_up_per_token=self.bytes_up_per_token,
                   bytes_down_per_token=self.bytes_down_per_token,
                   acceptance_rate=self.acceptance_rate)
        return out
