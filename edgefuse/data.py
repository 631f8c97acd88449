"""Data: loading Dolly-15k, non-IID client partitions, prompt formatting, batching.

Every split is a pure function of ``(data_cfg, seed)``: the server and each client
recompute the same partitions independently, nothing is sent around.

Index pipeline (all indices are rows of the loaded dataset)::

    all rows --split_public--> public (server only) | federated
    federated --partition_by_category / partition_dirichlet--> one part per client
    client part --client_split--> train (≤ max_train_examples) | val (≤ max_eval_examples)

Partitioning goes through flwr-datasets (the Flower ecosystem's ``datasets`` partitioners,
used on the in-memory dataset): ``DirichletPartitioner`` for ``dirichlet``, natural-id
partitioning by category for ``category``; only the placing of whole categories on clients,
which flwr-datasets lacks, is written here. flwr-datasets 0.6 needs ``datasets`` 4, which
serves everything edgefuse uses of it (``load_dataset`` on JSON/CSV files and hub ids,
``select``, column access). The category partitions are the rows they were before; the
Dirichlet ones are new (see :func:`partition_dirichlet`).

GSM8K (:func:`load_gsm8k_split`) is loaded the same way, from ``<data.mirror>/gsm8k/`` or the
hub; the server trains the C2C fusers on its train split (:mod:`edgefuse.eval.splits`).

Training loss is on response tokens only: ``tokenize_example`` sets ``labels = -100``
on the prompt. Rows left with no response token after truncation are dropped by
``tokenize_dataset``, so a batch never has an all-masked row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IGNORE_INDEX = -100  # label value that torch's cross-entropy skips

# Supported datasets: name -> (format for `datasets.load_dataset` on the mirror file,
# column holding the label that partitioning skews). Add a dataset here.
DATASETS: dict[str, tuple[str, str]] = {
    "dolly": ("json", "category"),
}

PARTITIONINGS = ("category", "dirichlet")

# Loaded datasets, keyed by resolved mirror path (or "hub:<id>"): one load per process.
_CACHE: dict[str, object] = {}


# ----------------------------------------------------------------------------- loading

PROJECT_ROOT = Path(__file__).resolve().parents[1]  # the folder above edgefuse/ (the checkout)
HUB = "hub"  # data.mirror value: download from the hub, no local mirror looked for


def mirror_dir(mirror) -> Path | None:
    """A ``data.mirror`` value as a folder, or None for the hub (``None``, ``""``,
    ``"null"``, :data:`HUB`).

    ``~`` is expanded; a relative folder is tried against the current directory, then
    against :data:`PROJECT_ROOT` (the current directory's when neither exists). Whether the
    folder exists is for the caller to check. Which mirror a run uses (config, env,
    ``../shared/data``, hub) is decided by :func:`edgefuse.config.resolve_paths`.
    """
    if mirror is None or str(mirror) in ("", "null", HUB):
        return None
    path = Path(str(mirror)).expanduser()
    if path.is_absolute():
        return path.resolve()
    candidates = [Path.cwd() / path, PROJECT_ROOT / path]
    return next((c for c in candidates if c.is_dir()), candidates[0]).resolve()


def mirror_file(data_cfg) -> Path | None:
    """The dataset file ``<data.mirror>/<data.mirror_file>``, or None when the data comes
    from the hub (no mirror, see :func:`mirror_dir`).

    Raises:
        FileNotFoundError: a mirror is set but the file is not there; the message names
            the config key ``data.mirror`` and the env var ``EDGEFUSE_DATA_MIRROR``.
    """
    folder = mirror_dir(data_cfg.get("mirror"))
    if folder is None:
        return None
    path = (folder / data_cfg["mirror_file"]).resolve()
    if not path.is_file():
        raise FileNotFoundError(
            f"{data_cfg['name']} mirror file not found: {path} (data.mirror="
            f"{str(data_cfg.get('mirror'))!r}, data.mirror_file={data_cfg['mirror_file']!r}). "
            f"Point data.mirror (or env EDGEFUSE_DATA_MIRROR) at the folder holding it, or set "
            f"data.mirror={HUB} to download {data_cfg['hub_id']!r} from the hub.")
    return path


def load_dolly(data_cfg):
    """Load the whole dataset named by ``data_cfg.name`` (only ``dolly`` for now).

    From the local mirror ``<data.mirror>/<data.mirror_file>`` when ``data.mirror`` is set
    (no network), else from the hub (``data.hub_id``, split ``train``). The result is
    cached per process, keyed by the resolved path.

    Returns:
        ``datasets.Dataset`` with columns instruction, context, response, category
        (15,011 rows for Dolly-15k).

    Raises:
        ValueError: unknown ``data.name`` (the message lists supported names).
        FileNotFoundError: ``data.mirror`` is set but the file is not there.
        RuntimeError: no mirror, and the hub could not be reached (offline, unknown id).
    """
    import datasets

    name = data_cfg["name"]
    if name not in DATASETS:
        raise ValueError(f"unknown dataset data.name={name!r}; supported: {sorted(DATASETS)}")
    fmt, _ = DATASETS[name]
    path = mirror_file(data_cfg)
    if path is not None:
        key = str(path)
        if key not in _CACHE:
            _CACHE[key] = datasets.load_dataset(fmt, data_files=key, split="train")
    else:
        key = f"hub:{data_cfg['hub_id']}"
        if key not in _CACHE:
            try:
                _CACHE[key] = datasets.load_dataset(data_cfg["hub_id"], split="train")
            except Exception as e:  # offline, hub errors: many types
                raise RuntimeError(
                    f"could not load {data_cfg['hub_id']!r} from the hub ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:300]}); offline, point data.mirror or env "
                    f"EDGEFUSE_DATA_MIRROR at a data mirror holding {data_cfg['mirror_file']} "
                    f"(e.g. ../shared/data)") from e
    return _CACHE[key]


GSM8K_HUB_ID = "openai/gsm8k"  # hub id (config ``main``) when there is no mirror
GSM8K_SPLITS = ("train", "test")


def load_gsm8k_split(data_cfg, split: str):
    """One GSM8K split, whole: ``<data.mirror>/gsm8k/<split>.jsonl`` when ``data.mirror`` is a
    folder (no network), else the hub dataset :data:`GSM8K_HUB_ID` (config ``main``). Cached
    per process like :func:`load_dolly`.

    Returns:
        ``datasets.Dataset`` with columns question, answer (7,473 train / 1,319 test rows).

    Raises:
        ValueError: ``split`` not in :data:`GSM8K_SPLITS`.
        FileNotFoundError: a mirror is set but has no ``gsm8k/<split>.jsonl`` (names
            ``data.mirror``).
        RuntimeError: no mirror, and the hub could not be reached.
    """
    import datasets

    if split not in GSM8K_SPLITS:
        raise ValueError(f"unknown GSM8K split {split!r}: use one of {', '.join(GSM8K_SPLITS)}")
    folder = mirror_dir(data_cfg.get("mirror"))
    if folder is not None:
        path = (folder / "gsm8k" / f"{split}.jsonl").resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"GSM8K mirror file not found: {path} (data.mirror={str(data_cfg.get('mirror'))!r}). "
                f"Point data.mirror (or env EDGEFUSE_DATA_MIRROR) at the folder holding "
                f"gsm8k/{split}.jsonl, or set data.mirror={HUB} to download {GSM8K_HUB_ID!r}.")
        key = str(path)
        if key not in _CACHE:
            _CACHE[key] = datasets.load_dataset("json", data_files=key, split="train")
        return _CACHE[key]
    key = f"hub:{GSM8K_HUB_ID}:{split}"
    if key not in _CACHE:
        try:
            _CACHE[key] = datasets.load_dataset(GSM8K_HUB_ID, "main", split=split)
        except Exception as e:  # offline, hub errors: many types
            raise RuntimeError(
                f"could not load {GSM8K_HUB_ID!r} (split {split!r}) from the hub ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:300]}); offline, point data.mirror or env "
                f"EDGEFUSE_DATA_MIRROR at a data mirror holding gsm8k/{split}.jsonl "
                f"(e.g. ../shared/data)") from e
    return _CACHE[key]


def check_data_config(data_cfg) -> None:
    """Refuse a ``data`` config that would fail only inside the clients, before a run starts.

    Raises:
        ValueError: an unknown ``name`` (:data:`DATASETS`) or ``partitioning``
            (:data:`PARTITIONINGS`); a ``dirichlet_alpha`` that is not a finite number > 0;
            a ``public_fraction`` outside ``[0, 1)`` or ``val_fraction`` outside ``(0, 1)``;
            a ``max_seq_len`` below 2 or a cap (``max_train_examples``, ``max_eval_examples``)
            that is neither null nor an integer >= 1. Each message names the key.
    """
    import math

    def number(key: str):
        v = data_cfg.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return v if ok else None

    def integer(key: str):
        v = data_cfg.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    if data_cfg.get("name") not in DATASETS:
        raise ValueError(f"unknown data.name={data_cfg.get('name')!r}; valid: {list(DATASETS)}")
    if data_cfg.get("partitioning") not in PARTITIONINGS:
        raise ValueError(f"unknown data.partitioning={data_cfg.get('partitioning')!r}; "
                         f"valid: {list(PARTITIONINGS)}")
    if (a := number("dirichlet_alpha")) is None or a <= 0:
        raise ValueError(f"data.dirichlet_alpha must be a finite number > 0, got "
                         f"{data_cfg.get('dirichlet_alpha')!r}")
    if (f := number("public_fraction")) is None or not 0 <= f < 1:
        raise ValueError(f"data.public_fraction must be a number in [0, 1), got "
                         f"{data_cfg.get('public_fraction')!r}")
    if (f := number("val_fraction")) is None or not 0 < f < 1:
        raise ValueError(f"data.val_fraction must be a number in (0, 1), got "
                         f"{data_cfg.get('val_fraction')!r}")
    if (n := integer("max_seq_len")) is None or n < 2:
        raise ValueError(f"data.max_seq_len must be an integer >= 2, got {data_cfg.get('max_seq_len')!r}")
    for key in ("max_train_examples", "max_eval_examples"):
        if data_cfg.get(key) is not None and ((n := integer(key)) is None or n < 1):
            raise ValueError(f"data.{key} must be null (no cap) or an integer >= 1, got "
                             f"{data_cfg.get(key)!r}")


# ------------------------------------------------------------------------ partitioning

def split_public(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(n)`` into (public, federated) index arrays by a seeded permutation.

    ``round(fraction * n)`` indices go public (held by no client, used by the server).
    Both arrays are sorted int64; together they cover ``range(n)`` exactly once.

    Raises:
        ValueError: ``fraction`` outside [0, 1).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"public_fraction must be in [0, 1), got {fraction}")
    perm = np.random.default_rng(seed).permutation(n)
    n_pub = int(round(fraction * n))
    return np.sort(perm[:n_pub]), np.sort(perm[n_pub:])


def _by_category(categories: Sequence[str]) -> dict[str, np.ndarray]:
    """Sorted category name -> indices of its examples (ascending): flwr-datasets'
    natural-id partitioning by the category column, one partition per category.

    ``GroupedNaturalIdPartitioner`` with one id per group and sorted ids is
    ``NaturalIdPartitioner``'s partitioning (same partitions, same order) without the
    progress bar the latter writes to stderr on every call.
    """
    from datasets import Dataset
    from flwr_datasets.partitioner import GroupedNaturalIdPartitioner

    cats = [str(c) for c in categories]
    natural = GroupedNaturalIdPartitioner(partition_by="category", group_size=1, sort_unique_ids=True)
    natural.dataset = Dataset.from_dict({"category": cats, "row": list(range(len(cats)))})
    out = {}
    for pid in range(natural.num_partitions):
        (cat,) = natural.partition_id_to_natural_ids[pid]
        out[cat] = np.asarray(natural.load_partition(pid)["row"][:], dtype=np.int64)
    return out


def partition_by_category(categories: Sequence[str], num_partitions: int,
                          seed: int) -> list[np.ndarray]:
    """Natural non-IID split: clients hold whole categories (or shares of one category).

    The rows of each category come from flwr-datasets' natural-id partitioning
    (:func:`_by_category`). flwr-datasets has no partitioner that puts C natural ids on an
    arbitrary number P of clients (``NaturalIdPartitioner`` makes C partitions,
    ``GroupedNaturalIdPartitioner`` ``ceil(C / group_size)``, and none splits one id across
    clients), so that mapping is written here. With the C sorted category names shuffled by
    ``seed`` into ``order``:

    * ``num_partitions <= C``: category ``order[i]`` goes whole to partition ``i % P``.
      Each partition gets at least one category and no category is shared.
    * ``num_partitions > C``: partition ``p`` draws from category ``order[p % C]``; each
      category's examples are shuffled and split as evenly as possible among the
      partitions that draw from it. Partitions never mix categories.

    Returns:
        ``num_partitions`` sorted int64 index arrays into ``categories``; every index
        appears in exactly one, and none is empty.

    Raises:
        ValueError: ``num_partitions < 1``, or a category has fewer examples than the
            partitions that must share it.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    rng = np.random.default_rng(seed)
    groups = _by_category(categories)
    order = [list(groups)[i] for i in rng.permutation(len(groups))]
    C, P = len(order), num_partitions
    parts: list[list[np.ndarray]] = [[] for _ in range(P)]
    if P <= C:
        for i, c in enumerate(order):
            parts[i % P].append(groups[c])
    else:
        for j, c in enumerate(order):
            owners = list(range(j, P, C))  # partitions p with p % C == j
            if len(groups[c]) < len(owners):
                raise ValueError(f"category {c!r} has {len(groups[c])} examples, too few "
                                 f"for {len(owners)} partitions")
            for p, chunk in zip(owners, np.array_split(rng.permutation(groups[c]), len(owners))):
                parts[p].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def partition_dirichlet(categories: Sequence[str], num_partitions: int, alpha: float,
                        seed: int, min_size: int = 1) -> list[np.ndarray]:
    """Label-skew split (Hsu et al. 2019) by flwr-datasets' ``DirichletPartitioner``.

    For each category, its examples are cut among the partitions with proportions
    ~ Dir(alpha * 1_P) (``self_balancing=False``). Small alpha: each category lands mostly
    on a few clients; large alpha: close to uniform. flwr-datasets repeats the draw (its
    generator seeded by ``seed``, so still deterministic) until every partition has
    ``min_size`` examples, at most 10 times. flwr-datasets cuts each category's rows in
    their order, so the rows go in shuffled (by ``seed``) to make each cut a random subset.

    Reproducible for a seed, but not the partitions of edgefuse before it used
    flwr-datasets (a hand-written draw with another use of the generator): the same
    ``data.partitioning=dirichlet`` run now gives its clients other rows.

    Returns:
        ``num_partitions`` sorted int64 index arrays into ``categories``; every index
        appears in exactly one.

    Raises:
        ValueError: ``num_partitions < 1``, more partitions than examples, or ``alpha <= 0``.
        RuntimeError: no draw in 10 tries met ``min_size``.
    """
    import warnings

    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if alpha <= 0:
        raise ValueError(f"dirichlet_alpha must be > 0, got {alpha}")
    if num_partitions > len(categories):
        raise ValueError(f"{num_partitions} partitions for {len(categories)} examples")
    order = np.random.default_rng([seed, 1]).permutation(len(categories))
    cats = np.asarray([str(c) for c in categories])[order]
    part = DirichletPartitioner(num_partitions=num_partitions, partition_by="category",
                                alpha=float(alpha), min_partition_size=min_size,
                                self_balancing=False, shuffle=False, seed=seed)
    part.dataset = Dataset.from_dict({"category": cats.tolist(), "row": order.tolist()})
    try:
        with warnings.catch_warnings():  # one warning per failed draw; the error below says it
            warnings.simplefilter("ignore", UserWarning)
            out = [np.sort(np.asarray(part.load_partition(p)["row"][:], dtype=np.int64))
                   for p in range(num_partitions)]
    except ValueError as e:
        if "attempts" not in str(e):
            raise
        raise RuntimeError(f"Dirichlet partitioning (alpha={alpha}, {num_partitions} partitions) left "
                           f"a partition with < {min_size} examples in 10 tries; raise "
                           f"data.dirichlet_alpha or use fewer partitions") from None
    return out


def _federated_parts(data_cfg, num_partitions: int, seed: int):
    """(dataset, public indices, per-partition dataset indices) for ``data_cfg``."""
    scheme = data_cfg["partitioning"]
    if scheme not in PARTITIONINGS:
        raise ValueError(f"unknown data.partitioning={scheme!r}; valid: {list(PARTITIONINGS)}")
    ds = load_dolly(data_cfg)
    public, fed = split_public(len(ds), float(data_cfg["public_fraction"]), seed)
    cats = np.asarray(ds[DATASETS[data_cfg["name"]][1]][:])[fed]  # [:]: a list, not row by row
    if scheme == "category":
        parts = partition_by_category(cats, num_partitions, seed)
    else:
        parts = partition_dirichlet(cats, num_partitions, float(data_cfg["dirichlet_alpha"]), seed)
    return ds, public, [fed[p] for p in parts]  # map back to dataset rows


def client_split(data_cfg, partition_id: int, num_partitions: int, seed: int):
    """This client's (train, val) datasets.

    The client's partition of the non-public rows is permuted (seeded by
    ``(seed, partition_id)``); the first ``max(1, round(val_fraction * n))`` rows are val
    (then capped at ``max_eval_examples``), the rest train (capped at
    ``max_train_examples``). A cap of null means no cap.

    Returns:
        (train, val) ``datasets.Dataset``s, disjoint, with the loaded columns.

    Raises:
        ValueError: ``partition_id`` not in ``[0, num_partitions)``, unknown
            ``data.partitioning``, or a partition with fewer than 2 examples.
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id {partition_id} out of range [0, {num_partitions})")
    ds, _, parts = _federated_parts(data_cfg, num_partitions, seed)
    idx = np.random.default_rng([seed, partition_id]).permutation(parts[partition_id])
    if len(idx) < 2:
        raise ValueError(f"partition {partition_id} has {len(idx)} example(s); need >= 2")
    n_val = min(max(1, int(round(float(data_cfg["val_fraction"]) * len(idx)))), len(idx) - 1)
    val, train = idx[:n_val], idx[n_val:]
    max_val, max_train = data_cfg.get("max_eval_examples"), data_cfg.get("max_train_examples")
    val = val[:max_val] if max_val is not None else val
    train = train[:max_train] if max_train is not None else train
    return ds.select(np.sort(train)), ds.select(np.sort(val))


def public_split(data_cfg, seed: int):
    """The public rows (held by no client) as a ``datasets.Dataset``, for the server."""
    ds = load_dolly(data_cfg)
    public, _ = split_public(len(ds), float(data_cfg["public_fraction"]), seed)
    return ds.select(public)


# ----------------------------------------------------------------- prompts and tokens

def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_example(example: dict, tokenizer) -> tuple[str, str]:
    """(prompt_text, response_text) for one Dolly row.

    With a chat template: one user message, the instruction plus the context (if any)
    after a blank line, rendered with the generation prompt; the response ends with
    ``tokenizer.eos_token`` (``<|im_end|>`` for SmolLM2/Qwen2.5-Instruct, i.e. their
    end of turn). Without one (base models)::

        ### Instruction:\\n{instruction}\\n\\n### Context:\\n{context}\\n\\n### Response:\\n

    with the Context block left out when empty, and response + eos_token.

    Raises:
        ValueError: the tokenizer has no eos_token.
    """
    if tokenizer.eos_token is None:
        raise ValueError("tokenizer has no eos_token; cannot mark the end of a response")
    instruction = example["instruction"].strip()
    context = (example.get("context") or "").strip()
    response = example["response"].strip() + tokenizer.eos_token
    if _has_chat_template(tokenizer):
        user = instruction + (f"\n\n{context}" if context else "")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                               tokenize=False, add_generation_prompt=True)
        return prompt, response
    prompt = f"### Instruction:\n{instruction}\n\n"
    if context:
        prompt += f"### Context:\n{context}\n\n"
    return prompt + "### Response:\n", response


@dataclass(frozen=True)
class TokenizedParts:
    """One formatted row, tokenized and truncated (:func:`tokenize_parts`).

    Attributes:
        prompt: the formatted prompt text (:func:`format_example`).
        add_special_tokens: whether the prompt was tokenized with the tokenizer's special
            tokens (False when the chat template already wrote the BOS).
        prompt_ids: every token id of ``prompt``, before truncation.
        kept: the indices into ``prompt_ids`` that survive truncation (a leading BOS, then a
            suffix), ascending.
        response_ids: the response tokens that survive truncation (response text + EOS).
    """

    prompt: str
    add_special_tokens: bool
    prompt_ids: list[int]
    kept: list[int]
    response_ids: list[int]


def tokenize_parts(example: dict, tokenizer, max_seq_len: int) -> TokenizedParts:
    """Format one row and tokenize its prompt and response, truncated to ``max_seq_len``.

    The prompt is tokenized with the tokenizer's special tokens (BOS where it adds one;
    not again if the chat template already wrote it), the response without. If the pair is
    longer than ``max_seq_len``, the prompt loses tokens from its left (a leading BOS is
    kept) but not below ``max_seq_len // 2`` tokens, then the whole is cut on the right. So
    a non-empty response always keeps at least ``max_seq_len - max_seq_len // 2`` tokens.
    The rule of :func:`tokenize_example` and of C2C pair examples
    (:mod:`edgefuse.c2c.examples`), which also need the kept prompt positions.
    """
    prompt, response = format_example(example, tokenizer)
    bos = tokenizer.bos_token
    add_special = not (bos and prompt.startswith(bos))  # Gemma-style templates write BOS
    p_ids = tokenizer(prompt, add_special_tokens=add_special)["input_ids"]
    r_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    kept = list(range(len(p_ids)))
    if len(p_ids) + len(r_ids) > max_seq_len:
        keep = max(max_seq_len - len(r_ids), max_seq_len // 2)
        if len(p_ids) > keep:
            head = [0] if bos is not None and p_ids and p_ids[0] == tokenizer.bos_token_id else []
            kept = head + list(range(len(p_ids) - max(keep - len(head), 0), len(p_ids)))
    kept = kept[:max_seq_len]
    return TokenizedParts(prompt, add_special, list(p_ids), kept,
                          list(r_ids[:max(max_seq_len - len(kept), 0)]))


def tokenize_example(example: dict, tokenizer, max_seq_len: int) -> dict[str, list[int]]:
    """Token ids for one row, loss on the response only, truncated as
    :func:`tokenize_parts` says; rows that end up with no response token are dropped by
    ``tokenize_dataset``.

    Returns:
        dict of equal-length lists (length ≤ max_seq_len): ``input_ids``,
        ``attention_mask`` (all 1), ``labels`` (-100 on prompt positions, else the id).
    """
    parts = tokenize_parts(example, tokenizer, max_seq_len)
    p_ids = [parts.prompt_ids[i] for i in parts.kept]
    ids = p_ids + parts.response_ids
    labels = [IGNORE_INDEX] * len(p_ids) + parts.response_ids
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def tokenize_dataset(ds, tokenizer, max_seq_len: int) -> list[dict[str, list[int]]]:
    """``tokenize_example`` on every row of ``ds``, dropping rows with no response token."""
    rows = (tokenize_example(ex, tokenizer, max_seq_len) for ex in ds)
    return [r for r in rows if any(l != IGNORE_INDEX for l in r["labels"])]


def collate(rows: list[dict], pad_id: int) -> dict:
    """Right-pad tokenized rows to the longest one.

    Returns:
        ``input_ids`` (padded with ``pad_id``), ``attention_mask`` (0 on padding),
        ``labels`` (-100 on padding): torch LongTensors of shape [batch, T].
    """
    import torch

    if pad_id is None:
        raise ValueError("pad_id is None; set tokenizer.pad_token (e.g. to eos_token)")
    T = max(len(r["input_ids"]) for r in rows)
    out = {k: torch.full((len(rows), T), v, dtype=torch.long)
           for k, v in (("input_ids", pad_id), ("attention_mask", 0), ("labels", IGNORE_INDEX))}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        for k in out:
            out[k][i, :n] = torch.tensor(r[k], dtype=torch.long)
    return out


def batches(rows: list, batch_size: int, seed: int, round_idx: int) -> Iterator[list]:
    """Endless stream of ``batch_size``-row batches for one round.

    Rows are visited epoch by epoch, each epoch in a fresh permutation drawn from a
    generator seeded by ``(seed, round_idx)``: reproducible, different across rounds.
    Batches are always full; one may straddle two epochs. Take S with
    ``itertools.islice(batches(...), S)``.

    Raises:
        ValueError: ``rows`` is empty or ``batch_size < 1`` (on the first ``next``).
    """
    if not rows or batch_size < 1:
        raise ValueError(f"need rows and batch_size >= 1 (got {len(rows)} rows, {batch_size})")
    rng = np.random.default_rng([seed, round_idx])
    batch = []
    while True:
        for i in rng.permutation(len(rows)):
            batch.append(rows[i])
            if len(batch) == batch_size:
                yield batch
                batch = []
