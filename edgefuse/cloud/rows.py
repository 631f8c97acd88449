"""What a forward of n new-token rows costs the target, and the row count to pad it to.

On a CPU the matrix kernels are not smooth in the rows a forward feeds (batch × new tokens):
on one core of the machine of ``bench/results/bench_rows.json`` the 1.5B target costs about
the same for 1 to 3 rows, twice that for 4 to 8, and 16 rows cost less than 8. A verify
block of γ + 1 rows, or a batch of several sessions, can therefore be made *cheaper* by
padding it with rows that are never returned. :class:`RowPadding` is that table: row count
n -> the row count a forward pads it to. It is what vLLM does on a GPU with its CUDA-graph
capture sizes (a batch padded to the next captured size), here chosen by measurement:
:func:`calibrate` times the target's own forward at a set of row counts when the service
starts (once per machine, model and thread count; the result is cached on disk) and
:meth:`RowPadding.from_costs` pads every n to the cheapest measured count at or above it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgefuse.io import atomic_write_json
from edgefuse.kvcache import cache_from_layers, cache_layers

log = logging.getLogger(__name__)

CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)  # row counts :func:`calibrate` times
CALIBRATION_VERSION = 1  # bump when what is timed changes: older cached tables are re-measured


@dataclass(frozen=True)
class RowPadding:
    """The row count a forward of ``n`` new-token rows (all sequences' together) is padded to.

    ``pad_to[n - 1]`` for ``n`` in ``1..len(pad_to)``; a larger ``n`` is not padded.
    ``costs_ms``: the measured ms per row count this table was chosen from (empty for a
    fixed rule); ``source``: how it was made (``none``, ``min N``, ``calibrated``, ``cached``).
    Raises ``ValueError`` for an entry below its ``n``."""
    pad_to: tuple[int, ...] = ()
    costs_ms: dict[int, float] = field(default_factory=dict)
    source: str = "none"

    def __post_init__(self):
        bad = [(n, m) for n, m in enumerate(self.pad_to, 1) if int(m) < n]
        if bad:
            raise ValueError(f"row padding pads {bad[0][0]} rows to {bad[0][1]}: fewer than it has")

    def rows(self, n: int) -> int:
        """The rows a forward of ``n`` new-token rows feeds (``n`` itself when not padded)."""
        return int(self.pad_to[n - 1]) if 1 <= n <= len(self.pad_to) else int(n)

    @classmethod
    def none(cls) -> RowPadding:
        """No padding: every forward feeds exactly its rows."""
        return cls()

    @classmethod
    def minimum(cls, min_rows: int) -> RowPadding:
        """The fixed rule: 2 .. ``min_rows`` - 1 rows are padded to ``min_rows`` (1 row never:
        a single token runs alone). Raises ``ValueError`` for ``min_rows`` < 1."""
        if int(min_rows) < 1:
            raise ValueError(f"min_rows must be >= 1, got {min_rows}")
        m = int(min_rows)
        return cls(tuple(n if n == 1 else m for n in range(1, m)), {}, f"min {m}") if m > 2 else cls()

    @classmethod
    def from_costs(cls, costs_ms: dict[int, float], tolerance: float = 0.05,
                   source: str = "calibrated") -> RowPadding:
        """Pad each n in ``1..max(costs)`` to the fewest rows m ≥ n, m a measured count, whose
        cost is within ``tolerance`` (relative) of the cheapest measured count ≥ n. So an
        unmeasured n goes to a measured count, and padding is chosen only where it saves more
        than the tolerance. Raises ``ValueError`` for no costs, a count < 1 or a cost ≤ 0."""
        costs = {int(k): float(v) for k, v in costs_ms.items()}
        if not costs or min(costs) < 1 or min(costs.values()) <= 0:
            raise ValueError(f"row costs need counts >= 1 and positive times, got {costs_ms!r}")
        counts = sorted(costs)
        pad = []
        for n in range(1, counts[-1] + 1):
            above = [m for m in counts if m >= n]
            best = min(costs[m] for m in above)
            pad.append(next(m for m in above if costs[m] <= best * (1 + tolerance)))
        return cls(tuple(pad), costs, source)

    @classmethod
    def coerce(cls, value) -> RowPadding:
        """A :class:`RowPadding` as it is, an int ``m`` as :meth:`minimum`, None as none."""
        if value is None:
            return cls.none()
        if isinstance(value, RowPadding):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"row padding must be a RowPadding or an int, got {value!r}")
        return cls.minimum(value)

    def fed(self, bsz: int, longest: int) -> int:
        """Token rows one batched forward of ``bsz`` sequences (the longest with ``longest``
        new ids) feeds, padding included: every sequence right-padded to the same length."""
        return bsz * -(-self.rows(bsz * longest) // bsz)

    def summary(self) -> dict:
        """A JSON-able description (source, the padded counts, the measured ms)."""
        return {"source": self.source,
                "pad_to": {n: m for n, m in enumerate(self.pad_to, 1) if m != n},
                "costs_ms": {n: round(v, 2) for n, v in sorted(self.costs_ms.items())}}


@torch.no_grad()
def time_rows(body, *, embeds: bool, hidden: int, vocab: int, context: int, rows,
              repeats: int, output: str | None = None, on_row=None) -> dict[int, float]:
    """Median ms of one forward of ``body`` over ``n`` new rows after ``context`` cached
    positions, for each n in ``rows`` (one warm-up run first, then ``repeats``).

    ``body``: a causal LM or its decoder body (ids, or ``[1, n, hidden]`` embeddings when
    ``embeds``: a split's middle layers). ``output``: the attribute read from the result,
    so the work is the caller's real one (``"logits"`` includes the LM head). ``on_row(n,
    ms)`` is called after each count (progress). Random inputs from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    if embeds:
        prefix = {"inputs_embeds": torch.randn(1, context, hidden, generator=g) * 0.1}
    else:
        prefix = {"input_ids": torch.randint(0, vocab, (1, context), generator=g)}
    layers = cache_layers(body(**prefix, use_cache=True))
    res = {}
    for n in rows:
        new = ({"inputs_embeds": torch.randn(1, n, hidden, generator=g) * 0.1} if embeds
               else {"input_ids": torch.randint(0, vocab, (1, n), generator=g)})
        pos = torch.arange(context, context + n).unsqueeze(0)
        ts = []
        for _ in range(repeats + 1):  # the first is a warm-up
            cache = cache_from_layers([(k.clone(), v.clone()) for k, v in layers])
            t0 = time.perf_counter()
            out = body(**new, position_ids=pos, cache=cache, use_cache=True)
            if output is not None:
                getattr(out, output)
            ts.append(1000 * (time.perf_counter() - t0))
        res[int(n)] = statistics.median(ts[1:])
        if on_row is not None:
            on_row(int(n), res[int(n)])
    return res


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(model, name: str, context: int, rows, repeats: int) -> str:
    """What a calibrated table depends on, hashed (hex, 16): the model (name and config), the
    machine (CPU, cores), torch and its thread count, and what was timed."""
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else repr(model.config)
    doc = json.dumps({"v": CALIBRATION_VERSION, "name": name, "config": cfg, "cpu": _cpu_name(),
                      "cores": os.cpu_count(), "machine": platform.machine(),
                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "dtype": str(getattr(model, "dtype", "")), "context": int(context),
                      "rows": [int(r) for r in rows], "repeats": int(repeats)},
                     sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def calibrate(model, name: str, *, cache_dir: str | os.PathLike | None = None, context: int = 128,
              rows=CALIBRATION_ROWS, repeats: int = 2, tolerance: float = 0.05) -> RowPadding:
    """Time ``model``'s forward (LM head included, as a verify runs it) at each count of
    ``rows`` on top of a ``context``-token cache and return :meth:`RowPadding.from_costs`.

    With ``cache_dir``, the table is read from ``cache_dir/rowcost/<name>-<key>.json`` when
    it was measured for the same model, machine, torch threads and settings
    (:func:`calibration_key`), else measured and written there atomically; an unreadable
    file is measured again. On the CPU of ``bench_rows.json`` the 1.5B takes about 70 s
    (seconds for the tiny models). On CUDA the table is not measured: no padding (a GPU's
    cost is close to flat in the rows; padding buys nothing)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return RowPadding(source=f"none ({device.type})")
    path = None
    if cache_dir is not None:
        key = calibration_key(model, name, context, rows, repeats)
        path = Path(cache_dir) / "rowcost" / f"{name}-{key}.json"
        try:
            doc = json.loads(path.read_text())
            return RowPadding.from_costs({int(k): v for k, v in doc["costs_ms"].items()}, tolerance,
                                         source="cached")
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("row costs at %s unreadable (%s): measuring again", path, exc)
    t0 = time.perf_counter()
    cfg = model.config
    costs = time_rows(model, embeds=False, hidden=int(cfg.hidden_size), vocab=int(cfg.vocab_size),
                      context=context, rows=rows, repeats=repeats, output="logits")
    pad = RowPadding.from_costs(costs, tolerance)
    log.info("row costs of %s measured in %.1f s: %s", name, time.perf_counter() - t0,
             ", ".join(f"{n}:{v:.0f}" for n, v in sorted(costs.items())))
    if path is not None:
        atomic_write_json(path, {"model": name, "costs_ms": {str(k): v for k, v in costs.items()},
                                 "context": context, "repeats": repeats,
                                 "threads": torch.get_num_threads(), "cpu": _cpu_name()})
    return pad


ROW_PADDING_CHOICES = "auto | none | an int m >= 1"


def check_row_padding(value) -> str:
    """The setting ``cloud.service.row_padding`` / ``--row-padding`` normalised: ``auto``
    (calibrate on this machine), ``none``, or an int m (pad 2..m-1 rows to m) as text.
    Raises ``ValueError`` for anything else."""
    text = str(value).strip().lower()
    if text in ("auto", "none"):
        return text
    try:
        m = int(text)
    except ValueError:
        m = 0
    if m < 1 or isinstance(value, (bool, float)):
        raise ValueError(f"row_padding must be {ROW_PADDING_CHOICES}, got {value!r}")
    return str(m)


def row_padding_for(setting, model, name: str, cache_dir: str | os.PathLike | None = None) -> RowPadding:
    """The :class:`RowPadding` a service uses for ``model`` under ``setting``
    (:func:`check_row_padding`): ``auto`` = :func:`calibrate` (cached under ``cache_dir``).
    Raises ``ValueError`` for a bad setting."""
    setting = check_row_padding(setting)
    if setting == "auto":
        return calibrate(model, name, cache_dir=cache_dir)
    return RowPadding.none() if setting == "none" else RowPadding.minimum(int(setting))
