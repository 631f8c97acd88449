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

Fuser training data and held-out rows (which is which)::

    training (fuser_training_rows, c2c.train.data)      held out (heldout_rows)
    dolly_public  fuser_train, then the spare rows      dolly_eval  the eval slice
                  (after attack_train; draft_corpus
                  counts tokens of them too)
    gsm8k_train   GSM8K train, minus any question       gsm8k_test  GSM8K test, in load_gsm8k's
                  equal to a test question                          draw for the seed

``fuser_val`` (the fuser cards) and ``attack_train`` (the privacy probe) are in neither. A
training source never holds a held-out row or instruction: Dolly by the slices above (the
instructions are deduplicated across them), GSM8K by its train / test split (and the
filter). ``n`` of ``dolly_public`` up to ``fuser_train`` is a prefix of that slice, so the
evaluation rows never move with the training budget; above it, the spare rows follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefuse.config import ConfigError
from edgefuse.data import DATASETS, load_dolly, load_gsm8k_split, mirror_dir, split_public

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
        spare: every row left after ``attack_train`` whose instruction no earlier slice
            holds (``draft_corpus`` is its prefix); not one of :data:`SLICES`: the
            ``dolly_public`` training source (:func:`fuser_training_rows`) goes on into it.
    """

    dataset: object
    sizes: SliceSizes
    categories: tuple[str, ...]
    fuser_train: np.ndarray
    fuser_val: np.ndarray
    eval: np.ndarray
    attack_train: np.ndarray
    draft_corpus: np.ndarray
    spare: np.ndarray

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
    spare = fresh()
    draft = take("draft_corpus", sizes.draft_corpus)
    as_rows = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return PublicSlices(dataset=ds, sizes=sizes, categories=categories,
                        fuser_train=as_rows(fuser_train), fuser_val=as_rows(fuser_val),
                        eval=as_rows(eval_rows), attack_train=as_rows(attack),
                        draft_corpus=as_rows(draft), spare=as_rows(spare))


# ------------------------------------------------------------ fuser training data

TRAIN_SOURCES = ("dolly_public", "gsm8k_train")
HELDOUT_SOURCES = ("dolly_eval", "gsm8k_test")
COUNTERPART = {"dolly_public": "dolly_eval", "gsm8k_train": "gsm8k_test"}  # train -> held out
ALL = "all"  # a source's n: every row it has


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``c2c.train.data``: a named source and how many of its rows (``n=None``:
    every row, written ``n: all``)."""

    source: str
    n: int | None


def _count(value, where: str, allow_zero: bool = True) -> int | None:
    if isinstance(value, str) and value == ALL or value is None and not allow_zero:
        return None
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{where} must be an integer >= {low} or {ALL!r}, got {value!r}")
    return int(value)


def training_data_spec(cfg) -> list[SourceSpec]:
    """The fuser training sources of ``cfg.c2c.train.data`` (no data loaded).

    ``c2c.train.data`` is a list of ``{source: <name>, n: <int >= 0 | all>}``, each name one of
    :data:`TRAIN_SOURCES` at most once; absent, it is ``[{source: dolly_public, n:
    data.public_slices.fuser_train}]`` (the fuser_train slice, as before the sources existed).

    Raises:
        ConfigError: not a non-empty list, an entry that is not ``{source, n}``, an unknown
            source (the message names the valid ones), a source twice, an ``n`` that is not an
            integer >= 0 or ``all``, or every ``n`` zero.
    """
    c2c = cfg.get("c2c") or {}
    train = c2c.get("train") or {}
    data = train.get("data") if hasattr(train, "get") else None
    if data is None:
        return [SourceSpec("dolly_public", slice_sizes(cfg["data"]).fuser_train)]
    if isinstance(data, (str, bytes)) or not hasattr(data, "__len__") or hasattr(data, "keys") \
            or len(data) == 0:
        raise ConfigError(f"c2c.train.data must be a non-empty list of {{source, n}} (sources: "
                          f"{', '.join(TRAIN_SOURCES)}), got {data!r}")
    specs: list[SourceSpec] = []
    for i, item in enumerate(data):
        where = f"c2c.train.data[{i}]"
        keys = set(item.keys()) if hasattr(item, "keys") else None
        if keys != {"source", "n"}:
            raise ConfigError(f"{where} must be {{source: <name>, n: <int >= 0 | all>}}, got {item!r}")
        name = item["source"]
        if name not in TRAIN_SOURCES:
            raise ConfigError(f"{where}.source={name!r} is not a fuser training source: use one of "
                              f"{', '.join(TRAIN_SOURCES)}")
        if any(s.source == name for s in specs):
            raise ConfigError(f"{where}: source {name!r} is listed twice; give it once with its n")
        specs.append(SourceSpec(str(name), _count(item["n"], f"{where}.n")))
    if all(s.n == 0 for s in specs):
        raise ConfigError("c2c.train.data asks for 0 rows in all: give some source an n >= 1")
    return specs


def _dolly_pool(sl: PublicSlices) -> list[dict]:
    """``dolly_public``: the fuser_train slice, then the spare rows (distinct instructions)."""
    seen = {_norm(sl.dataset[int(i)]["instruction"]) for i in sl.fuser_train.tolist()}
    tail = []
    for i, text in zip(sl.spare.tolist(), sl.dataset.select(sl.spare.tolist())["instruction"][:]
                       if len(sl.spare) else []):
        if _norm(text) not in seen:
            seen.add(_norm(text))
            tail.append(i)
    idx = sl.fuser_train.tolist() + tail
    return [dict(r, source="dolly_public", row=i)
            for i, r in zip(idx, sl.dataset.select(idx))] if idx else []


def _qnorm(text: str) -> str:
    """A GSM8K question for comparison: case-folded, whitespace collapsed."""
    return " ".join(str(text).casefold().split())


def _gsm8k_rows(ds, order, source: str) -> list[dict]:
    return [{"instruction": ds[i]["question"].strip(), "context": "",
             "response": ds[i]["answer"].strip(), "category": "gsm8k", "source": source, "row": i}
            for i in order]


def _gsm8k_train_pool(data_cfg, seed: int) -> list[dict]:
    """``gsm8k_train``: the train split in a ``seed`` permutation, without a question the test
    split (or an earlier train row) holds after :func:`_qnorm`."""
    train, test = load_gsm8k_split(data_cfg, "train"), load_gsm8k_split(data_cfg, "test")
    seen = set(map(_qnorm, test["question"][:]))
    questions = train["question"][:]
    order = []
    for i in np.random.default_rng(seed).permutation(len(train)).tolist():
        q = _qnorm(questions[i])
        if q not in seen:
            seen.add(q)
            order.append(i)
    return _gsm8k_rows(train, order, "gsm8k_train")


def _take(pool: list[dict], n: int | None, what: str, hint: str) -> list[dict]:
    if n is not None and n > len(pool):
        raise ConfigError(f"{what} asks for n={n} rows, {len(pool)} are available: use n <= "
                          f"{len(pool)} or n: {ALL}{hint}")
    return pool if n is None else pool[:n]


def fuser_training_rows(cfg, seed: int, *, slices: PublicSlices | None = None) -> list[dict]:
    """The rows the C2C fusers train on: the sources of ``cfg.c2c.train.data``, interleaved.

    Sources (every one disjoint from every evaluation set by construction):

    * ``dolly_public``: public Dolly rows (held by no client), in this order: the
      ``fuser_train`` slice, then the slices' spare rows (after ``attack_train``; the draft
      head's token counts use them too, no evaluation does), without a repeated instruction.
      Never a ``fuser_val``, ``eval`` or ``attack_train`` row or instruction. ``n <=
      data.public_slices.fuser_train`` takes a prefix of the slice, so the evaluation rows do
      not move with ``n``; ``n: all`` every such row (1,210 at ``public_fraction=0.1``).
    * ``gsm8k_train``: the GSM8K train split (question -> instruction, answer with its
      worked solution -> response, category ``gsm8k``, no context) in a ``seed`` permutation,
      without a question equal to a test question (case-folded, whitespace collapsed):
      GSM8K is evaluated on its test split.

    Each source gives its first ``n`` rows (``n: all``: every row), so a smaller ``n`` is a
    prefix of a larger. Several sources are interleaved by a ``seed`` permutation that keeps
    each source's order; one source is its own order. Deterministic for ``(cfg, seed)``.

    Args:
        cfg: the run config (``cfg.data``, ``cfg.c2c.train.data``; see
            :func:`training_data_spec`).
        seed: the run's seed (``cfg.seed``): it cuts the public split and orders the rows.
        slices: :func:`public_slices` of ``(cfg.data, seed)`` when the caller has it.

    Returns:
        One dict per row: instruction, context, response, category (the Dolly row shape),
        ``source`` (the source name) and ``row`` (its row in the source's dataset file).
        The default config gives exactly the ``fuser_train`` slice's rows, in its order.

    Raises:
        ConfigError: a bad ``c2c.train.data`` (:func:`training_data_spec`), or an ``n`` above
            what its source holds (the message gives the count).
        ValueError: see :func:`public_slices`. FileNotFoundError, RuntimeError: a missing
            mirror file or an unreachable hub (:mod:`edgefuse.data`).
    """
    specs = training_data_spec(cfg)
    parts = []
    for spec in specs:
        if spec.n == 0:
            continue
        if spec.source == "dolly_public":
            sl = slices if slices is not None else public_slices(cfg["data"], seed)
            pool = _dolly_pool(sl)
            hint = (f" (the public split's fuser_train slice and spare rows; raise "
                    f"data.public_fraction={cfg['data']['public_fraction']} for more)")
        else:
            pool, hint = _gsm8k_train_pool(cfg["data"], seed), ""
        parts.append(_take(pool, spec.n, f"c2c.train.data source {spec.source}", hint))
    if len(parts) == 1:
        return list(parts[0])
    labels = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    labels = np.random.default_rng([seed, 14]).permutation(labels)
    nxt = [iter(p) for p in parts]
    return [next(nxt[k]) for k in labels.tolist()]


def heldout_rows(cfg, source: str, n: int | str | None, seed: int) -> list[dict]:
    """Held-out rows for evaluation losses, disjoint from every :func:`fuser_training_rows`.

    Sources (a training source's name gives its counterpart, :data:`COUNTERPART`):

    * ``dolly_eval`` (or ``dolly_public``): the public split's ``eval`` slice, the C2C and
      cloud evaluation pool (``data.public_slices.eval_per_category`` rows of each category),
      ordered round-robin over the sorted categories (a category's rows by dataset row), so
      any prefix is balanced across categories.
    * ``gsm8k_test`` (or ``gsm8k_train``): the GSM8K test split in the ``seed`` permutation
      that :func:`edgefuse.eval.queries.load_gsm8k` draws from (the first ``n`` are its
      questions), the answer with its worked solution as the response.

    Args:
        cfg: the run config (``cfg.data``).
        source: a name of :data:`HELDOUT_SOURCES` or :data:`TRAIN_SOURCES`.
        n: rows wanted (``None`` or ``"all"``: every row of the source).
        seed: the run's seed (cuts the public split, draws the GSM8K rows).

    Returns:
        The rows, in the shape of :func:`fuser_training_rows` with ``source`` the held-out
        name.

    Raises:
        ConfigError: an unknown source (the message names the valid ones), an ``n`` that is
            not an integer >= 1 or ``all``, or more than the source holds (with its count).
    """
    name = COUNTERPART.get(source, source)
    if name not in HELDOUT_SOURCES:
        raise ConfigError(f"unknown held-out source {source!r}: use one of "
                          f"{', '.join(HELDOUT_SOURCES + TRAIN_SOURCES)}")
    n = _count(n, f"held-out {name} n", allow_zero=False)
    if name == "dolly_eval":
        sl = public_slices(cfg["data"], seed)
        cats = np.asarray(sl.dataset.select(sl.eval.tolist())["category"][:]) if len(sl.eval) else []
        per = [sl.eval[np.asarray(cats) == c].tolist() for c in sl.categories]
        order = [ids[k] for k in range(max(map(len, per), default=0)) for ids in per if k < len(ids)]
        pool = [dict(r, source=name, row=i) for i, r in zip(order, sl.dataset.select(order))]
        hint = " (raise data.public_slices.eval_per_category for more)"
    else:
        test = load_gsm8k_split(cfg["data"], "test")
        pool = _gsm8k_rows(test, np.random.default_rng(seed).permutation(len(test)).tolist(), name)
        hint = ""
    return _take(pool, n, f"held-out {name}", hint)


def check_training_data(cfg) -> None:
    """Compose-time check of the fuser training data and the public split's size.

    Checks ``data.public_fraction`` (a number in [0, 1)), ``data.public_slices``
    (:func:`slice_sizes`) and ``c2c.train.data`` (:func:`training_data_spec`). Where a size
    depends on the data (``n: all``, a GSM8K ``n``, a ``dolly_public`` ``n`` above the
    fuser_train slice) and the data is in a local mirror, draws the rows to check it; from the
    hub, that check waits for the training. The default config loads nothing.

    Raises:
        ConfigError: any bad value above, or an ``n`` above what its source holds.
    """
    data = cfg["data"]
    frac = data.get("public_fraction")
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
        raise ConfigError(f"data.public_fraction (the share of the dataset no client holds, the "
                          f"public split) must be a number in [0, 1), got {frac!r}")
    try:
        sizes = slice_sizes(data)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    specs = training_data_spec(cfg)
    needs_data = any(s.n is None or s.source != "dolly_public" or s.n > sizes.fuser_train
                     for s in specs)
    if needs_data and mirror_dir(data.get("mirror")) is not None:
        try:
            fuser_training_rows(cfg, int(cfg["seed"]))
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None


__all__ = ["SLICES", "SliceSizes", "PublicSlices", "slice_sizes", "public_slices",
           "TRAIN_SOURCES", "HELDOUT_SOURCES", "COUNTERPART", "SourceSpec", "training_data_spec",
           "fuser_training_rows", "heldout_rows", "check_training_data"]
