"""Rows shared by the C2C training tests: a training set and a disjoint held-out set."""

import itertools
import random

WORDS = ("quick", "brown", "fox", "lazy", "dog", "model", "devices", "data", "learning")


def rows(n: int, offset: int = 0) -> list[dict]:
    """``n`` Dolly-shaped rows, the ``offset``-th word pair on: "What is the A B?" / "The A B
    is here." -> "The A B." Rows of different offsets use different (A, B) pairs, so a
    training set ``rows(8)`` and a held-out set ``rows(4, 8)`` share no row, only the
    response's shape."""
    pairs = list(itertools.permutations(WORDS, 2))
    random.Random(0).shuffle(pairs)
    pairs = pairs[offset:offset + n]
    assert len(pairs) == n
    return [{"instruction": f"What is the {a} {b}?", "context": f"The {a} {b} is here.",
             "response": f"The {a} {b}."} for a, b in pairs]


TRAIN_ROWS, VAL_ROWS = rows(8), rows(4, 8)
assert not {r["response"] for r in TRAIN_ROWS} & {r["response"] for r in VAL_ROWS}
