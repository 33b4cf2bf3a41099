"""Batched, numerically guarded linear algebra shared by the solvers.

Every function takes a list of matrices (one per layer), groups those of equal
shape, dtype and device, and runs one batched kernel per group, so an update
step costs a handful of launches and at most one host synchronisation per call
regardless of the number of layers. A group is split into batches of at most
``STACK_CAP_MB`` (one matrix at least): stacking copies its matrices, and a
batched solve's workspace grows with it (docs/design.md, "Memory").

It also holds the check of every applied result: its scales (:func:`unit_scales`), its verdict on the terms
(:func:`sound`; the terms are :func:`hylo.pipeline.apply.result_sums`) and the ``kl_clip`` scale built on them
(:func:`kl_scale`), the same on one rank, under "gradient" and under FSDP2 (docs/reliability.md, "Fallbacks").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Relative jitter added to the diagonal on successive Cholesky retries.
JITTER_LADDER: tuple[float, ...] = (0.0, 1e-10, 1e-8, 1e-6, 1e-4)
#: The most megabytes of equally shaped matrices stacked into one batched call.
STACK_CAP_MB = 64.0


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype used for factor and kernel math: float64 stays, anything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(
    mats: Sequence[Tensor], fn: Callable[..., list[Tensor]], beside: Sequence[Sequence[Tensor]] = ()
) -> list[list[Tensor]]:
    """Apply ``fn`` to stacks of equally shaped matrices (and the stacks of the same members of each list in
    ``beside``, which match ``mats`` one to one); return per-matrix results."""
    groups: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = defaultdict(list)
    for i, m in enumerate(mats):
        groups[(m.shape, m.dtype, m.device)].append(i)
    out: list[list[Tensor]] = [[] for _ in mats]
    for group in groups.values():
        first = mats[group[0]]
        per_batch = max(1, int(STACK_CAP_MB * 2**20 // max(1, first.numel() * first.element_size())))
        for start in range(0, len(group), per_batch):
            indices = group[start : start + per_batch]
            stacks = [torch.stack([mats[i] for i in indices])]
            stacks += [torch.stack([more[i] for i in indices]) for more in beside]
            results = fn(*stacks)
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


#: How far ‖Q 1‖²/d may stray from 1 before an eigenvector matrix Q counts as not orthogonal: a probe of O(d²) that
#: round-off of an orthogonal Q stays far below (|·| ≲ d·ε) and a broken decomposition does not.
ORTHOGONALITY_TOLERANCE = 1e-2


def _sound_eigh(evals: Tensor, evecs: Tensor) -> Tensor:
    """Per matrix of a batched decomposition, whether it is usable: every eigenvalue and eigenvector entry finite
    and the eigenvectors orthogonal by the probe ‖Q 1‖² = d (no host sync)."""
    finite = torch.isfinite(evals).all(dim=-1) & torch.isfinite(evecs).flatten(-2).all(dim=-1)
    probe = evecs.sum(dim=-1, dtype=torch.float64).square().sum(dim=-1) / max(1, evecs.shape[-1])
    return finite & ((probe - 1.0).abs() <= ORTHOGONALITY_TOLERANCE)


def _eigh_scipy(mat: Tensor) -> tuple[Tensor, Tensor] | None:
    """SciPy's QR-iteration driver ``syev`` in float64 on the CPU, or None where it fails."""
    import scipy.linalg

    host = mat.detach().to("cpu", torch.float64).numpy()
    try:
        evals, evecs = scipy.linalg.eigh(host, driver="ev")
    except (scipy.linalg.LinAlgError, ValueError):
        return None
    return torch.from_numpy(evals).to(mat.device), torch.from_numpy(evecs).to(mat.device)


def _eigh_torch(mat: Tensor) -> tuple[Tensor, Tensor] | None:
    """torch's ``eigh`` (LAPACK's divide-and-conquer ``syevd``) of one matrix, or None where it raises."""
    try:
        return torch.linalg.eigh(mat)
    except torch.linalg.LinAlgError:
        return None


def _repaired_eigh(mat: Tensor) -> tuple[Tensor, Tensor]:
    """The decomposition of one symmetric matrix on which the batched one failed (raised, or returned non-finite or
    non-orthogonal results without raising, as float32 ``syevd`` does on factors with entries near 10⁻¹⁶), by the
    first rung that passes :func:`_sound_eigh`: the matrix divided by its largest entry (eigenvalues scaled back),
    then float64, then SciPy's ``syev`` in float64. If every rung fails, NaN eigenvalues mark the result non-finite,
    so the update stage keeps the layer's previous state and warns instead of crashing (docs/solvers.md,
    "Numerics"). Results in ``mat``'s dtype."""
    largest = mat.abs().max()
    rungs: list[tuple[Callable[[Tensor], tuple[Tensor, Tensor] | None], Tensor, Tensor]] = []
    if bool(torch.isfinite(largest)) and bool(largest > 0):
        rungs.append((_eigh_torch, mat / largest, largest))
    one = torch.ones((), dtype=torch.float64, device=mat.device)
    rungs += [(_eigh_torch, mat.to(torch.float64), one), (_eigh_scipy, mat, one)]
    for decompose, scaled, factor in rungs:
        pair = decompose(scaled)
        if pair is not None and bool(_sound_eigh(*pair)):
            evals, evecs = pair
            return (evals * factor.to(evals.dtype)).to(mat.dtype), evecs.to(mat.dtype)
    return torch.full(mat.shape[:1], float("nan"), dtype=mat.dtype, device=mat.device), torch.eye(
        mat.shape[0], dtype=mat.dtype, device=mat.device
    )


def eigh_many(mats: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Eigendecompositions of symmetric PSD matrices, batched by shape.

    Every matrix's result is checked (:func:`_sound_eigh`: finite, orthogonal eigenvectors) and a failed one is
    redone alone by :func:`_repaired_eigh` (largest entry scaled to 1, float64, SciPy); a batched call that raises
    is redone matrix by matrix the same way. Eigenvalues are clamped at zero (the factors are PSD; negative values
    are round-off). One host sync per group (the check).
    """

    def decompose(stack: Tensor) -> list[Tensor]:
        return list(_checked_eigh((stack + stack.mT).mul_(0.5)))

    return [(r[0], r[1]) for r in _grouped(mats, decompose)]


def _checked_eigh(sym: Tensor) -> tuple[Tensor, Tensor]:
    """A stack of symmetric matrices decomposed in one batched call, each result checked and a failed one redone
    by :func:`_repaired_eigh`; eigenvalues clamped at zero."""
    pair = _eigh_torch(sym)
    if pair is None:
        evals, evecs = torch.empty_like(sym[..., 0]), torch.empty_like(sym)
        failed = list(range(sym.shape[0]))
    else:
        evals, evecs = pair
        failed = torch.nonzero(~_sound_eigh(evals, evecs)).flatten().tolist()
    for k in failed:
        evals[k], evecs[k] = _repaired_eigh(sym[k])
    return evals.clamp_min(0.0), evecs


#: Multiply-adds per d³ of :func:`power_refresh_many`'s refresh of one (d × d) matrix: the product F Q and a QR
#: (Householder, with Q formed). Its CPU time is 0.45–0.7× :data:`~hylo.solvers.kfac.EIGH_COST`'s eigendecomposition
#: (docs/solvers.md, "The warm-started basis").
POWER_COST = 2.5


#: The shift σ = POWER_SHIFT · max(e) of :func:`power_refresh_many`'s power step (F + σI) Q: well above the round-off
#: of F Q in float32 (ε·‖F‖·√d), so that the QR keeps the previous basis inside a null or (nearly) repeated eigenspace
#: instead of completing it arbitrarily, and small enough to leave the convergence of the eigenvectors of eigenvalues
#: above it as it was (docs/solvers.md, "The warm-started basis").
POWER_SHIFT = 1e-4


def power_refresh_many(
    mats: Sequence[Tensor], bases: Sequence[Tensor], products: Sequence[Tensor] | None = None
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Warm-started eigenbases of symmetric PSD matrices F from their previous bases Q (columns in ascending order of
    their eigenvalues, as :func:`eigh_many` leaves them), batched by shape: SOAP's refresh, one step of power
    iteration and a QR (docs/solvers.md, "The warm-started basis").

    Per matrix: the Rayleigh quotients e = diag(Qᵀ F Q), Q's columns sorted by them in descending order (the order
    in which a QR of F Q converges to the leading eigenvectors), Q' = qr((F + σI) Q_sorted), σ = :data:`POWER_SHIFT`
    · max(e), with each column's sign making R's diagonal ≥ 0 (Q' = Q to round-off where Q already diagonalises F,
    inside a repeated eigenvalue or a null space too: the shift keeps a column that F leaves (nearly) null from
    being completed arbitrarily); returned as (e ascending and clamped at zero,
    Q' in that order, ``order``: column j of Q' refines column ``order[j]`` of Q). A result that fails the check of
    :func:`eigh_many` (finite, orthogonal) is redone by its eigendecomposition, with ``order`` the identity. One
    host sync per group (the check). ``products``: each F Q already computed as ``bmm`` of (F + Fᵀ)/2 and Q (an
    adaptive refresh's measure, docs/solvers.md, "Adaptive refresh"), which the refresh then reuses.
    """

    def refresh(stack: Tensor, basis: Tensor, *product: Tensor) -> list[Tensor]:
        sym = (stack + stack.mT).mul_(0.5)
        basis = basis.to(sym.dtype)
        power = product[0] if product else torch.bmm(sym, basis)
        quotients = (basis * power).sum(dim=-2)
        largest = quotients.amax(dim=-1, keepdim=True).unsqueeze(-1)
        shift = torch.where(largest > 0, POWER_SHIFT * largest, 1.0)
        power = torch.addcmul(power, basis, shift)  # (F + σI) Q: a column F leaves (nearly) null stays itself
        order = torch.argsort(quotients, dim=-1, descending=True)
        power = power.gather(-1, order.unsqueeze(-2).expand_as(power))
        try:
            evecs, upper = torch.linalg.qr(power)
        except torch.linalg.LinAlgError:
            evals, evecs = _checked_eigh(sym)
            return [evals, evecs, _identity_orders(sym)]
        signs = torch.where(torch.diagonal(upper, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(evecs.dtype)
        evecs = evecs.mul_(signs.unsqueeze(-2)).flip(-1)
        evals = quotients.gather(-1, order).flip(-1).clamp_min(0.0)
        order = order.flip(-1)
        failed = torch.nonzero(~_sound_eigh(evals, evecs)).flatten()
        if failed.numel():
            evals[failed], evecs[failed] = _checked_eigh(sym[failed])
            order[failed] = _identity_orders(sym[failed])
        return [evals, evecs, order]

    return [(r[0], r[1], r[2]) for r in _grouped(mats, refresh, [bases] if products is None else [bases, products])]


def finite_each(tensors: Sequence[Tensor]) -> Tensor:
    """Per tensor of one floating dtype, whether every entry is finite, by one ``torch._foreach_norm``: the 2-norm
    accumulated in float64 for tensors of at most 32 bits (NaN or inf exactly where an entry is: no finite entry can
    overflow it, and a CPU reads it several times faster than the largest |entry|), the largest |entry| for float64
    tensors (whose squares could overflow)."""
    order = math.inf if tensors[0].dtype == torch.float64 else 2
    return torch.isfinite(torch.stack(torch._foreach_norm(list(tensors), order, dtype=torch.float64)))


#: Eigenvalues closer than this many ε of their dtype times the largest one are one eigenspace in
#: :func:`aligned_many`: below that gap an eigensolver's vectors are not determined (their error grows as ε·‖F‖/gap).
CLUSTER_EPS = 64


#: Eigenspaces of at most this many dimensions are turned together, padded to the largest of them (:func:`aligned_many`);
#: a larger one (a factor's null space) with those of its own size only.
PADDED_SIZES = 8


def aligned_many(evals: Sequence[Tensor], evecs: Sequence[Tensor], previous: Sequence[Tensor]) -> list[Tensor]:
    """New eigenbases turned, inside each of their degenerate eigenspaces, to the previous bases (docs/solvers.md,
    "Degenerate eigenspaces"), batched by shape.

    Within an eigenspace of (nearly) equal eigenvalues — gaps ≤ :data:`CLUSTER_EPS`·ε·max(e), ``evals`` ascending as
    :func:`eigh_many` and :func:`power_refresh_many` leave them — any orthonormal basis is an eigenbasis, so an
    eigensolver returns an arbitrary one. There the columns Q_C are replaced by Q_C B with B = polar(Q_Cᵀ Q_old[:, K])
    (the orthogonal Procrustes solution), K the |C| previous columns lying most in the eigenspace: where the
    eigenspace is the one the previous basis held, the result is that basis (no rotation inside it), and every column
    is still an eigenvector of its eigenvalue. Columns outside such eigenspaces are returned as they are. One host
    read per group (where the eigenspaces are), then about forty batched operations for all of its eigenspaces of at
    most :data:`PADDED_SIZES` dimensions, and as many for each larger size."""

    def align(values: Tensor, vectors: Tensor, old: Tensor) -> list[Tensor]:
        tolerance = CLUSTER_EPS * torch.finfo(values.dtype).eps * values.amax(dim=-1, keepdim=True)
        joined = (values.diff(dim=-1) <= tolerance).tolist()  # column j and j + 1 in one eigenspace: the host read
        clusters: list[tuple[int, int, int]] = []  # (matrix, first column, size)
        for k, row in enumerate(joined):
            start = 0
            for j, same in enumerate([*row, False]):
                if not same:
                    if j > start:
                        clusters.append((k, start, j + 1 - start))
                    start = j + 1
        if not clusters:
            return [vectors]
        overlap = torch.bmm(old.mT, vectors)  # P = Q_oldᵀ Q of every matrix
        turned = vectors.clone()
        buckets: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for cluster in clusters:  # the small ones together, the few large ones each at its own size
            buckets[cluster[2] if cluster[2] > PADDED_SIZES else 0].append(cluster)
        for members in buckets.values():
            _turn(turned, vectors, overlap, members)
        return [turned]

    return [r[0] for r in _grouped(evecs, lambda vectors, values, old: align(values, vectors, old), [evals, previous])]


def _turn(out: Tensor, vectors: Tensor, overlap: Tensor, clusters: Sequence[tuple[int, int, int]]) -> None:
    """Write into ``out`` the columns of each cluster (matrix, first column, size) of ``vectors`` (b, d, d) turned to
    the previous basis (see :func:`aligned_many`; ``overlap``: Q_oldᵀ Q of each matrix), every cluster at once,
    padded to the largest size s: a padded column of Q_C is zero and the padding of each Procrustes target 2·I, whose
    singular values (2) differ from the target's own (≤ 1, a block of an orthogonal matrix), so that the polar factor
    never mixes the padding into the eigenspace."""
    d, device = vectors.shape[-1], vectors.device
    matrices, starts, sizes = torch.tensor(clusters, device=device).unbind(1)
    offsets = torch.arange(max(size for _, _, size in clusters), device=device)
    valid = offsets < sizes[:, None]  # (n, s)
    columns = torch.where(valid, starts[:, None] + offsets, 0)  # a padded column reads column 0, then is zeroed
    where = (matrices[:, None, None], torch.arange(d, device=device)[:, None], columns[:, None, :])
    mask = valid[:, None, :].to(vectors.dtype)
    spans = vectors[where] * mask  # Q_C, (n, d, s)
    cluster = overlap[where] * mask  # Q_oldᵀ Q_C
    top = cluster.square().sum(dim=2).topk(offsets.numel(), dim=1).indices  # old columns by their mass in C
    rows = torch.where(valid, top, d).sort(dim=1).values.clamp_(max=d - 1)  # K ascending, then padding
    target = cluster.gather(1, rows[:, :, None].expand(-1, -1, offsets.numel()))  # (Q_Cᵀ Q_old[:, K])ᵀ
    both = valid[:, :, None] & valid[:, None, :]
    target = torch.where(both, target, torch.diag_embed((~valid).to(target.dtype) * 2)).nan_to_num_(0.0, 0.0, 0.0)
    try:
        u, _, vh = torch.linalg.svd(target.mT)
    except torch.linalg.LinAlgError:  # no convergence: these eigenspaces keep the eigensolver's basis
        return
    turned = torch.bmm(spans, torch.bmm(u, vh)).mT[valid]  # each valid column's d entries, (m, d)
    out[matrices[:, None].expand_as(valid)[valid][:, None], torch.arange(d, device=device), columns[valid][:, None]] = (
        turned
    )


def _identity_orders(stack: Tensor) -> Tensor:
    """``arange(d)`` for each matrix of a (b, d, d) stack."""
    d = stack.shape[-1]
    return torch.arange(d, device=stack.device).expand(stack.shape[0], d).clone()


#: Relative slack of the length bound ‖V̂‖ ≤ ‖∇W‖/λ (at least 8 ε of the gradient's dtype).
LENGTH_SLACK = 1e-3
#: The clamp of ‖∇W‖ in the check's scale λ/(‖∇W‖·clamp(‖∇W‖)): see :func:`unit_scales`.
NORM_CLAMP = (1e-18, 1e8)


#: What the scale's denominator of a result without a length bound adds to ‖∇W‖·m: a step of up to 10¹⁴ taken where
#: ∇W = 0 (an idle expert's momentum step under Adam's moments) then stays finite when scaled by s ≤ 10²⁴, and for
#: ‖∇W‖ ≥ 10⁻⁶ it changes s by less than 10⁻¹² (docs/solvers.md, "Numerics").
UNBOUNDED_FLOOR = 1e-24


def _raw_scales(norms: Tensor, bound: Tensor | float, floor: Tensor | float | None = None) -> Tensor:
    """c/(‖∇W‖·m), m = ‖∇W‖ clamped into :data:`NORM_CLAMP`, in float64 (``bound``: c); with a ``floor`` (per layer:
    :data:`UNBOUNDED_FLOOR` where unbounded, else 0) c/(floor + ‖∇W‖·m), in as many operations."""
    clamped = norms.clamp(*NORM_CLAMP)
    if floor is None:
        return bound / (norms * clamped)
    if isinstance(floor, Tensor):
        return bound / torch.addcmul(floor, norms, clamped)
    return bound / (norms * clamped + floor)


def _in_range(scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``scales`` clamped into ``dtype``'s finite positive range (still in float64)."""
    info = torch.finfo(dtype)
    return scales.clamp(info.tiny, info.max)


@dataclass(frozen=True)
class CheckLimits:
    """Per layer, the limits its result is checked against (float64 device tensors): ``damping``, the λ of the
    length bound (NaN: finiteness only; 0: no length bound), ``slack``, 1 + the bound's slack for its dtype,
    ``unbounded``, where λ is NaN, ``bound``, the scale's c (λ, or 1 without a length bound) and ``floor``, what
    the scale's denominator adds (:data:`UNBOUNDED_FLOOR` where unbounded, else 0; None when every layer has a
    bound)."""

    damping: Tensor
    slack: Tensor
    unbounded: Tensor
    bound: Tensor
    floor: Tensor | None

    def tensors(self) -> list[Tensor]:
        """Every tensor held."""
        return [t for t in (self.damping, self.slack, self.unbounded, self.bound, self.floor) if t is not None]


def check_limits(dampings: Sequence[float | None], dtypes: Sequence[torch.dtype], device: torch.device) -> CheckLimits:
    """The :class:`CheckLimits` of layers whose states bound their results by ``dampings`` (a state's
    ``bound``: None for finiteness only) in ``dtypes``, built on the host and copied without a stream
    synchronisation (docs/design.md, "Host synchronisation")."""
    limits = [
        (
            float("nan") if damping is None else damping,
            1.0 + max(LENGTH_SLACK, 8 * torch.finfo(dtype).eps),
            damping if damping else 1.0,
            UNBOUNDED_FLOOR if damping is None else 0.0,
        )
        for damping, dtype in zip(dampings, dtypes, strict=True)
    ]
    damping, slack, bound, floor = torch.tensor(limits, dtype=torch.float64).to(device, non_blocking=True).unbind(1)
    unbounded = damping.isnan()
    return CheckLimits(damping, slack, unbounded, bound, floor if any(d is None for d in dampings) else None)


def sound(terms: Tensor, norms: Tensor, limits: CheckLimits) -> Tensor:
    """Per layer, whether its result may be applied, from its (summed) :func:`~hylo.pipeline.apply.result_sums`
    row [⟨∇W, V̂⟩, ‖V̂‖²] in float64, its ‖∇W‖ ``norms`` (float64) and its :class:`CheckLimits`: finite, a descent direction (⟨∇W, V̂⟩ > 0, or ∇W = 0) and no longer than ‖∇W‖/λ (1 + slack), which (F̃ +
    λI)⁻¹ with F̃ PSD guarantees for every solver (docs/solvers.md, "Numerics"); where λ is NaN, finite only; λ =
    0 skips the length bound. A finite ⟨∇W, V̂⟩ and a finite ‖V̂‖² within the bound mean every entry is finite
    (NaN fails every comparison), so no separate test of the sums is needed: twelve operations whatever the
    number of layers, no host sync."""
    dot, square = terms[:, 0], terms[:, 1]
    finite = dot.abs() < math.inf
    bounded = ((dot > 0) | (norms == 0)) & (square.sqrt() * limits.damping <= norms * limits.slack)
    return finite & (limits.unbounded | bounded)


def unit_scales(
    norms: Tensor, limits: CheckLimits, spans: Sequence[tuple[int, int, torch.dtype]]
) -> tuple[list[Tensor], Tensor]:
    """The check's scale s = c/(‖∇W‖·m) of many layers at once, m = ‖∇W‖ clamped into :data:`NORM_CLAMP` (c and
    the denominator's floor from ``limits``, :func:`_raw_scales`), computed in float64 and clamped into each
    dtype's finite positive range: per span (start, stop, dtype) of ``norms`` (float64) the scales in its dtype,
    and all of them in float64, clamped as the cast ones are (they differ by the cast's rounding, a relative 2⁻²⁴
    in float32: what the check's sums, divided by them, then carry)."""
    raw = _raw_scales(norms, limits.bound, limits.floor)
    clamped = {dtype: _in_range(raw, dtype) for dtype in dict.fromkeys(dtype for _, _, dtype in spans)}
    cast = {dtype: scales.to(dtype) for dtype, scales in clamped.items()}
    if len(clamped) == 1:
        applied = next(iter(clamped.values()))
    else:
        applied = torch.cat([clamped[dtype][start:stop] for start, stop, dtype in spans])
    return [cast[dtype][start:stop] for start, stop, dtype in spans], applied


def kl_scale(terms: Tensor, norms: Tensor, ok: Tensor, kl_clip: float, lr: float) -> Tensor:
    """min(1, sqrt(kl_clip / (lr² |Σ v̂·∇W|))), the whole step's trust region (0-dim float64), with ⟨∇W, v̂⟩ from
    each layer's :func:`~hylo.pipeline.apply.result_sums` (‖∇W‖² from ``norms`` where it fell back, ``ok``
    false)."""
    vg = torch.where(ok, terms[:, 0], norms.square()).sum().abs() * lr * lr  # a tensor product: inf, never an error
    return torch.where(vg > 0, torch.sqrt(kl_clip / vg), torch.ones_like(vg)).clamp(max=1.0)
