"""The public Dolly split, cut once into named, disjoint slices: the server's row budget.

The public split (:func:`edgefuse.data.public_split`: ``data.public_fraction`` of the rows,
held by no client) feeds several consumers. :func:`public_slices` is the only place that
decides which public row goes where. Walking the public split in its order (ascending
dataset row)::

    fuser_train   the first `fuser_train` rows             C2C fuser training (edgefuse.c2c.hub)
    fuser_val     the next `fuser_val` rows                 the fuser cards' validation loss
    eval          of the rows after those, the first        C2C and cloud evaluation
                  `eval_per_category` of every category     (edgefuse.eval.queries.dolly_eval_queries)
    attack_train  the first `attack_train` rows left        the privacy probe's inversion attackers
    draft_corpus  the next `draft_corpus` rows left         token counts of the frequency-pruned
                  (null: every row left)                    draft head (edgefuse.cloud.devices)

The sizes are ``data.public_slices`` (conf/data/dolly.yaml). By default ``fuser_train``
follows ``c2c.train.examples`` and ``attack_train`` follows
``privacy.probe.attack_train_prompts``, so those settings still size the rows they use.

Against the row choices before this module: ``fuser_train``, ``fuser_val`` and the
evaluation rows are the same rows (a phase asking ``k <= eval_per_category`` rows per
category gets exactly the rows it got with ``skip = fuser_train + fuser_val``). The attacker
used to train on the first public rows (the fuser rows) and the draft head counted the
first 2000 public rows (every row, evaluation rows included); both now come from rows no
other slice holds, so their rows differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefuse.data import DATASETS, load_dolly, split_public

SLICES = ("fuser_train", "fuser_val", "eval", "attack_train", "draft_corpus")


@dataclass(frozen=True)
class SliceSizes:
    """The sizes in ``data.public_slices`` (rows; ``draft_corpus=None``: every row left)."""

    fuser_train: int
    fuser_val: int
    eval_per_category: int
    attack_train: int
    draft_corpus: int | None


@dataclass(frozen=True)
class PublicSlices:
    """The slices of one public split; each is an int64 array of dataset row indices in
    ascending order (the public split's order), pairwise disjoint.

    Attributes:
        dataset: the whole loaded dataset (``datasets.Dataset``) the indices point into.
        sizes: the sizes the slices were cut with.
        categories: every category of the dataset, sorted (the ``eval`` slice holds
            ``sizes.eval_per_category`` rows of each).
    """

    dataset: object
    sizes: SliceSizes
    categories: tuple[str, ...]
    fuser_train: np.ndarray
    fuser_val: np.ndarray
    eval: np.ndarray
    attack_train: np.ndarray
    draft_corpus: np.ndarray

    def indices(self, name: str) -> np.ndarray:
        """The dataset row indices of slice ``name`` (one of :data:`SLICES`).

        Raises:
            ValueError: unknown slice name.
        """
        if name not in SLICES:
            raise ValueError(f"unknown public slice {name!r}: use one of {', '.join(SLICES)}")
        return getattr(self, name)

    def rows(self, name: str) -> list[dict]:
        """The rows of slice ``name`` as plain dicts (dataset columns), in slice order."""
        idx = self.indices(name)
        return [dict(r) for r in self.dataset.select(idx.tolist())] if len(idx) else []


def _size(block, key: str, allow_none: bool = False) -> int | None:
    value = block.get(key) if hasattr(block, "get") else None
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"data.public_slices.{key} must be an integer >= 0"
                         f"{' or null' if allow_none else ''}, got {value!r}")
    return int(value)


def slice_sizes(data_cfg) -> SliceSizes:
    """The :class:`SliceSizes` of ``data_cfg.public_slices``.

    Raises:
        ValueError: the block is missing, or a size is not an integer >= 0 (``draft_corpus``
            may be null).
    """
    block = data_cfg.get("public_slices")
    if block is None:
        raise ValueError("data.public_slices is missing: it sizes the public split's slices "
                         "(fuser_train, fuser_val, eval_per_category, attack_train, draft_corpus)")
    return SliceSizes(fuser_train=_size(block, "fuser_train"), fuser_val=_size(block, "fuser_val"),
                      eval_per_category=_size(block, "eval_per_category"),
                      attack_train=_size(block, "attack_train"),
                      draft_corpus=_size(block, "draft_corpus", allow_none=True))


def _norm(text: str) -> str:
    return " ".join(str(text).split())


def public_slices(data_cfg, seed: int) -> PublicSlices:
    """Cut the public split of ``(data_cfg, seed)`` into the slices of the module docstring.

    Deterministic: the public split is a seeded permutation (:func:`edgefuse.data.split_public`)
    and every slice is a prefix or a per-category prefix of what is left of it. Disjoint by
    row and by instruction text: Dolly repeats some instructions, so a row whose instruction
    (whitespace-normalized) is already in an earlier slice is skipped by the later ones.

    Returns:
        The :class:`PublicSlices`; ``eval`` holds ``eval_per_category`` rows of every
        category, the others exactly their size (``draft_corpus=None``: what is left, maybe
        nothing).

    Raises:
        ValueError: a bad ``data.public_slices`` (see :func:`slice_sizes`); the public split
            holds fewer rows than the slices ask for (the message names every size, the
            total, and the public split's size); a category has fewer than
            ``eval_per_category`` rows left after the fuser rows.
        FileNotFoundError, RuntimeError: see :func:`edgefuse.data.load_dolly`.
    """
    sizes = slice_sizes(data_cfg)
    ds = load_dolly(data_cfg)
    public, _ = split_public(len(ds), float(data_cfg["public_fraction"]), seed)
    labels = np.asarray(ds[DATASETS[data_cfg["name"]][1]][:])  # [:]: a list, not row by row
    categories = tuple(sorted(set(labels.tolist())))
    n_eval = sizes.eval_per_category * len(categories)
    need = (sizes.fuser_train + sizes.fuser_val + n_eval + sizes.attack_train
            + (sizes.draft_corpus or 0))

    def budget_error(short: str) -> ValueError:
        return ValueError(
            f"the public split has {len(public)} rows (data.public_fraction="
            f"{data_cfg['public_fraction']} of {len(ds)}), data.public_slices asks for {need}: "
            f"fuser_train {sizes.fuser_train} + fuser_val {sizes.fuser_val} + eval "
            f"{sizes.eval_per_category} x {len(categories)} categories + attack_train "
            f"{sizes.attack_train} + draft_corpus {sizes.draft_corpus or 0}{short}; lower these "
            f"sizes or raise data.public_fraction")

    if need > len(public):
        raise budget_error("")
    text_of = dict(zip(public.tolist(), map(_norm, ds.select(public.tolist())["instruction"][:])))
    taken: set[str] = set()
    left = public

    def fresh() -> np.ndarray:  # what is left, without instructions an earlier slice holds
        return left[np.fromiter((text_of[i] not in taken for i in left.tolist()), bool, len(left))]

    def take(name: str, n: int | None) -> np.ndarray:
        nonlocal left
        left = fresh()
        out = left if n is None else left[:n]
        if n is not None and len(out) < n:
            raise budget_error(f" (only {len(out)} distinct rows left for {name})")
        left = left[len(out):]
        taken.update(text_of[i] for i in out.tolist())
        return out

    fuser_train = take("fuser_train", sizes.fuser_train)
    fuser_val = take("fuser_val", sizes.fuser_val)
    left = fresh()
    left_labels = labels[left]
    picks = []
    for cat in categories:
        pos = np.flatnonzero(left_labels == cat)[:sizes.eval_per_category]
        if len(pos) < sizes.eval_per_category:
            raise ValueError(f"category {cat!r} has {len(pos)} public rows left after the "
                             f"{len(fuser_train) + len(fuser_val)} fuser rows, "
                             f"data.public_slices.eval_per_category asks for "
                             f"{sizes.eval_per_category}: lower it or raise data.public_fraction")
        picks.append(pos)
    eval_pos = np.sort(np.concatenate(picks)) if picks else np.zeros(0, dtype=np.int64)
    eval_rows = left[eval_pos]
    taken.update(text_of[i] for i in eval_rows.tolist())
    left = np.delete(left, eval_pos)
    attack = take("attack_train", sizes.attack_train)
    draft = take("draft_corpus", sizes.draft_corpus)
    as_rows = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return PublicSlices(dataset=ds, sizes=sizes, categories=categories,
                        fuser_train=as_rows(fuser_train), fuser_val=as_rows(fuser_val),
                        eval=as_rows(eval_rows), attack_train=as_rows(attack),
                        draft_corpus=as_rows(draft))


__all__ = ["SLICES", "SliceSizes", "PublicSlices", "slice_sizes", "public_slices"]
