"""Which sharer layer each receiver layer fuses from.

A C2C fuser pairs every receiver layer with at most one sharer layer. The two models
usually have different depths, so a strategy decides the pairing:

- ``last_aligned`` (the C2C default): the receiver's last layer reads the sharer's last
  layer, the one before reads the one before, and so on backwards. When the sharer is
  shallower, the receiver's first ``n_receiver - n_sharer`` layers get ``None`` (no fusion);
  when it is deeper, the sharer's first layers are never read.
- ``first_aligned``: layer ``i`` reads layer ``i``; receiver layers past the sharer's depth
  get ``None``.
- ``proportional``: layer ``i`` reads ``round(i * (n_sharer - 1) / (n_receiver - 1))``, so
  both stacks are stretched over each other end to end (every receiver layer is fused;
  several may read the same sharer layer). ``round`` is Python's: halves go to even.
"""

from __future__ import annotations

STRATEGIES = ("last_aligned", "first_aligned", "proportional")


def layer_mapping(n_receiver: int, n_sharer: int, strategy: str = "last_aligned") -> list[int | None]:
    """For each receiver layer, the index of the sharer layer it fuses from, or ``None``.

    Examples:
        >>> layer_mapping(6, 3)
        [None, None, None, 0, 1, 2]
        >>> layer_mapping(3, 6)
        [3, 4, 5]
        >>> layer_mapping(3, 5, "proportional")
        [0, 2, 4]

    Raises:
        ValueError: a layer count below 1, or an unknown strategy (the message lists the
            valid ones).
    """
    if n_receiver < 1 or n_sharer < 1:
        raise ValueError(f"layer counts must be >= 1, got receiver={n_receiver}, sharer={n_sharer}")
    if strategy == "last_aligned":
        offset = n_sharer - n_receiver
        return [i + offset if i + offset >= 0 else None for i in range(n_receiver)]
    if strategy == "first_aligned":
        return [i if i < n_sharer else None for i in range(n_receiver)]
    if strategy == "proportional":
        if n_receiver == 1:
            return [n_sharer - 1]
        # Python's round(): exact halves go to the even neighbour (3 -> 2 layers: [0, 0, 1]).
        return [round(i * (n_sharer - 1) / (n_receiver - 1)) for i in range(n_receiver)]
    raise ValueError(f"unknown layer mapping strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
