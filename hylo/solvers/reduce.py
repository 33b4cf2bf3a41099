"""Local reductions of a rank's n rows to r kept rows: KIS sampling and the KID skeleton (docs/solvers.md, "KID", "KIS").

They run on every rank before the all-gather, see only the n row norms or r columns of the
n×n kernel (never the whole kernel, never a d×d matrix), and need no host synchronisation at a
fixed rank. Under ``rank_ratio="auto"`` (docs/solvers.md, "Adaptive rank") the rank is read on the
host once per layer: :func:`dropped_mass` is the target, KID's pivoted Cholesky stops at it and
KIS reads it off :func:`sketched_rank`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hylo.layers.rows import SampleRows


def priority_sample(weights: Tensor, r: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """KIS: r of n rows by priority sampling, and the Horvitz–Thompson factor of each kept row.

    Row i gets priority w_i / u_i (u_i uniform on (0, 1]); the r highest are kept and τ is
    the (r+1)-th priority. A kept row's factor is max(1, τ / w_i), so Σ_kept factor_i X_i is an
    unbiased estimate of Σ_i X_i for any per-row quantities X_i that vanish where w_i = 0
    (Duffield, Lund & Thorup's priority sampling). With w_i = ‖U_i‖² every row heavier than τ
    is kept with factor 1, and with r = n every factor is 1 (the estimate is exact).
    """
    n = weights.shape[0]
    w = weights.to(torch.float64)
    if r >= n:
        return torch.arange(n, device=w.device), torch.ones_like(w)
    u = 1.0 - torch.rand(n, generator=generator, dtype=torch.float64).to(w.device)
    top = torch.topk(w / u, r + 1)
    keep, threshold = top.indices[:r], top.values[r]
    kept_w = w.index_select(0, keep)
    factors = torch.where(kept_w > 0, (threshold / kept_w.clamp_min(torch.finfo(w.dtype).tiny)).clamp_min(1.0), 1.0)
    return keep, factors


def kis_select(weights: Tensor, r: int, generator: torch.Generator) -> Tensor:
    """HyLo's KIS: indices of r rows drawn without replacement with probability ∝ ``weights``.

    Uses the exponential-race form of sequential weighted sampling (Efraimidis–Spirakis:
    keep the r largest log(u_i)/p_i), which has the same distribution as drawing one row
    at a time ∝ p among those left. Rows with p_i = 0 are taken last, uniformly among
    themselves (the rows are visited in a random order, so ties break at random).
    """
    n = weights.shape[0]
    order = torch.randperm(n, generator=generator).to(weights.device)
    u = torch.rand(n, generator=generator, dtype=torch.float64).to(weights.device)
    w = weights.to(torch.float64)[order]
    keys = torch.where(w > 0, torch.log(u) / w, torch.full_like(u, -torch.inf))
    return order[torch.topk(keys, r).indices]


def dropped_mass(rows: SampleRows, damping: float, energy: float) -> float:
    """The kernel mass a rank may leave out at energy target e: (1 − e)·nλ, in units of K = U Uᵀ (docs/solvers.md,
    "Adaptive rank").

    The rows left out then carry at most (1 − e)·λ of the trace of the rank's Fisher estimate UᵀU/n: the damped kernel
    K/n + λI keeps all of its spectrum but (1 − e) of one damping floor λ. At e = 1 it is 0: nothing is left out, and
    the reductions keep their cap.
    """
    return (1.0 - energy) * rows.count * damping


def sketched_rank(rows: SampleRows, weights: Tensor, cap: int, allowed: float, generator: torch.Generator) -> int:
    """KIS's rank under ``rank_ratio="auto"``: the fewest rows r ≤ ``cap`` (< n) whose share of the kernel's trace,
    read off the spectrum of a sketch, leaves less than ``allowed`` (:func:`dropped_mass`) of it out.

    The sketch is KIS's own draw at the cap: ``cap`` rows by :func:`priority_sample` (heavy rows always in), each
    scaled by the square root of its Horvitz–Thompson factor, so Σ_S c_i U_iᵀU_i estimates UᵀU without bias; its
    kernel (cap² row products) has that estimate's nonzero eigenvalues (one cap×cap symmetric eigendecomposition,
    float64). The mass left after r rows is tr K (exact, from the row norms) times the share of the eigenvalues past
    the r-th. Data of rank k ≤ ``cap`` gives k when the sketch spans the k directions. ``weights`` are the row norms
    ‖U_i‖² (the sample's own); drawn from ``generator`` before the sample itself.
    """
    keep, factors = priority_sample(weights, cap, generator)
    sketch = rows.select(keep).scaled(factors.sqrt().to(rows.dtype)).to(torch.float64)
    spectrum = torch.linalg.eigvalsh(sketch.kernel()).flip(0).clamp_min(0.0)
    share = spectrum.cumsum(0) / spectrum.sum().clamp_min(torch.finfo(torch.float64).tiny)
    left = weights.to(torch.float64).sum() * (1.0 - share)
    return min(cap, int((left >= allowed).sum()) + 1)


#: Pivot columns the CPU path of :func:`pivoted_cholesky` computes ahead in one product (docs/solvers.md, "KID").
LOOKAHEAD = 16


def pivoted_cholesky(
    rows: SampleRows,
    r: int,
    rel_tol: float | None = None,
    lookahead: bool | None = None,
    stop_below: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy pivoted Cholesky of the rows' kernel K (n×n): largest residual diagonal first.

    Only K's diagonal (the row norms) and its pivot columns are formed, in float64: about
    n·r·(d_a + d_g) multiply-adds and n·r numbers instead of the n²·(d_a + d_g) and n² of the
    whole kernel (docs/solvers.md, "KID").

    Returns (pivots J (r,), factor L (n×r) with K ≈ L Lᵀ, alive (r,) bool). A pivot whose
    residual is below ``rel_tol``·max(diag K) adds nothing (the rows already span it): its
    column of L is zero and ``alive`` is False. The default tolerance, 10·n·eps of float64
    (at least 1e-12), sits at the float64 kernel's round-off. Deterministic. On the CPU
    (:func:`_greedy_with_lookahead`) the residual columns of the :data:`LOOKAHEAD` largest
    residuals are computed together (one matrix product) and kept up to date, and a pivot outside
    them fetches the next ones: the same greedy pivots, 3.6× faster on 2,048 rows (host reads
    per pivot, free on the CPU); on other devices one column per pivot, with no host
    synchronisation (``lookahead`` None; True or False forces either path).

    ``stop_below`` (``rank_ratio="auto"``): stop after the first k ≤ r pivots whose residual kernel's trace,
    tr K − Σ_j ‖L_j‖² (the residual diagonal's sum), is below it; the k pivots and columns are those of the run to
    r (the CPU path stops there; the other path runs to r and keeps the first k, one host read).
    """
    rows = rows.to(torch.float64)
    residual = rows.sq_norms()
    n = residual.shape[0]
    if rel_tol is None:
        rel_tol = max(1e-12, 10.0 * n * torch.finfo(torch.float64).eps)
    threshold = rel_tol * residual.max().clamp_min(torch.finfo(torch.float64).tiny)
    if lookahead is None:
        lookahead = residual.device.type == "cpu"
    if lookahead:
        return _greedy_with_lookahead(rows, residual, r, float(threshold), stop_below)
    trace = residual.sum()
    factor = residual.new_zeros(n, r)
    pivots = torch.empty(r, dtype=torch.long, device=residual.device)
    alive = torch.empty(r, dtype=torch.bool, device=residual.device)
    taken = torch.zeros(n, dtype=torch.bool, device=residual.device)
    for k in range(r):
        j = torch.argmax(torch.where(taken, -torch.inf, residual)).reshape(1)
        pivot_residual = residual.index_select(0, j)
        ok = pivot_residual > threshold
        column = _residual_columns(rows, factor, j, k).squeeze(1)
        column = torch.where(ok, column / pivot_residual.clamp_min(threshold).sqrt(), torch.zeros_like(column))
        factor[:, k] = column
        residual = residual - column.square()
        taken = taken.index_fill(0, j, True)
        pivots[k] = j[0]
        alive[k] = ok[0]
    if stop_below is not None:  # the residual trace after each pivot, tr K − Σ_j ‖L_j‖², from the factor itself
        k = min(r, int(((trace - factor.square().sum(0).cumsum(0)) >= stop_below).sum()) + 1)
        pivots, factor, alive = pivots[:k], factor[:, :k], alive[:k]
    return pivots, factor, alive


def _residual_columns(rows: SampleRows, factor: Tensor, index: Tensor, k: int) -> Tensor:
    """Columns ``index`` of the residual kernel K − L Lᵀ after the first ``k`` pivots (n × |index|)."""
    return rows.kernel_columns(index) - factor[:, :k] @ factor.index_select(0, index)[:, :k].mT


def _greedy_with_lookahead(
    rows: SampleRows, residual: Tensor, r: int, threshold: float, stop_below: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`pivoted_cholesky`'s greedy loop with host scalars and the residual columns of :data:`LOOKAHEAD`
    candidates (the largest residuals) computed in one product and downdated as pivots are taken; a pivot outside
    them fetches the next candidates (one column alone where non-finite residuals make ``topk`` and ``argmax``
    disagree). Stops early once the residual trace is below ``stop_below``."""
    n = residual.shape[0]
    left = float(residual.sum()) if stop_below is not None else 0.0
    factor = residual.new_zeros(n, r)
    pivots, alive = [0] * r, [False] * r
    taken = torch.zeros(n, dtype=torch.bool, device=residual.device)
    work = residual.clone()  # the residual diagonal, taken rows at −inf
    slot: dict[int, int] = {}
    candidates = torch.empty(0, dtype=torch.long, device=residual.device)
    columns = factor[:, :0]
    for k in range(r):
        j = int(torch.argmax(work))
        if j not in slot:
            width = max(1, min(LOOKAHEAD, int(torch.isfinite(work).sum())))
            candidates = torch.topk(work, width).indices
            columns = _residual_columns(rows, factor, candidates, k)
            slot = {int(c): i for i, c in enumerate(candidates.tolist())}
        if j in slot:
            column = columns[:, slot[j]]
        else:
            column = _residual_columns(rows, factor, torch.tensor([j], device=residual.device), k).squeeze(1)
        pivot_residual = float(work[j])
        pivots[k], alive[k] = j, pivot_residual > threshold
        if alive[k]:
            torch.div(column, max(pivot_residual, threshold) ** 0.5, out=factor[:, k])
            column = factor[:, k]
            columns.addmm_(column.unsqueeze(1), column.index_select(0, candidates).unsqueeze(0), alpha=-1.0)
            work.addcmul_(column, column, value=-1.0)
            if stop_below is not None:
                left -= float(column.square().sum())
        taken[j] = True
        work.masked_fill_(taken, -torch.inf)
        if stop_below is not None and left < stop_below:
            pivots, alive, factor = pivots[: k + 1], alive[: k + 1], factor[:, : k + 1]
            break
    device = residual.device
    return torch.tensor(pivots, device=device), factor, torch.tensor(alive, dtype=torch.bool, device=device)


def kid_skeleton(rows: SampleRows, r: int, stop_below: float | None = None) -> tuple[Tensor, Tensor]:
    """KID on one rank: skeleton row indices J (r,) and interpolation weights W_p = Π Πᵀ (r×r); with
    ``stop_below`` (:func:`pivoted_cholesky`) the first k ≤ r of them, the skeleton of rank k.

    ``rows`` are the rank's per-sample gradients, whose kernel K_ij = ⟨U_i, U_j⟩ is never formed
    whole (only r of its columns, in float64, see :func:`pivoted_cholesky`; float64 keeps the
    dead-pivot tolerance at float64 round-off). W_p is returned in the rows' dtype.

    Π = K_JJ⁻¹ K_J,: is obtained from the pivoted Cholesky factor as L_Jᵀ⁻¹ Lᵀ (the same matrix
    in exact arithmetic, better conditioned); Π[:, J] = I by construction. Skeleton rows that
    the others already span get a zero row in Π apart from their own column, so the
    reconstruction U ≈ U_J Π is exact whenever the per-sample gradients span ≤ r dimensions,
    and W_p stays symmetric positive definite (W_p ⪰ I).
    """
    pivots, factor, alive = pivoted_cholesky(rows, r, stop_below=stop_below)
    r = pivots.shape[0]
    lower = factor.index_select(0, pivots)  # L_J, lower triangular in pivot order
    lower = lower + torch.diag((~alive).to(lower.dtype))
    interp = torch.linalg.solve_triangular(lower.mT, factor.mT, upper=True)  # (r, n)
    interp = interp.index_copy(1, pivots, torch.eye(r, dtype=interp.dtype, device=interp.device))
    weights = interp @ interp.mT
    return pivots, weights.to(rows.dtype)
