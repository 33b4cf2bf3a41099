"""Batched, numerically guarded linear algebra shared by the solvers.

Every function takes a list of matrices (one per layer), groups those of equal
shape, dtype and device, and runs one batched kernel per group, so an update
step costs a handful of launches and at most one host synchronisation per call
regardless of the number of layers. A group is split into batches of at most
``STACK_CAP_MB`` (one matrix at least): stacking copies its matrices, and a
batched solve's workspace grows with it (docs/design.md, "Memory").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from hylo.layers.gradmatrix import GradMatrix

#: Relative jitter added to the diagonal on successive Cholesky retries.
JITTER_LADDER: tuple[float, ...] = (0.0, 1e-10, 1e-8, 1e-6, 1e-4)
#: The most megabytes of equally shaped matrices stacked into one batched call.
STACK_CAP_MB = 64.0


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype used for factor and kernel math: float64 stays, anything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(mats: Sequence[Tensor], fn: Callable[[Tensor], list[Tensor]]) -> list[list[Tensor]]:
    """Apply ``fn`` to stacks of equally shaped matrices; return per-matrix results."""
    groups: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = defaultdict(list)
    for i, m in enumerate(mats):
        groups[(m.shape, m.dtype, m.device)].append(i)
    out: list[list[Tensor]] = [[] for _ in mats]
    for group in groups.values():
        first = mats[group[0]]
        per_batch = max(1, int(STACK_CAP_MB * 2**20 // max(1, first.numel() * first.element_size())))
        for start in range(0, len(group), per_batch):
            indices = group[start : start + per_batch]
            results = fn(torch.stack([mats[i] for i in indices]))
            for j, i in enumerate(indices):
                out[i] = [r[j] for r in results]
    return out


def _cholesky_with_ladder(mat: Tensor) -> Tensor:
    """Cholesky factor of one SPD matrix: jitter ladder in float64.

    If every rung fails (a non-finite matrix, or one far from positive definite) the factor is
    all NaN: the caller's state is then non-finite, which the update stage rejects (the layer
    keeps its previous state) instead of an exception ending the run.
    """
    m64 = mat.to(torch.float64)
    m64 = 0.5 * (m64 + m64.mT)
    scale = m64.diagonal().abs().mean().clamp_min(1e-30)
    eye = torch.eye(m64.shape[-1], dtype=m64.dtype, device=m64.device)
    if torch.isfinite(scale):
        for jitter in JITTER_LADDER:
            factor, info = torch.linalg.cholesky_ex(m64 + (jitter * scale) * eye)
            if int(info) == 0:
                return factor
    return torch.full_like(m64, float("nan"))


def _factors_with_ladder(stack: Tensor) -> Tensor:
    """Lower Cholesky factors of a stack of matrices, failed ones redone with the ladder (NaN if hopeless)."""
    sym = 0.5 * (stack + stack.mT)
    lower, info = torch.linalg.cholesky_ex(sym)
    for k in torch.nonzero(info).flatten().tolist():
        lower[k] = _cholesky_with_ladder(sym[k]).to(stack.dtype)
    return lower


def spd_inverse_many(mats: Sequence[Tensor]) -> list[Tensor]:
    """Inverses of symmetric positive definite matrices via Cholesky.

    Each group of equal shapes is factored in one batched call in its own dtype; factors that
    fail are redone one by one in float64 with a jitter ladder before the batched inverse, so
    a singular or non-finite matrix never raises: it gets a (finite) regularised inverse or,
    when the ladder fails too, a NaN one. The result keeps each input's dtype. One host sync
    per group.
    """
    return [r[0] for r in _grouped(mats, lambda stack: [torch.cholesky_inverse(_factors_with_ladder(stack))])]


def cholesky_many(mats: Sequence[Tensor]) -> list[Tensor]:
    """Lower Cholesky factors of SPD matrices, batched by shape, with the float64 ladder (NaN if hopeless)."""
    return [r[0] for r in _grouped(mats, lambda stack: [_factors_with_ladder(stack)])]


def _eigh_qr(mat: Tensor) -> tuple[Tensor, Tensor]:
    """Last resort for one matrix on which LAPACK's divide-and-conquer ``syevd`` (torch's
    ``eigh``) did not converge, which happens on large factors with many repeated eigenvalues:
    SciPy's QR-iteration driver ``syev`` in float64 on the CPU. If that fails too, NaN
    eigenvalues mark the result non-finite, so the update stage keeps the layer's previous
    state and warns instead of crashing.
    """
    import scipy.linalg

    host = mat.detach().to("cpu", torch.float64).numpy()
    try:
        evals, evecs = scipy.linalg.eigh(host, driver="ev")
    except (scipy.linalg.LinAlgError, ValueError):
        nan = torch.full(mat.shape[:1], float("nan"), dtype=torch.float64, device=mat.device)
        return nan, torch.eye(mat.shape[0], dtype=torch.float64, device=mat.device)
    return torch.from_numpy(evals).to(mat.device), torch.from_numpy(evecs).to(mat.device)


def eigh_many(mats: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Eigendecompositions of symmetric PSD matrices, batched by shape.

    Eigenvalues are clamped at zero (the factors are PSD; negative values are
    round-off). Falls back to float64 for a group whose float32 solve fails, then to
    SciPy's QR-iteration driver per matrix (:func:`_eigh_qr`).
    """

    def decompose(stack: Tensor) -> list[Tensor]:
        sym = (stack + stack.mT).mul_(0.5)
        try:
            evals, evecs = torch.linalg.eigh(sym)
        except torch.linalg.LinAlgError:
            try:
                evals, evecs = torch.linalg.eigh(sym.to(torch.float64))
            except torch.linalg.LinAlgError:
                pairs = [_eigh_qr(mat) for mat in sym]
                evals, evecs = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            evals, evecs = evals.to(stack.dtype), evecs.to(stack.dtype)
        return [evals.clamp_min(0.0), evecs]

    return [(r[0], r[1]) for r in _grouped(mats, decompose)]


#: Relative slack of the length bound ‖V̂‖ ≤ ‖∇W‖/λ (at least 8 ε of the gradient's dtype).
LENGTH_SLACK = 1e-3


def _largest(tensor: Tensor) -> Tensor:
    """max |x| in one pass without a temporary (NaN if any entry is)."""
    low, high = torch.aminmax(tensor)
    return torch.maximum(high, -low)


def result_terms(grad: GradMatrix, result: Tensor) -> Tensor:
    """[Σ V̂ (finite iff V̂ is, barring a sum beyond the dtype's range), ⟨∇W, V̂⟩, ‖∇W‖², ‖V̂‖²] in float64 for one
    layer's ∇W (or this rank's rows of it) and its preconditioned (d_g, d_a) ``result`` V̂: sums over rows, so
    ranks holding rows of one ∇W add theirs up (docs/reliability.md, "Fallbacks").

    Both are first divided by their largest entry, so that the products and squares, taken in the working dtype
    by BLAS dot products, neither overflow nor underflow (a float32 ∇W of 10⁻²⁰ or 10¹⁹ is judged like one of
    1); the scales are put back in float64. A handful of passes over the layer, no float64 copy, no host sync.
    """
    d_w = grad.weight.shape[1]
    grads = [grad.weight] if grad.bias is None else [grad.weight, grad.bias]
    results = [result[:, :d_w]] if grad.bias is None else [result[:, :d_w], result[:, d_w]]
    if result.numel() == 0:  # a rank holding no rows of this layer
        return torch.zeros(4, dtype=torch.float64, device=result.device)
    tiny = torch.finfo(result.dtype).tiny
    g_max = torch.stack([_largest(p).to(result.dtype) for p in grads]).amax()
    v_max = torch.stack([_largest(p) for p in results]).amax()
    g_max, v_max = g_max.clamp_min(tiny), v_max.clamp_min(tiny)
    g_unit = [(p.to(result.dtype) * (1.0 / g_max)).reshape(-1) for p in grads]
    v_unit = [(p * (1.0 / v_max)).reshape(-1) for p in results]
    pairs = list(zip(g_unit, v_unit, strict=True))
    sums = torch.stack(
        [torch.stack([torch.dot(g, v), torch.dot(g, g), torch.dot(v, v), v.sum()]).to(torch.float64) for g, v in pairs]
    ).sum(dim=0)
    g_scale, v_scale = g_max.to(torch.float64), v_max.to(torch.float64)
    total = sums[3] * v_scale  # Σ V̂, non-finite iff some entry is (or v_max is)
    return torch.stack([total, sums[0] * g_scale * v_scale, sums[1] * g_scale**2, sums[2] * v_scale**2])


def sound_results(terms: Tensor, dampings: Sequence[float | None], dtypes: Sequence[torch.dtype]) -> Tensor:
    """Per layer, whether its result may be applied, from its (summed) :func:`result_terms` row: finite, a
    descent direction (⟨∇W, V̂⟩ > 0, or ∇W = 0) and no longer than ‖∇W‖/λ (1 + slack), which (F̃ + λI)⁻¹ with
    F̃ PSD guarantees for every solver (docs/solvers.md, "Numerics"). A damping of None checks finiteness only
    (a result another rank computed and checked, ``strategy="gradient"``). No host sync."""
    limits = [
        (float("nan") if damping is None else damping, 1.0 + max(LENGTH_SLACK, 8 * torch.finfo(dtype).eps))
        for damping, dtype in zip(dampings, dtypes, strict=True)
    ]
    damping, slack = torch.tensor(limits, dtype=torch.float64, device=terms.device).unbind(dim=1)
    finite = torch.isfinite(terms[:, 0])
    descent = (terms[:, 1] > 0) | (terms[:, 2] == 0)
    bounded = terms[:, 3].sqrt() * damping <= terms[:, 2].sqrt() * slack
    return finite & (damping.isnan() | (descent & bounded))
