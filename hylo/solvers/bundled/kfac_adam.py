"""The adaptive family: Adam's moments of the gradient in a layer's K-FAC eigenbasis (``solver="kfac_adam"``).

docs/solvers.md, "Adam in the K-FAC eigenbasis". The family shares K-FAC's statistics (batch
factors A, G averaged over ranks and blended into running factors) and eigendecomposes the
running factors at each update: Q_a, Q_g. At every step the state rotates ∇W into that basis,
R = Q_gᵀ ∇W Q_a, keeps Adam's moments of R (m, v: β₁, β₂, bias correction) and returns
V̂ = Q_g [m̂ / (v̂^p + ε)] Q_aᵀ: SOAP's step with K-FAC's factors in place of SOAP's gradient
statistics. The state changes at every step it is applied (:attr:`LayerState.advances`); at an
update the moments are carried into the new basis (m exactly, v by ``moment_carry``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hylo.layers.batch import LayerShape
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.statistics import FACTORS
from hylo.numerics import POWER_COST, aligned_many, eigh_many, power_refresh_many
from hylo.payload import Payload
from hylo.solvers.base import (
    Contribution,
    CostEstimate,
    FamilyOptions,
    HeldState,
    LayerState,
    SolverFamily,
    UpdateContext,
    UpdateJob,
    checked_tensors,
    positive_number,
)
from hylo.solvers.blockdiag import blocks, diagonal, identity, rotated_in, rotated_out
from hylo.solvers.bundled import staleness
from hylo.solvers.bundled.adam_rule import (
    SIDES,
    AdamRule,
    KFACAdamConfig,
    basis_kind,
    basis_work,
    carried_moments_many,
    joined_side,
    previous_basis,
    side_factor,
    side_layout,
    warm_started,
)
from hylo.solvers.kernel import GroupKernel, applied_alone, stacked
from hylo.solvers.kfac import (
    EIGH_COST,
    KFACConfig,
    KFACFamily,
    KFACState,
    eigen_shapes,
    eigen_template,
    refreshed_states,
    running_factors,
)
from hylo.solvers.kfac_blocks import cubes, factor_layouts, held_shapes, state_layouts
from hylo.solvers.registry import register_family

#: Elementwise operations of one step on every entry of R (moments, bias correction, the division).
ELEMENTWISE_COST = 8.0


@dataclass
class KFACAdamState(LayerState):
    """Running factors, their eigenbases and Adam's moments of the rotated gradient (d_g × d_a each).

    Its apply (:class:`AdamKernel`) computes V̂ = Q_g [m̂ / (v̂^p + ε)] Q_aᵀ with the moments updated by this step's
    ∇W and returns the state with them; ``precondition`` is the same V̂ without keeping them. The moments stay finite for a finite ∇W
    (|R| ≤ ‖∇W‖, R² clamped), which the step checks before any state is applied."""

    family: ClassVar[str] = "kfac_adam"
    advances: ClassVar[bool] = True
    entry_keys: ClassVar[frozenset[str]] = frozenset(("steps", "rule", "held"))

    factor_a: Tensor
    factor_g: Tensor
    evals_a: Tensor
    evecs_a: Tensor
    evals_g: Tensor
    evecs_g: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    steps: int
    damping: float
    rule: AdamRule
    #: Updates for which the basis of A and of G has been kept unrefreshed (``refresh_tolerance``; docs/solvers.md,
    #: "Adaptive refresh").
    held: tuple[int, int] = (0, 0)

    @property
    def bound(self) -> float | None:
        """None: an Adam step (with momentum) need not be a descent direction of this ∇W nor shorter than
        ‖∇W‖/λ, so only its finiteness is checked (docs/reliability.md, "Fallbacks")."""
        return None

    def advance(self, grad: Tensor | GradMatrix) -> tuple[Tensor, LayerState]:
        """V̂ and the state with this step's moments: :class:`AdamKernel` on a group of one."""
        dtype = self.evecs_a.dtype
        return applied_alone(AdamKernel([self], dtype), self, grad, dtype)

    def layouts(self) -> tuple[Any, Any]:
        """(G's, A's) block layouts (None: a dense side; docs/solvers.md, "Blocked factors")."""
        return state_layouts(self.evecs_g, self.evecs_a, self.evals_g.shape[0], self.evals_a.shape[0])

    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """V̂ of :meth:`advance`, the state left as it is (the studies' use)."""
        return self.advance(grad)[0]

    def plan_parts(self) -> tuple[object, ...]:
        """The eigendecompositions, λ and the rule, which every step's successor keeps (its moments change)."""
        return (self.evals_a, self.evecs_a, self.evals_g, self.evecs_g, self.damping, self.rule)

    def tensors(self) -> dict[str, Tensor]:
        """Factors, eigendecompositions and moments by name."""
        return {name: getattr(self, name) for name in (*eigen_shapes(0, 0), "exp_avg", "exp_avg_sq")}

    def carried(self) -> dict[str, Tensor]:
        """The running factors, which the next update blends with its batch factors."""
        return {"factor_a": self.factor_a, "factor_g": self.factor_g}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``state_dict``: the tensors, λ, the step count, the rule and the bases' kept updates."""
        entry = {**super().to_dict(), "steps": self.steps, "rule": dataclasses.asdict(self.rule)}
        return {**entry, "held": list(self.held)}

    @classmethod
    def from_dict(
        cls, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> KFACAdamState:
        """A state saved by ``to_dict``; ``ValueError`` naming the field unless every tensor has its shape and
        ``dtype``, the eigenvalues and v are ≥ 0, λ is a finite number > 0, the step count an int ≥ 0 and the rule
        one :class:`KFACAdamConfig` accepts, ``held`` two ints ≥ 0 (docs/reliability.md, "Validation")."""
        if "divisor" in entry:
            raise ValueError("state_dict entry holds a divisor, which a kfac_adam state has none of")
        damping = positive_number(entry, "damping")
        dense = {**eigen_shapes(d_a, d_g), "exp_avg": (d_g, d_a), "exp_avg_sq": (d_g, d_a)}
        shapes = held_shapes(entry.get("tensors"), d_a, d_g, dense)
        t = checked_tensors(entry.get("tensors"), shapes, dict.fromkeys(shapes, dtype), device)
        for key in ("evals_a", "evals_g", "exp_avg_sq"):
            if bool((t[key] < 0).any()):
                raise ValueError(f"{key} holds negative values (they are eigenvalues or means of squares)")
        steps = entry.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        rule, held = AdamRule.saved(entry.get("rule")), staleness.held_of(entry)
        return cls(
            t["factor_a"],
            t["factor_g"],
            t["evals_a"],
            t["evecs_a"],
            t["evals_g"],
            t["evecs_g"],
            t["exp_avg"],
            t["exp_avg_sq"],
            steps,
            damping,
            rule,
            held,
        )

    @classmethod
    def carried_from_dict(
        cls, carried: object, d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, Tensor]:
        """K-FAC's: the running factors A (d_a × d_a) and G (d_g × d_g) in ``dtype``, else ``ValueError``."""
        return KFACState.carried_from_dict(carried, d_a, d_g, dtype, device)


class AdamKernel(GroupKernel):
    """A group of :class:`KFACAdamState` with one rule: Q_a, Q_g (and with ``second_moment="factors"`` the
    denominators v̂^p + ε) stacked once. A step rotates each group's gradients in two batched products, updates
    the moments of every layer of every group at once as lists (``torch._foreach_*``, :meth:`apply_all`: each
    successor holds its own tensors) and rotates each group back in two.

    m = β₁ m + (1 − β₁) R and, with ``second_moment="gradient"``, v = β₂ v + (1 − β₂) R² (R² clamped at the dtype's
    largest finite value, so that v stays finite), the bias corrections 1 − β^t counting this step; with
    ``"factors"`` v̂ = e_g e_aᵀ and v is kept. V̂ = Q_g [m̂ / (v̂^p + ε)] Q_aᵀ."""

    def __init__(self, states: Sequence[KFACAdamState], dtype: torch.dtype) -> None:
        self.rule = states[0].rule
        self.evecs_a = stacked([state.evecs_a for state in states], dtype)
        self.evecs_g = stacked([state.evecs_g for state in states], dtype)
        d_g, d_a = states[0].exp_avg.shape
        #: (G's, A's) block layouts where a side is held as packed blocks (docs/solvers.md, "Blocked factors").
        self.layouts = state_layouts(self.evecs_g, self.evecs_a, d_g, d_a, batched=True)
        self.denominators: Tensor | None = None
        if self.rule.second_moment == "factors":
            v_hat = torch.stack([torch.outer(state.evals_g, state.evals_a) for state in states]).to(dtype)
            power = v_hat.sqrt_() if self.rule.exponent == 0.5 else v_hat.pow_(self.rule.exponent)
            self.denominators = power.add_(self.rule.eps)

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """V̂ of every layer and its state with this step's moments."""
        return self.apply_all([self], [grads], [states])[0]

    def rotate_in(self, grads: Tensor) -> Tensor:
        """Q_gᵀ ∇W Q_a of every layer (two batched products, or one per block size and side where blocked)."""
        if self.layouts != (None, None):
            return rotated_in(grads, self.evecs_g, self.evecs_a, self.layouts)
        return torch.bmm(self.evecs_g.mT, torch.bmm(grads, self.evecs_a))

    def rotate_out(self, step: Tensor) -> Tensor:
        """Q_g X Q_aᵀ of every layer."""
        if self.layouts != (None, None):
            return rotated_out(step, self.evecs_g, self.evecs_a, self.layouts)
        return torch.bmm(torch.bmm(self.evecs_g, step), self.evecs_a.mT)

    @classmethod
    def apply_all(
        cls, kernels: Sequence[GroupKernel], grads: Sequence[Tensor], states: Sequence[Sequence[LayerState]]
    ) -> list[tuple[Tensor, list[LayerState]]]:
        """Every group at once: the elementwise moments over all their layers of one rule and working dtype in one
        ``torch._foreach_*`` each."""
        out: dict[int, tuple[Tensor, list[LayerState]]] = {}
        by_rule: dict[tuple[AdamRule, bool, torch.dtype], list[int]] = {}
        adams = [kernel for kernel in kernels if isinstance(kernel, AdamKernel)]
        assert len(adams) == len(kernels)
        for i, kernel in enumerate(adams):  # one list per working dtype: R² is clamped at that dtype's largest value
            by_rule.setdefault((kernel.rule, kernel.denominators is None, kernel.evecs_a.dtype), []).append(i)
        for (rule, _, _), members in by_rule.items():
            mine = [adams[i] for i in members]
            adam = [[state for state in states[i] if isinstance(state, KFACAdamState)] for i in members]
            rotated = [kernel.rotate_in(grads[i]) for kernel, i in zip(mine, members, strict=True)]
            rows = [row for group in rotated for row in group.unbind(0)]
            flat = [state for group in adam for state in group]
            first = list(torch._foreach_lerp(rows, [state.exp_avg for state in flat], rule.beta1))
            second: list[Tensor]
            denominators: list[Tensor]
            if mine[0].denominators is None:
                squares = torch._foreach_mul(rows, rows)
                torch._foreach_clamp_max_(squares, torch.finfo(rows[0].dtype).max)
                second = list(torch._foreach_lerp(squares, [state.exp_avg_sq for state in flat], rule.beta2))
                v_hat = torch._foreach_div(second, [1.0 - rule.beta2 ** (state.steps + 1) for state in flat])
                powers = (
                    torch._foreach_sqrt(v_hat) if rule.exponent == 0.5 else torch._foreach_pow(v_hat, rule.exponent)
                )
                torch._foreach_add_(powers, rule.eps)
                denominators = list(powers)
            else:
                second = [state.exp_avg_sq for state in flat]
                denominators = [
                    d for kernel in mine if kernel.denominators is not None for d in kernel.denominators.unbind(0)
                ]
            steps = torch._foreach_div(first, denominators)
            torch._foreach_mul_(steps, [1.0 / (1.0 - rule.beta1 ** (state.steps + 1)) for state in flat])
            begin = 0
            for kernel, i, group in zip(mine, members, adam, strict=True):
                stop = begin + len(group)
                step = torch.stack(steps[begin:stop])
                successors: list[LayerState] = [
                    dataclasses.replace(state, exp_avg=m, exp_avg_sq=v, steps=state.steps + 1)
                    for state, m, v in zip(group, first[begin:stop], second[begin:stop], strict=True)
                ]
                out[i] = kernel.rotate_out(step), successors
                begin = stop
        return [out[i] for i in range(len(kernels))]


@dataclass
class KFACAdamInputs:
    """A layer's running factors after this update's blend, what it held before, and the options to apply."""

    factor_a: Tensor
    factor_g: Tensor
    previous: KFACAdamState | None
    options: KFACAdamConfig
    #: Whether A is diagonal by construction (:attr:`~hylo.layers.math.LayerMath.diagonal_input_factor`): its basis
    #: is then the identity, never decomposed nor rotated.
    diagonal_a: bool = False
    #: A's and G's block layouts (None: a dense side; docs/solvers.md, "Blocked factors").
    layouts: tuple[Any, Any] = (None, None)

    def widths(self) -> tuple[int, int]:
        """(d_a, d_g)."""
        d_a = self.factor_a.shape[0] if self.layouts[0] is None else self.layouts[0].width
        d_g = self.factor_g.shape[0] if self.layouts[1] is None else self.layouts[1].width
        return d_a, d_g

    #: Whether this update refreshes the basis of A and of G, decided on every rank from the same all-reduced
    #: factors; each side's measures, one per unit (the side, or its blocks; None: not measured), and staleness
    #: (docs/solvers.md, "Adaptive refresh").
    refresh: tuple[bool, bool] = (True, True)
    measures: tuple[tuple[staleness.Measured, ...] | None, tuple[staleness.Measured, ...] | None] = (None, None)
    staleness: tuple[float | None, float | None] = (None, None)


class KFACAdamFamily(SolverFamily[KFACAdamInputs]):
    """Adam in the K-FAC eigenbasis: K-FAC's factors and exchange, an eigendecomposition at each update, per-step
    moments in the state. Registered with :func:`hylo.solvers.register_family` (docs/extending.md)."""

    name = "kfac_adam"
    state_type = KFACAdamState
    statistic = FACTORS
    section = KFACAdamConfig
    refreshes = True
    #: What :class:`hylo.HyLoOptimizer` runs under an adaptive optimizer when no solver is given: this family,
    #: updated every 3 steps with the warm-started refresh — the language-model bench's settings
    #: (docs/benchmarks.md, "The LM race with cheaper updates").
    adaptive_defaults = {"solver": "kfac_adam", "update_freq": 3, "basis_refresh": "power", "damping": 0.3}
    #: Adam's constants: the wrapped optimizer's own.
    inherited_options = {"adam_betas": "betas", "adam_eps": "eps"}
    #: The decisions.csv columns of :meth:`update_notes` (docs/profiling.md, "Files").
    note_columns = staleness.NOTE_COLUMNS
    #: K-FAC's family, whose batch factors, exchange and cost this family shares.
    kfac: ClassVar[KFACFamily] = KFACFamily()

    @property
    def solvers(self) -> tuple[str, ...]:
        """``"kfac_adam"``."""
        return ("kfac_adam",)

    def contribute(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> Contribution:
        """K-FAC's: each layer's batch factors, weighted by its sample count in the mean over ranks."""
        return self.kfac.contribute(jobs, context)

    def prepare(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[KFACAdamInputs]:
        """Each layer's batch factors blended into its running factors, with the state it held (moments to
        carry) and the options to apply (``context.options(KFACAdamConfig)``)."""
        options = context.options(KFACAdamConfig)
        factors = running_factors(jobs, received, context.factor_decay, self.name)
        inputs = [
            KFACAdamInputs(
                factor_a,
                factor_g,
                job.previous if isinstance(job.previous, KFACAdamState) else None,
                options,
                job.batch.math.diagonal_input_factor,
                factor_layouts(job),
            )
            for job, (factor_a, factor_g) in zip(jobs, factors, strict=True)
        ]
        return staleness.with_decisions(inputs)  # the adaptive refresh (docs/solvers.md, "Adaptive refresh")

    def cost(self, shape: LayerShape, solver: str, options: FamilyOptions) -> CostEstimate:
        """K-FAC's estimate with the eigen method, its solve the warm-started refresh's where ``basis_refresh`` is
        ``"power"`` (:data:`~hylo.numerics.POWER_COST`), plus the moments' elementwise work on the d_g·d_a
        entries a step."""
        kfac = self.kfac.cost(shape, "kfac", options.replaced(KFACConfig(kfac_method="eigen")))
        solve = basis_work(shape.d_a, shape.d_g, options(KFACAdamConfig).basis_refresh, shape.blocks)
        return dataclasses.replace(kfac, solve=solve, apply=kfac.apply + ELEMENTWISE_COST * shape.d_a * shape.d_g)

    def solve_cost(self, prepared: KFACAdamInputs) -> float:
        """The eigendecompositions' cost, or the warm-started refresh's (none for the identity basis), of the sides
        it refreshes (Σ sᵢ³ of a blocked side's blocks)."""
        if prepared.options.adam_basis == "identity":
            return 0.0
        refresh = "power" if warm_started(prepared) else "eigh"
        on = (not prepared.diagonal_a and prepared.refresh[0], prepared.refresh[1])
        sides = zip(prepared.widths(), prepared.layouts, on, strict=True)
        work = sum(cubes(d, layout.largest if layout else None) for d, layout, refreshes in sides if refreshes)
        return (POWER_COST if refresh == "power" else EIGH_COST) * work

    def solve(self, prepared: Sequence[KFACAdamInputs], context: UpdateContext) -> list[dict[str, Tensor]]:
        """Each factor's eigenbasis, batched by shape: an eigendecomposition, or with ``basis_refresh="power"`` from a
        layer's second update on its previous basis refined (:func:`~hylo.numerics.power_refresh_many`); the identity
        and the diagonal for a diagonal A (an embedding's); identity bases and unit eigenvalues for
        ``adam_basis="identity"``. An eigendecomposition that follows a previous basis is turned to it inside its
        degenerate eigenspaces (:func:`~hylo.numerics.aligned_many`), so that no rotation among equal eigenvalues
        mixes the moments; the shifted power step keeps them by itself (docs/solvers.md, "Degenerate eigenspaces")."""
        sides = [(p, side) for p in prepared for side in ("a", "g")]
        kinds = [basis_kind(p, side) for p, side in sides]
        # a blocked side's blocks are decomposed (or refreshed, or aligned) each alone, batched by size with every
        # other layer's (docs/solvers.md, "Blocked factors"); a dense side is one unit
        units = [blocks(side_factor(p, side), side_layout(p.layouts, side)) for p, side in sides]
        olds = [
            blocks(previous_basis(p, side), side_layout(p.layouts, side))
            if kind == "power" or p.previous is not None
            else []
            for (p, side), kind in zip(sides, kinds, strict=True)
        ]
        cold = [u for k, kind in enumerate(kinds) if kind == "eigh" for u in units[k]]
        hot = [k for k, kind in enumerate(kinds) if kind == "power"]
        decompositions = iter(eigh_many(cold))
        products = staleness.measured_products([sides[k] for k in hot])  # F·Q of the measure, reused
        refreshed = iter(
            power_refresh_many([u for k in hot for u in units[k]], [q for k in hot for q in olds[k]], products)
        )
        pieces: list[list[tuple[Tensor, Tensor]]] = []
        for k, ((p, side), kind) in enumerate(zip(sides, kinds, strict=True)):
            factor, layout = side_factor(p, side), side_layout(p.layouts, side)
            if kind == "eigh":
                pieces.append([next(decompositions) for _ in units[k]])
            elif kind == "power":
                pieces.append([next(refreshed)[:2] for _ in units[k]])
            elif kind == "kept":  # the held basis, whole (docs/solvers.md, "Adaptive refresh")
                pieces.append([staleness.kept_side(p, side)])
            elif kind == "identity":
                pieces.append(
                    [(factor.new_ones(p.widths()[SIDES[side]]), identity(factor, p.widths()[SIDES[side]], layout))]
                )
            else:  # a diagonal factor: its diagonal and the identity
                pieces.append(
                    [(diagonal(factor, layout).clamp_min(0.0), identity(factor, p.widths()[SIDES[side]], layout))]
                )
        followed = [k for k, (p, _) in enumerate(sides) if kinds[k] == "eigh" and p.previous is not None]
        turned = iter(
            aligned_many(
                [e for k in followed for e, _ in pieces[k]],
                [q for k in followed for _, q in pieces[k]],
                [q for k in followed for q in olds[k]],
            )
        )
        for k in followed:
            pieces[k] = [(e, next(turned)) for e, _ in pieces[k]]
        pairs = [joined_side(piece, side_layout(sides[k][0].layouts, sides[k][1])) for k, piece in enumerate(pieces)]
        return [
            {"evals_a": ea, "evecs_a": qa, "evals_g": eg, "evecs_g": qg}
            for (ea, qa), (eg, qg) in zip(pairs[::2], pairs[1::2], strict=True)
        ]

    def solution_template(self, prepared: KFACAdamInputs) -> dict[str, Tensor]:
        """Buffers for another rank's eigendecompositions."""
        return eigen_template(prepared.factor_a, prepared.factor_g, prepared.widths())

    def assemble(self, prepared: KFACAdamInputs, solution: Mapping[str, Tensor], context: UpdateContext) -> LayerState:
        """The state in the new basis, the moments carried into it (:meth:`assemble_all`)."""
        return self.assemble_all([prepared], [solution], context)[0]

    def assemble_all(
        self, prepared: Sequence[KFACAdamInputs], solutions: Sequence[Mapping[str, Tensor]], context: UpdateContext
    ) -> list[LayerState]:
        """Each state in its new basis, the moments carried into it batched across layers of one shape
        (:func:`carried_moments_many`)."""
        moments = carried_moments_many(
            [p.previous for p in prepared],
            [(s["evecs_a"], s["evecs_g"]) for s in solutions],
            [p.options.moment_carry for p in prepared],
            [p.widths()[::-1] for p in prepared],
            [p.refresh for p in prepared],
        )
        # fmt: off
        return [
            KFACAdamState(p.factor_a, p.factor_g, s["evals_a"], s["evecs_a"], s["evals_g"], s["evecs_g"], m, v, steps,
                          context.damping, AdamRule.of(p.options), staleness.held_after(p))
            for p, s, (m, v, steps) in zip(prepared, solutions, moments, strict=True)
        ]
        # fmt: on

    def update_notes(self, prepared: KFACAdamInputs) -> Mapping[str, object] | None:
        """Under ``refresh_tolerance``, at a layer's update that measured a held basis: per side whether it
        refreshed, its staleness and the updates it has now been kept (decisions.csv; docs/profiling.md)."""
        return staleness.notes(prepared)

    def carried(self, prepared: KFACAdamInputs) -> dict[str, Tensor]:
        """The running factors (the next update blends with them)."""
        return {"factor_a": prepared.factor_a, "factor_g": prepared.factor_g}

    def refresh(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[HeldState]:
        """The running factors blended with this step's batch factors; the bases and moments kept."""
        factors = running_factors(jobs, received, context.factor_decay, self.name)
        return refreshed_states(jobs, factors, (KFACAdamState,), self.name)

    def group_key(self, state: LayerState) -> Hashable:
        """The state's type and its rule (the kernel applies one rule)."""
        return type(state), getattr(state, "rule", None)

    def group_kernel(self, states: Sequence[LayerState], dtype: torch.dtype) -> GroupKernel:
        """:class:`AdamKernel`."""
        return AdamKernel([state for state in states if isinstance(state, KFACAdamState)], dtype)

    def state_bytes(self, d_a: int, d_g: int, itemsize: int, block: int | None = None) -> int | None:
        """K-FAC's state (blocked by ``block``) and the two moments (d_g·d_a numbers each)."""
        kfac = self.kfac.state_bytes(d_a, d_g, itemsize, block)
        assert kfac is not None
        return kfac + 2 * d_a * d_g * itemsize


register_family(KFACAdamFamily())
