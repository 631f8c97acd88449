"""Server-side aggregation of LoRA adapters, one base-model group at a time.

A client's adapter state maps normalized keys (``model.layers.0.self_attn.q_proj.lora_A.weight``,
see :mod:`edgefuse.lora`) to float32 arrays: ``lora_A`` is ``[r, in_features]``, ``lora_B`` is
``[out_features, r]``, and the module's update is ``ΔW = s · B A`` with ``s = alpha / r``.

Clients of one group that share a rank and alpha are averaged with FedAvg on ``A`` and ``B``
separately, weighted by example counts (as Flower's FlowerTune LLM baseline does). When ranks
differ (each device picks the rank its memory allows) we use FlexLoRA (Bai et al., 2024,
"Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and Client
Resources"): average the full ``ΔW`` per module, then give each client the best rank-``r_k``
approximation from an SVD.

Why FlexLoRA and not FLoRA's stacking (Wang et al., 2024): FLoRA concatenates every client's
``A`` and ``B``, so the global rank is the sum of the client ranks and grows with the
federation; clients must merge that stacked ``ΔW`` into their base weights and re-initialize
a fresh adapter each round. Each client's download then grows with the number of clients,
and the base weights drift away from the shared open-weight model, which the Cache-to-Cache
fusers later need unmodified. FlexLoRA keeps every client at its own rank (its memory
budget), is exact in the aggregated ``ΔW`` before truncation, and the truncation is the
optimal rank-``r`` approximation (Eckart-Young) whose relative error we report.

Robust aggregation (``training.robust``): FedAvg lets one client move every coordinate of
the average by ``1/n`` of whatever it sends (up to the update-norm bound). The
coordinate-wise trimmed mean and median of Yin et al. (ICML 2018, "Byzantine-robust
distributed learning: towards optimal statistical rates") replace the mean, per coordinate,
by a statistic that a minority of clients cannot drag outside the honest clients' range;
see :func:`coordinate_trimmed_mean`, :func:`coordinate_median` and :func:`aggregate_group`.

Plain numpy/torch; no Flower imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"
METHODS = ("flexlora",)
EQUAL_RANK = ("flexlora", "fedavg")  # training.equal_rank
ROBUST = ("none", "trimmed_mean", "median")  # training.robust


class MalformedUpdateError(ValueError):
    """A client update (or its packed wire form) that must not be aggregated; says why."""


@dataclass
class ClientUpdate:
    """One client's adapter for one round.

    Attributes:
        partition_id: the client's data partition (its id in the federation).
        model: the base-model group name (e.g. ``smollm2-135m``).
        rank: LoRA rank ``r``.
        alpha: LoRA alpha; the scaling is ``alpha / rank``.
        num_examples: training examples seen this round (the FedAvg weight).
        state: normalized key -> float32 array (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``).
    """

    partition_id: int
    model: str
    rank: int
    alpha: float
    num_examples: int
    state: dict[str, np.ndarray]


@dataclass
class GroupResult:
    """What :func:`aggregate_group` returns for one base-model group.

    Attributes:
        per_client: partition_id -> the state to send that client (at the client's own rank).
        global_state: the state at the group's largest rank (what the server saves).
        global_rank: rank of ``global_state``.
        global_alpha: alpha of ``global_state``.
        info: ``{"method": "fedavg" | "flexlora", "robust": rule, "trimmed_per_end": k,
            ...}``; FlexLoRA adds ``"truncation_error": {rank: mean relative Frobenius
            error}``, a clipped aggregate ``"clipped": {rank: norm before}``.
    """

    per_client: dict[int, dict[str, np.ndarray]]
    global_state: dict[str, np.ndarray]
    global_rank: int
    global_alpha: float
    info: dict = field(default_factory=dict)


def split_key(key: str) -> tuple[str, str]:
    """``"m.q_proj.lora_A.weight"`` -> ``("m.q_proj", "lora_A")``.

    Raises:
        MalformedUpdateError: the key ends in neither ``.lora_A.weight`` nor ``.lora_B.weight``.
    """
    for suffix, part in ((A_SUFFIX, "lora_A"), (B_SUFFIX, "lora_B")):
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], part
    raise MalformedUpdateError(f"unexpected key {key!r}: not a lora_A/lora_B weight")


def module_shapes(state: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """Per-module ``(out_features, in_features)`` from the A/B pairs, independent of the rank.

    ``in`` comes from ``lora_A`` ``[r, in]`` and ``out`` from ``lora_B`` ``[out, r]``; this is
    what ``validate_update``'s ``reference_shapes`` expects.

    Raises:
        MalformedUpdateError: a key that is not a LoRA weight, a non-2-D array, or a module
            with ``lora_A`` but no ``lora_B`` (or the reverse).
    """
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, value in state.items():
        module, part = split_key(key)
        shape = np.shape(value)
        if len(shape) != 2:
            raise MalformedUpdateError(f"{key} must be 2-D, got shape {shape}")
        parts.setdefault(module, {})[part] = shape
    out = {}
    for module, p in sorted(parts.items()):
        if "lora_B" not in p:
            raise MalformedUpdateError(f"module {module} has lora_A but no lora_B")
        if "lora_A" not in p:
            raise MalformedUpdateError(f"module {module} has lora_B but no lora_A")
        out[module] = (p["lora_B"][0], p["lora_A"][1])
    return out


def update_norm(state: dict[str, np.ndarray], rank: int, alpha: float) -> float:
    """Frobenius norm of the adapter's whole update, all modules together::

        sqrt(Σ_m ||s · B_m A_m||²_F),   s = alpha / rank

    computed without forming ``B A``: ``||B A||²_F = Σ (BᵀB) ⊙ (A Aᵀ)`` (two ``r × r``
    matrices, float64), so it is cheap even for large modules.

    Raises:
        MalformedUpdateError: a key that is not a LoRA A/B weight, or a module with only
            one of A and B.
    """
    return cross_norm(state, state, rank, alpha)


def cross_norm(b_state: dict[str, np.ndarray], a_state: dict[str, np.ndarray], rank: int,
               alpha: float) -> float:
    """Frobenius norm of the update built from one adapter's ``B`` and another's ``A``::

        sqrt(Σ_m ||s · B_m^(b_state) A_m^(a_state)||²_F),   s = alpha / rank

    the quantity FedAvg of ``A`` and ``B`` separately mixes: the aggregate is
    ``s · avg(B) · avg(A)``, so a client's ``B`` meets the others' ``A``. Both states must
    have the same modules and rank.

    Raises:
        MalformedUpdateError: the module sets differ or a shape does not match.
    """
    modules = sorted(module_shapes(a_state))
    if sorted(module_shapes(b_state)) != modules:
        raise MalformedUpdateError("cross norm of adapters with different module sets")
    total = 0.0
    for module in modules:
        a = np.asarray(a_state[module + A_SUFFIX], dtype=np.float64)
        b = np.asarray(b_state[module + B_SUFFIX], dtype=np.float64)
        if a.shape[0] != b.shape[1]:
            raise MalformedUpdateError(f"{module}: rank {b.shape[1]} of B and {a.shape[0]} of A differ")
        total += float(np.sum((b.T @ b) * (a @ a.T)))
    return float(alpha) / float(rank) * math.sqrt(max(total, 0.0))


def validate_update(
    update: ClientUpdate,
    expected_model: str,
    reference_shapes: dict[str, tuple[int, int]] | None,
    max_norm: float | None = None,
    reference: dict[str, np.ndarray] | None = None,
) -> None:
    """Check one client update before it is aggregated (the server), or one adapter from the
    server before it is applied (the client, :func:`edgefuse.lora.check_received_adapter`).

    Args:
        update: the received update.
        expected_model: the base-model group this update is aggregated into.
        reference_shapes: module name -> ``(out_features, in_features)`` as returned by
            :func:`module_shapes` on the group's reference state; ``None`` skips that check.
        max_norm: bound on :func:`update_norm` (``privacy.max_update_norm``); ``None`` = no
            bound. A malicious client cannot swamp the aggregate with one huge update.
        reference: the adapter the server sent this client for the round (same rank and
            alpha), or ``None`` (round 1: the client started from its seeded init). With
            ``max_norm``, the client's factors are also bounded against it:
            :func:`cross_norm` of (its ``B``, the reference ``A``) and of (the reference
            ``B``, its ``A``) must be <= ``max_norm``, so ``A = 0`` with a huge ``B`` (norm
            0 on its own, huge once averaged with honest ``A``) is refused.

    Raises:
        MalformedUpdateError: wrong model group, ``num_examples <= 0``, rank or alpha not
            positive, empty state, a non-float or non-2-D array, NaN or Inf, ``lora_A.shape[0]``
            or ``lora_B.shape[1]`` different from ``rank``, a module with A but no B, a
            module set / module shape that differs from ``reference_shapes``, or an update
            norm (or a cross norm with ``reference``) above ``max_norm``.
    """
    pid = update.partition_id
    if update.model != expected_model:
        raise MalformedUpdateError(
            f"client {pid}: model group {update.model!r}, expected {expected_model!r}")
    if not update.num_examples > 0:
        raise MalformedUpdateError(
            f"client {pid}: num_examples must be > 0, got {update.num_examples}")
    if not update.rank > 0 or not update.alpha > 0:
        raise MalformedUpdateError(
            f"client {pid}: rank and alpha must be > 0, "
            f"got rank={update.rank} alpha={update.alpha}")
    if not update.state:
        raise MalformedUpdateError(f"client {pid}: empty adapter state")
    for key, value in update.state.items():
        _, part = split_key(key)
        if not isinstance(value, np.ndarray) or not np.issubdtype(value.dtype, np.floating):
            raise MalformedUpdateError(f"client {pid}: {key} is not a float array")
        if value.ndim != 2:
            raise MalformedUpdateError(f"client {pid}: {key} must be 2-D, got shape {value.shape}")
        if not np.isfinite(value).all():
            what = "NaN" if np.isnan(value).any() else "Inf"
            raise MalformedUpdateError(f"client {pid}: {key} contains {what}")
        r = value.shape[0] if part == "lora_A" else value.shape[1]
        if r != update.rank:
            raise MalformedUpdateError(
                f"client {pid}: {key} has shape {value.shape}, "
                f"which does not match rank {update.rank}")
    shapes = module_shapes(update.state)
    if max_norm is not None:
        norm = update_norm(update.state, update.rank, update.alpha)
        if not norm <= float(max_norm):
            raise MalformedUpdateError(
                f"client {pid}: update norm ||ΔW||_F = {norm:.4g} exceeds the bound "
                f"privacy.max_update_norm = {float(max_norm):g}")
        if reference is not None:
            for what, b, a in (("its B with the round's A", update.state, reference),
                               ("the round's B with its A", reference, update.state)):
                cross = cross_norm(b, a, update.rank, update.alpha)
                if not cross <= float(max_norm):
                    raise MalformedUpdateError(
                        f"client {pid}: the update's factors are out of scale: {what} gives "
                        f"||ΔW||_F = {cross:.4g} > privacy.max_update_norm = {float(max_norm):g}")
    if reference_shapes is None:
        return
    missing = sorted(set(reference_shapes) - set(shapes))
    extra = sorted(set(shapes) - set(reference_shapes))
    if missing or extra:
        raise MalformedUpdateError(
            f"client {pid}: module set differs from the reference: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for module, shape in shapes.items():
        if tuple(reference_shapes[module]) != shape:
            raise MalformedUpdateError(
                f"client {pid}: module {module} is (out, in) = {shape}, "
                f"reference {tuple(reference_shapes[module])}")


def fedavg(states: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """Weighted average of each tensor (FedAvg, McMahan et al., 2017).

    Args:
        states: key -> array dicts with identical keys and shapes.
        weights: one non-negative weight per state (e.g. example counts); normalized to sum 1.

    Returns:
        key -> float32 array of the same shape.

    Raises:
        ValueError: no states, a weight count that differs from the state count, negative or
            all-zero weights, or keys/shapes that differ between states.
    """
    if not states or len(states) != len(weights):
        raise ValueError(
            f"need one weight per state, got {len(states)} states, {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {list(weights)}")
    w = w / w.sum()
    keys = set(states[0])
    out = {}
    for key in sorted(keys):
        shape = np.shape(states[0][key])
        acc = np.zeros(shape, dtype=np.float64)
        for i, (wi, s) in enumerate(zip(w, states)):
            if set(s) != keys:
                raise ValueError(f"state {i} has different keys from state 0")
            if np.shape(s[key]) != shape:
                raise ValueError(
                    f"{key}: shape {np.shape(s[key])} in state {i}, {shape} in state 0")
            acc += wi * s[key]
        out[key] = acc.astype(np.float32)
    return out


def trim_count(n: int, fraction: float) -> int:
    """How many values the trimmed mean cuts from EACH end of ``n``: ``floor(fraction · n)``.

    A product just below an integer from float rounding (``0.29 · 100``) counts as that
    integer. 0 (e.g. ``n < 4`` at ``fraction = 0.25``) means nothing is cut: the trimmed
    mean is then the plain unweighted mean, with no protection at all.

    Raises:
        ValueError: ``n < 1``, or ``fraction`` outside ``[0, 0.5)`` (at 0.5 nothing would be
            left).
    """
    if not (isinstance(fraction, (int, float)) and 0.0 <= fraction < 0.5):
        raise ValueError(f"trim fraction must be in [0, 0.5), got {fraction!r}")
    if n < 1:
        raise ValueError(f"need at least one value to trim, got n={n}")
    return int(math.floor(fraction * n + 1e-9))


def coordinate_trimmed_mean(x: np.ndarray, k: int) -> np.ndarray:
    """Coordinate-wise ``k``-trimmed mean over axis 0 (Yin et al., 2018, Definition 2).

    Per coordinate, the ``n`` client values are sorted, the ``k`` smallest and the ``k``
    largest dropped, and the remaining ``n - 2k`` averaged (unweighted). Up to ``k``
    malicious clients cannot move a coordinate outside the honest clients' range there.

    Args:
        x: ``[n, *shape]``, one slice per client.
        k: values cut from each end, ``0 <= 2k < n`` (``k = 0``: the plain mean).

    Returns:
        ``[*shape]`` float64.

    Raises:
        ValueError: ``k < 0`` or ``2k >= n``.
    """
    n = x.shape[0]
    if k < 0 or 2 * k >= n:
        raise ValueError(f"cannot cut {k} from each end of {n} values")
    srt = np.sort(np.asarray(x, dtype=np.float64), axis=0)
    return srt[k:n - k].mean(axis=0)


def coordinate_median(x: np.ndarray) -> np.ndarray:
    """Coordinate-wise median over axis 0 (Yin et al., 2018, Definition 1); for an even
    ``n``, the mean of the two middle values (``numpy.median``). Tolerates up to
    ``ceil(n / 2) - 1`` malicious clients per coordinate; for ``n = 4`` it equals the
    trimmed mean with ``k = 1``, for ``n <= 2`` the plain mean.

    Args:
        x: ``[n, *shape]``, one slice per client (``n >= 1``).

    Returns:
        ``[*shape]`` float64.
    """
    return np.median(np.asarray(x, dtype=np.float64), axis=0)


def robust_combine(x: np.ndarray, rule: str, trim_fraction: float = 0.25) -> tuple[np.ndarray, int]:
    """``x`` ``[n, *shape]`` -> ``([*shape] float64, values cut from each end)`` with ``rule``
    ``"trimmed_mean"`` (``k = trim_count(n, trim_fraction)``) or ``"median"``
    (``(n - 1) // 2`` cut from each end, as a median does).

    Raises:
        ValueError: an unknown ``rule`` (``"none"`` included: that is the weighted mean,
            :func:`fedavg`), or a ``trim_fraction`` :func:`trim_count` refuses.
    """
    n = x.shape[0]
    if rule == "trimmed_mean":
        k = trim_count(n, trim_fraction)
        return coordinate_trimmed_mean(x, k), k
    if rule == "median":
        return coordinate_median(x), (n - 1) // 2
    raise ValueError(f"unknown robust rule {rule!r}; valid: trimmed_mean, median")


def robust_states(states: list[dict[str, np.ndarray]], rule: str,
                  trim_fraction: float = 0.25) -> tuple[dict[str, np.ndarray], int]:
    """Coordinate-wise trimmed mean or median of each tensor over the clients
    (:func:`robust_combine`), the robust replacement of :func:`fedavg`. Unweighted: example
    counts are the clients' own claims, and a weighted median would let one client's claimed
    weight decide each coordinate; honest clients all train ``steps_per_round × batch_size``
    rows (the server's cap), so their weights are equal anyway.

    Args:
        states: key -> array dicts with identical keys and shapes (``n >= 1`` of them).

    Returns:
        ``(key -> float32 array, values cut from each end per coordinate)``.

    Raises:
        ValueError: no states, keys/shapes that differ between states, or as
            :func:`robust_combine`.
    """
    if not states:
        raise ValueError("robust aggregation needs at least one state")
    keys = set(states[0])
    out, k = {}, 0
    for key in sorted(keys):
        shape = np.shape(states[0][key])
        for i, s in enumerate(states):
            if set(s) != keys:
                raise ValueError(f"state {i} has different keys from state 0")
            if np.shape(s[key]) != shape:
                raise ValueError(f"{key}: shape {np.shape(s[key])} in state {i}, {shape} in state 0")
        value, k = robust_combine(np.stack([s[key] for s in states]), rule, trim_fraction)
        out[key] = value.astype(np.float32)
    return out, k


def _refactor(u_full: torch.Tensor, sigma: torch.Tensor, vh_full: torch.Tensor, tol: float,
              module: str, target_ranks: list[int], target_alphas: list[float],
              states: list[dict[str, np.ndarray]], errors: np.ndarray) -> None:
    """Write the rank-``r`` factors of ``ΔW = U diag(σ) Vh`` (``u_full`` ``[out, k]``,
    ``vh_full`` ``[k, in]``, ``σ`` descending) into ``states[t]`` for each target, and the
    relative truncation errors into ``errors[t]`` (see :func:`flexlora`)."""
    live = sigma > tol
    energy = (sigma.double() ** 2).flip(0).cumsum(0).flip(0)  # energy[i] = Σ_{j>=i} σ_j²
    total = float(energy[0]) if len(energy) else 0.0
    for t, (r, alpha) in enumerate(zip(target_ranks, target_alphas)):
        if r > len(sigma):
            raise ValueError(f"{module}: target rank {r} exceeds the {len(sigma)} "
                             f"available (min of out, in and the sum of client ranks)")
        root = torch.where(live[:r], sigma[:r].sqrt(), 0.0) / math.sqrt(alpha / r)
        b = u_full[:, :r] * root
        a = torch.where(live[:r, None], root[:, None] * vh_full[:r], vh_full[:r])
        states[t][module + A_SUFFIX] = a.contiguous().numpy()
        states[t][module + B_SUFFIX] = b.contiguous().numpy()
        tail = float(energy[r]) if r < len(energy) else 0.0
        errors[t] = math.sqrt(max(tail, 0.0) / total) if total > 0 else 0.0


def _check_same_modules(updates: list[ClientUpdate]) -> list[str]:
    modules = sorted(module_shapes(updates[0].state))
    for u in updates[1:]:
        if sorted(module_shapes(u.state)) != modules:
            raise ValueError(f"client {u.partition_id}: module set differs from client "
                             f"{updates[0].partition_id}")
    return modules


def robust_flexlora(
    updates: list[ClientUpdate],
    target_ranks: list[int],
    target_alphas: list[float],
    rule: str,
    trim_fraction: float = 0.25,
) -> tuple[list[dict[str, np.ndarray]], dict]:
    """FlexLoRA with a robust combination of the clients' products: per module, the
    coordinate-wise trimmed mean or median (:func:`robust_combine`, unweighted) of
    ``ΔW_k = s_k B_k A_k`` ``[out, in]``, then the best rank-``r`` factors of that ``ΔW``
    for each target, as :func:`flexlora` gives them.

    Why the products and not the factors: clients of different ranks have factors of
    different shapes, and even at one rank ``(B G)(G⁻¹ A)`` is the same update for any
    invertible ``G``, so a coordinate of ``A`` or ``B`` means nothing across clients; a
    coordinate of ``ΔW`` is one weight of the model, the same for everyone. The robust ``ΔW``
    is in general of full rank (a median is not linear), so its truncation error is larger
    than plain FlexLoRA's (reported the same way). Each client's ``ΔW_k`` is formed one module
    at a time (``n × out × in`` floats at once) and the SVD is of ``[out, in]``.

    Returns:
        ``(states, info)`` as :func:`flexlora`, with ``info["trimmed_per_end"]``.

    Raises:
        ValueError: as :func:`flexlora` and :func:`robust_combine`.
    """
    if not updates:
        raise ValueError("robust_flexlora needs at least one update")
    if len(target_ranks) != len(target_alphas) or not target_ranks:
        raise ValueError("target_ranks and target_alphas must be non-empty and the same length")
    modules = _check_same_modules(updates)
    states: list[dict[str, np.ndarray]] = [{} for _ in target_ranks]
    errors = np.zeros((len(modules), len(target_ranks)))
    k = 0
    for m, module in enumerate(modules):
        try:
            dws = np.stack([float(u.alpha / u.rank)
                            * (np.asarray(u.state[module + B_SUFFIX], dtype=np.float32)
                               @ np.asarray(u.state[module + A_SUFFIX], dtype=np.float32))
                            for u in updates])  # [n, out, in]
        except ValueError as e:
            raise ValueError(f"{module}: shapes differ between clients ({e})") from None
        dw, k = robust_combine(dws, rule, trim_fraction)
        dw_t = torch.from_numpy(dw.astype(np.float32))
        u_full, sigma, vh_full = torch.linalg.svd(dw_t, full_matrices=False)
        tol = float(sigma.max()) * max(dw_t.shape) * float(np.finfo(np.float32).eps) if len(sigma) else 0.0
        _refactor(u_full, sigma, vh_full, tol, module, target_ranks, target_alphas, states, errors[m])
    info = {"method": "flexlora", "trimmed_per_end": k,
            "truncation_error": {int(r): float(e) for r, e in zip(target_ranks, errors.mean(0))}}
    return states, info


def flexlora(
    updates: list[ClientUpdate],
    target_ranks: list[int],
    target_alphas: list[float],
) -> tuple[list[dict[str, np.ndarray]], dict]:
    """FlexLoRA aggregation (Bai et al., 2024) to several target ranks.

    Per module: ``ΔW = Σ_k w_k s_k B_k A_k`` with ``w_k ∝ num_examples`` and
    ``s_k = alpha_k / r_k``; SVD ``ΔW = U Σ Vᵀ``; for target rank ``r`` with scaling
    ``s = alpha / r``: ``B = U_r Σ_r^½ / √s`` ``[out, r]``,
    ``A = Σ_r^½ V_rᵀ / √s`` ``[r, in]``,
    so ``s B A`` is the best rank-``r`` approximation of ``ΔW`` (Eckart-Young).

    ``ΔW`` is never formed: with ``B_cat = [w_k s_k B_k]`` ``[out, R]`` and ``A_cat = [A_k]``
    ``[R, in]`` (``R = Σ r_k``), thin QRs ``B_cat = Q_B R_B`` and ``A_catᵀ = Q_A R_A`` reduce
    the SVD to the small matrix ``R_B R_Aᵀ`` (float32 ``torch.linalg.svd``), the same singular
    values and vectors at a fraction of the cost of an ``[out, in]`` SVD.

    Directions with a (numerically) zero singular value get ``A`` row ``= v_iᵀ`` and ``B``
    column ``= 0`` instead of two zero vectors, so they stay trainable (peft's own init is
    ``B = 0``) and ``s B A`` is unchanged.

    Args:
        updates: validated updates of one group, same module set.
        target_ranks: ranks to produce, each at most ``min(out, in, Σ r_k)`` of every module.
        target_alphas: alpha for each target rank (same length).

    Returns:
        ``(states, info)``: one state per target rank (same order), and
        ``info = {"method": "flexlora", "truncation_error": {rank: e}}`` where ``e`` is
        ``‖ΔW - ΔW_r‖_F / ‖ΔW‖_F`` averaged over modules (0 for a zero ``ΔW``).

    Raises:
        ValueError: no updates, mismatched list lengths, differing module sets or shapes,
            or a target rank larger than a module allows.
    """
    if not updates:
        raise ValueError("flexlora needs at least one update")
    if len(target_ranks) != len(target_alphas) or not target_ranks:
        raise ValueError("target_ranks and target_alphas must be non-empty and the same length")
    n = np.array([u.num_examples for u in updates], dtype=np.float64)
    w = n / n.sum()
    modules = _check_same_modules(updates)
    states: list[dict[str, np.ndarray]] = [{} for _ in target_ranks]
    errors = np.zeros((len(modules), len(target_ranks)))
    for m, module in enumerate(modules):
        bs = [torch.from_numpy(np.asarray(u.state[module + B_SUFFIX], dtype=np.float32))
              * float(wk * u.alpha / u.rank) for u, wk in zip(updates, w)]
        a_s = [torch.from_numpy(np.asarray(u.state[module + A_SUFFIX], dtype=np.float32))
               for u in updates]
        try:
            b_cat, a_cat = torch.cat(bs, dim=1), torch.cat(a_s, dim=0)  # [out, R], [R, in]
        except RuntimeError as e:
            raise ValueError(f"{module}: shapes differ between clients ({e})") from None
        q_b, r_b = torch.linalg.qr(b_cat)  # ΔW = Q_B (R_B R_Aᵀ) Q_Aᵀ
        q_a, r_a = torch.linalg.qr(a_cat.T)
        u_small, sigma, vh_small = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)
        u_full, vh_full = q_b @ u_small, vh_small @ q_a.T  # [out, k], [k, in]
        # Singular values below float32 noise count as zero (numpy matrix_rank's tolerance).
        tol = float(sigma.max()) * max(r_b.shape + r_a.shape) * float(np.finfo(np.float32).eps)
        _refactor(u_full, sigma, vh_full, tol, module, target_ranks, target_alphas, states, errors[m])
    info = {"method": "flexlora",
            "truncation_error": {int(r): float(e) for r, e in zip(target_ranks, errors.mean(0))}}
    return states, info


def clip_state(state: dict[str, np.ndarray], rank: int, alpha: float,
               max_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """``state`` with every ``B`` scaled so that :func:`update_norm` is at most ``max_norm``
    (server-side norm clipping of the aggregate; ``A`` is kept, so it stays trainable).

    Returns:
        ``(state, norm before)``: the same dict when it was within the bound, else a new one.
    """
    norm = update_norm(state, rank, alpha)
    if norm <= max_norm:
        return state, norm
    factor = float(max_norm) / norm
    return ({k: (v * factor).astype(np.float32) if k.endswith(B_SUFFIX) else v
             for k, v in state.items()}, norm)


def aggregate_group(updates: list[ClientUpdate], method: str = "flexlora",
                    max_norm: float | None = None, equal_rank: str = "fedavg",
                    robust: str = "none", trim_fraction: float = 0.25) -> GroupResult:
    """Aggregate the validated updates of one base-model group.

    Equal ranks and alphas with ``equal_rank="fedavg"``: FedAvg of ``A`` and ``B``
    separately, weighted by ``num_examples`` (as FlowerTune does); every client gets that
    state. Different ranks or alphas, or ``equal_rank="flexlora"``: ``method``
    (``"flexlora"``, see :func:`flexlora`: the example-weighted mean of the clients' ``ΔW``,
    truncated to each rank); each client gets the state at its own rank and alpha, and the
    global state is at the largest ``(rank, alpha)``.

    ``robust`` replaces the mean of what is averaged (Yin et al., 2018): ``"trimmed_mean"``
    (``floor(trim_fraction · n)`` values cut from each end of every coordinate; when that is
    0, the unweighted mean, which protects nothing) or ``"median"`` (coordinate-wise). For
    FedAvg it is applied to ``A`` and ``B`` separately (:func:`robust_states`: the clients
    start the round from the same adapter, so their factor coordinates line up); for FlexLoRA
    to the products ``ΔW_k`` (:func:`robust_flexlora`). Robust rules are unweighted (see
    :func:`robust_states`). ``info["robust"]`` names the rule and ``info["trimmed_per_end"]``
    how many values per coordinate were cut from each end (``"none"``: 0).

    FlexLoRA averages what the update-norm bound bounds (``ΔW``, a convex combination, so
    its norm is at most the largest client's); FedAvg of factors does not (``A = 0`` with a
    huge ``B`` has ``ΔW = 0`` yet meets the others' ``A`` in the average), nor does a median.
    With ``max_norm`` the bound also holds for what comes out: an aggregated state whose
    :func:`update_norm` exceeds it is clipped to it (:func:`clip_state`), and
    ``info["clipped"]`` maps each clipped rank to its norm before clipping.

    Raises:
        ValueError: no updates, updates from different model groups, repeated partition ids,
            an unknown ``method`` / ``equal_rank`` / ``robust`` (the message lists the valid
            ones), or a ``trim_fraction`` outside ``[0, 0.5)``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown aggregation method {method!r}; valid: {', '.join(METHODS)}")
    if equal_rank not in EQUAL_RANK:
        raise ValueError(f"unknown equal-rank aggregation {equal_rank!r}; valid: {', '.join(EQUAL_RANK)}")
    if robust not in ROBUST:
        raise ValueError(f"unknown robust aggregation {robust!r}; valid: {', '.join(ROBUST)}")
    trim_count(1, trim_fraction)  # range check, whatever the rule
    if not updates:
        raise ValueError("aggregate_group needs at least one update")
    if len({u.model for u in updates}) > 1:
        raise ValueError(f"updates from several model groups: {sorted({u.model for u in updates})}")
    pids = [u.partition_id for u in updates]
    if len(set(pids)) != len(pids):
        raise ValueError(f"repeated partition ids: {pids}")
    configs = sorted({(u.rank, float(u.alpha)) for u in updates})
    global_rank, global_alpha = configs[-1]
    if len(configs) == 1 and equal_rank == "fedavg":
        if robust == "none":
            state, k = fedavg([u.state for u in updates], [u.num_examples for u in updates]), 0
        else:
            state, k = robust_states([u.state for u in updates], robust, trim_fraction)
        info: dict = {"method": "fedavg", "robust": robust, "trimmed_per_end": k}
        if max_norm is not None:
            state, norm = clip_state(state, global_rank, global_alpha, float(max_norm))
            if norm > max_norm:
                info["clipped"] = {int(global_rank): norm}
        # One shared dict for every client; callers must not mutate it.
        return GroupResult(per_client={p: state for p in pids}, global_state=state,
                           global_rank=global_rank, global_alpha=global_alpha, info=info)
    ranks, alphas = [r for r, _ in configs], [a for _, a in configs]
    if robust == "none":
        states, info = flexlora(updates, ranks, alphas)
        info["trimmed_per_end"] = 0
    else:
        states, info = robust_flexlora(updates, ranks, alphas, robust, trim_fraction)
    info["robust"] = robust
    if max_norm is not None:  # a convex mean of ΔW needs this only for rounding; a median more
        for i, (r, a) in enumerate(configs):
            states[i], norm = clip_state(states[i], r, a, float(max_norm))
            if norm > max_norm:
                info.setdefault("clipped", {})[int(r)] = norm
    by_config = dict(zip(configs, states))
    return GroupResult(
        per_client={u.partition_id: by_config[(u.rank, float(u.alpha))] for u in updates},
        global_state=states[-1], global_rank=global_rank, global_alpha=global_alpha, info=info)
