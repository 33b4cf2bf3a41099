"""The step between updates per group of equal layers (docs/design.md, "The apply plan").

A family writes its step once, as its group kernel (:meth:`~hylo.solvers.base.SolverFamily.group_kernel`; a
family without one gets :class:`~hylo.solvers.kernel.LoopKernel`, each state's own ``advance``); a group of one is
the per-layer case (``grouped=False``, and the fallback when a grouped kernel raises). An :class:`ApplyPlan` is built from the held states when they change (an update, a refresh, a load:
the states' :meth:`~hylo.solvers.base.LayerState.plan_parts` say so) and used by every step until then: the
preconditioned layers grouped by (family, the family's :meth:`~hylo.solvers.base.SolverFamily.group_key`,
∇W's shape and bias, working dtype, device, and under FSDP2 the part of ∇W each rank holds), each group's
states stacked once by the family's :meth:`~hylo.solvers.base.SolverFamily.group_kernel`, and the check's
per-layer limits made device tensors once. A step then costs O(groups) operations, not O(layers): every
group's gradients stacked by two ``torch._foreach_copy_`` for the whole step, one batched apply per group (under
FSDP2 split around the ranks' exchange: the placement's ``kernels``), one batched product of the check's two sums
per group, one vector decision for all layers (:func:`~hylo.numerics.sound`), one ``where`` per group for the
raw-gradient fallback; the placement then applies ``kl_clip`` by one ``torch._foreach_mul_``, and the results
are written back by two ``torch._foreach_copy_`` (:func:`write_back`). No host synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor

from hylo.layers.gradmatrix import GradMatrix, GradShard
from hylo.layers.math import named_error
from hylo.numerics import STACK_CAP_MB, CheckLimits, check_limits, sound, unit_scales
from hylo.solvers import LayerState, family_named
from hylo.solvers.base import Clock, SolverFamily
from hylo.solvers.kernel import GroupKernel
from hylo.state import RegisteredLayer


@dataclasses.dataclass
class Group:
    """Layers applied by one kernel: positions ``start:stop`` of the plan's order, ``members`` of the ready list."""

    members: list[int]
    start: int
    stop: int
    kernel: GroupKernel
    #: The working dtype the gradients are stacked in.
    dtype: torch.dtype
    #: ∇W's (d_g, d_a) (this rank's rows or columns of it under FSDP2) and the width of its weight part (d_a − 1
    #: with a bias).
    shape: tuple[int, int]
    d_w: int
    #: The part of ∇W this rank holds under FSDP2, the same for every layer of the group (None: all of it).
    shard: GradShard | None = None


@dataclasses.dataclass
class ApplyPlan:
    """The ready layers grouped, their kernels and the check's limits, for as long as their states hold."""

    #: What the plan was built for: per ready layer, its name, gradient layout and state's plan parts.
    key: list[tuple[Any, ...]]
    groups: list[Group]
    #: Each layer's index among all registered layers, in plan order (None: all of them, in their order).
    order: Tensor | None
    #: Per layer in plan order, the limits its result is checked against.
    limits: CheckLimits
    #: 0 and 1 (long, 0-dim): a fallback counted without a cast.
    zero: Tensor
    one: Tensor
    #: [1, 2]: the powers of each layer's scale s that divide its check's two sums (⟨∇W, sV̂⟩, ‖sV̂‖²).
    powers: Tensor
    #: Positions in plan order of each ready layer (the inverse of ``order``), and as a device tensor.
    position: list[int]
    placed: Tensor


def _layout(grad: GradMatrix) -> tuple[Any, ...]:
    return grad.shape, grad.bias is not None, grad.dtype, grad.device


def plan_key(
    ready: Sequence[tuple[RegisteredLayer, GradMatrix]], states: Sequence[LayerState]
) -> list[tuple[Any, ...]]:
    """Per ready layer what a plan depends on (compared by identity for the states' parts)."""
    return [
        (layer.name, (*_layout(grad), grad.shard), state.plan_parts())
        for (layer, grad), state in zip(ready, states, strict=True)
    ]


def _same(key: list[tuple[Any, ...]], other: list[tuple[Any, ...]]) -> bool:
    if len(key) != len(other):
        return False
    for (name, layout, parts), (name2, layout2, parts2) in zip(key, other, strict=True):
        if name != name2 or layout != layout2 or len(parts) != len(parts2):
            return False
        if any(a is not b for a, b in zip(parts, parts2, strict=True)):
            return False
    return True


def build_plan(
    ready: Sequence[tuple[RegisteredLayer, GradMatrix]],
    states: Sequence[LayerState],
    indices: Sequence[int],
    total: int,
    key: list[tuple[Any, ...]],
    singles: bool = False,
    shards: Sequence[Hashable] | None = None,
) -> ApplyPlan:
    """Group the ready layers and build each group's kernel; groups are cut at :data:`~hylo.numerics.STACK_CAP_MB`
    of stacked gradients (twice that is stacked: ∇W and the check's scaled V̂; of the whole ∇W under FSDP2, so that
    every rank cuts alike), or, with ``singles``, hold one layer each. ``shards``: per ready layer, what says
    that its part of ∇W is another's on every rank (by default its own :class:`GradShard`), so that every rank
    groups alike."""
    buckets: dict[tuple[Hashable, ...], list[int]] = {}
    families: dict[tuple[Hashable, ...], SolverFamily[Any]] = {}
    for i, ((layer, grad), state) in enumerate(zip(ready, states, strict=True)):
        family = family_named(state.family)
        shard = grad.shard if shards is None else shards[i]
        bucket: tuple[Hashable, ...] = (state.family, family.group_key(state), _layout(grad), layer.math.dtype, shard)
        buckets.setdefault(bucket, []).append(i)
        families[bucket] = family
    groups: list[Group] = []
    order: list[int] = []
    for bucket, members in buckets.items():
        first, grad = ready[members[0]]
        dtype = first.math.dtype
        d_g, d_a = grad.shape
        whole = d_g * d_a if grad.shard is None else grad.shard.total * (d_a if grad.shard.axis == 0 else d_g)
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_chunk = 1 if singles else max(1, int(STACK_CAP_MB * 2**20 // max(1, 2 * whole * itemsize)))
        for begin in range(0, len(members), per_chunk):
            chunk = members[begin : begin + per_chunk]
            kernel = families[bucket].group_kernel([states[i] for i in chunk], dtype)
            start = len(order)
            order.extend(chunk)
            shape, d_w = (d_g, d_a), int(grad.weight.shape[1])
            groups.append(Group(chunk, start, len(order), kernel, dtype, shape, d_w, grad.shard))
    device = ready[0][1].device
    in_order = [states[i] for i in order]
    limits = check_limits([state.bound for state in in_order], [ready[i][0].math.dtype for i in order], device)
    position = [0] * len(order)
    for place, i in enumerate(order):
        position[i] = place
    full = [indices[i] for i in order]
    index = None if full == list(range(total)) else torch.tensor(full, dtype=torch.long).to(device)
    powers = torch.tensor([1.0, 2.0], dtype=torch.float64).to(device)
    zero, one = torch.tensor([0, 1], dtype=torch.long).to(device).unbind(0)
    placed = torch.tensor(position, dtype=torch.long).to(device)
    return ApplyPlan(key, groups, index, limits, zero, one, powers, position, placed)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What a step's check of its results decided and measured, per ready layer in the order of ``indices`` (their
    indices among the registered layers: a list, a device tensor, or None for all in order): ``flags``, 1 or True
    where a result fell back to its raw gradient (docs/reliability.md, "Fallbacks"), and ``terms``, the float64
    [⟨∇W, V̂⟩, ‖V̂‖²] of each result before ``kl_clip`` (over every rank's rows), which the fallback decision and
    the warning of docs/reliability.md, "A step that changes nothing" read."""

    indices: list[int] | Tensor | None
    flags: Tensor
    terms: Tensor


class KernelRun(Protocol):
    """How a step runs its groups' kernels: (the groups, their stacked gradients, their states now, the ready
    layers' names, the step's clock, whether each group runs on its own) → each group's results and successors
    (:func:`apply_groups`; under FSDP2 the kernels' partial products exchanged first)."""

    def __call__(
        self,
        groups: Sequence[Group],
        grads: Sequence[Tensor],
        states: Sequence[Sequence[LayerState]],
        names: Sequence[str],
        watch: Clock,
        alone: bool,
    ) -> list[tuple[Tensor, list[LayerState]]]:
        """Each group's (results, successors), in the order of ``groups``."""


class GroupedApply:
    """The step between updates per group of the layers a rank applies; it keeps the plan between steps.

    ``singles``: one layer a group (the kernels applied layer by layer, each on its own: an error names its layer);
    ``kernels``: how the groups' kernels run (:func:`apply_groups`, or a placement's exchange around them); ``combine``: how the check's terms of this
    rank's rows become every rank's (None: they are whole here); ``shards``: the ready layers' parts of ∇W as every
    rank knows them (:func:`build_plan`), asked when a plan is built."""

    def __init__(
        self,
        singles: bool = False,
        kernels: KernelRun | None = None,
        combine: Callable[[Tensor], Tensor] | None = None,
        shards: Callable[[Sequence[GradMatrix]], list[Hashable]] | None = None,
    ) -> None:
        self.plan: ApplyPlan | None = None
        self.singles = singles
        self.kernels = kernels or apply_groups
        self.combine = combine
        self.shards = shards

    def tensors(self) -> list[Tensor]:
        """The tensors the plan holds (its kernels' stacked copies and the check's limits)."""
        plan = self.plan
        if plan is None:
            return []
        held = [plan.order, plan.powers, plan.zero, plan.one, plan.placed]
        kernels = [t for group in plan.groups for t in group.kernel.tensors()]
        return kernels + plan.limits.tensors() + [t for t in held if t is not None]

    def plan_for(
        self,
        ready: Sequence[tuple[RegisteredLayer, GradMatrix]],
        states: Sequence[LayerState],
        indices: Sequence[int],
        total: int,
    ) -> ApplyPlan:
        """The current plan, rebuilt when the ready layers, their gradients' layout or their states changed."""
        key = plan_key(ready, states)
        if self.plan is None or not _same(self.plan.key, key):
            shards = None if self.shards is None else self.shards([grad for _, grad in ready])
            self.plan = build_plan(ready, states, indices, total, key, self.singles, shards)
        return self.plan

    def checked(
        self,
        ready: Sequence[tuple[RegisteredLayer, GradMatrix]],
        states: Sequence[LayerState],
        indices: Sequence[int],
        norms: Tensor,
        watch: Clock,
    ) -> GroupedResults:
        """The ready layers applied per group and checked, the raw gradient where a result is not sound, before
        ``kl_clip`` (the placement applies it to :attr:`GroupedResults.stacks`). ``indices``: each ready layer's
        index among the registered layers; ``norms``: every registered layer's ‖∇W‖ (float64, over every rank's
        rows). Raises what a kernel raises (with ``singles``, naming the layer)."""
        plan = self.plan_for(ready, states, indices, len(norms))
        stacks = _buffers(plan.groups, norms.device)
        weights: list[tuple[Tensor, Tensor]] = []
        biases: list[tuple[Tensor, Tensor]] = []
        for group, stack in zip(plan.groups, stacks, strict=True):
            for j, i in enumerate(group.members):
                grad = ready[i][1]
                weights.append((stack[j, 0, :, : group.d_w], grad.weight))
                if grad.bias is not None:
                    biases.append((stack[j, 0, :, group.d_w], grad.bias))
        for pairs in (weights, biases):
            if pairs:
                torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
        if plan.order is not None:
            norms = norms.index_select(0, plan.order)
        spans = [(g.start, g.stop, g.dtype) for g in plan.groups]
        scales, scale64 = unit_scales(norms, plan.limits, spans)
        members = [[states[i] for i in group.members] for group in plan.groups]
        names = [layer.name for layer, _ in ready]
        applied = self.kernels(plan.groups, [stack[:, 0] for stack in stacks], members, names, watch, self.singles)
        sums: list[Tensor] = []
        successors: dict[str, LayerState] = {}
        for group, stack, scale, before, (result, after) in zip(
            plan.groups, stacks, scales, members, applied, strict=True
        ):
            for i, old, new in zip(group.members, before, after, strict=True):
                if new is not old:
                    successors[ready[i][0].name] = new
            sums.append(result_sums(stack, result, scale))
        terms = torch.cat(sums).to(torch.float64) / scale64.unsqueeze(1).pow(plan.powers)
        if self.combine is not None:
            terms = self.combine(terms)
        ok = sound(terms, norms, plan.limits)
        written = [  # in place: a kernel's result is its own (GroupKernel.apply)
            torch.where(ok[group.start : group.stop].view(-1, 1, 1), result, stack[:, 0], out=result)
            for group, (result, _), stack in zip(plan.groups, applied, stacks, strict=True)
        ]
        return GroupedResults(plan, written, ok, terms, norms, successors)


@dataclasses.dataclass(frozen=True)
class GroupedResults:
    """The checked results of a grouped step before ``kl_clip``, in plan order: each group's stacked results (the
    raw gradient where not ``ok``), the verdict, the float64 terms [⟨∇W, V̂⟩, ‖V̂‖²] and ‖∇W‖ of each layer, and
    the successors of the states that advance."""

    plan: ApplyPlan
    stacks: list[Tensor]
    ok: Tensor
    terms: Tensor
    norms: Tensor
    successors: dict[str, LayerState]

    def in_ready_order(self) -> list[Tensor]:
        """Each ready layer's result (a view of its group's stack), in the order of the ready list."""
        by_place = [w for stack in self.stacks for w in stack.unbind(0)]
        return [by_place[place] for place in self.plan.position]

    @property
    def fell(self) -> Tensor:
        """1 where a result fell back to its raw gradient, 0 elsewhere (long), in plan order."""
        return torch.where(self.ok, self.plan.zero, self.plan.one)

    @property
    def placed(self) -> Tensor | None:
        """The row in plan order of each ready layer (None: row i is ready layer i)."""
        plan = self.plan
        return plan.placed if plan.order is not None or len(plan.groups) > 1 else None

    def checked(self) -> Checked:
        """What the check decided and measured, by the layers' indices among the registered layers."""
        return Checked(self.plan.order, self.fell, self.terms)


def result_sums(stack: Tensor, results: Tensor, scales: Tensor) -> Tensor:
    """The check's two sums [⟨∇W, U⟩, ‖U‖²] of every layer of a group, U = sV̂, in the working dtype ((k, 2)):
    ``results`` (V̂, (k, d_g, d_a)) scaled by each layer's ``scales`` (:func:`~hylo.numerics.unit_scales`) into
    ``stack[:, 1]``, beside ∇W in ``stack[:, 0]``, and both sums in one batched product. Divided by s and s² in
    float64 they are the terms :func:`~hylo.numerics.sound` judges; sums over rows, so that ranks holding rows of
    one ∇W add theirs up (docs/reliability.md, "Fallbacks")."""
    torch.mul(results, scales.view(-1, 1, 1), out=stack[:, 1])
    flat = stack.flatten(2)
    return torch.bmm(flat[:, 1:], flat.mT).flatten(1)


def _buffers(groups: Sequence[Group], device: torch.device) -> list[Tensor]:
    """Each group's (k, 2, d_g, d_a) stack: ∇W, then the check's scaled V̂; one allocation per dtype."""
    sizes = [(g.stop - g.start) * 2 * g.shape[0] * g.shape[1] for g in groups]
    flat: dict[torch.dtype, Tensor] = {}
    for dtype in dict.fromkeys(g.dtype for g in groups):
        total = sum(size for size, g in zip(sizes, groups, strict=True) if g.dtype == dtype)
        flat[dtype] = torch.empty(total, dtype=dtype, device=device)
    offsets = dict.fromkeys(flat, 0)
    stacks = []
    for size, g in zip(sizes, groups, strict=True):
        begin = offsets[g.dtype]
        offsets[g.dtype] = begin + size
        stacks.append(flat[g.dtype][begin : begin + size].view(g.stop - g.start, 2, *g.shape))
    return stacks


def apply_groups(
    groups: Sequence[Group],
    grads: Sequence[Tensor],
    states: Sequence[Sequence[LayerState]],
    names: Sequence[str],
    watch: Clock,
    alone: bool,
) -> list[tuple[Tensor, list[LayerState]]]:
    """Every group's kernel applied: the groups of one kernel type in one :meth:`GroupKernel.apply_all`, or with
    ``alone`` each on its own, an error of a group of one naming its layer (docs/reliability.md, "Registration")."""
    out: dict[int, tuple[Tensor, list[LayerState]]] = {}
    for members in kernel_batches(groups, alone):
        first = groups[members[0]]
        with naming(names, first.members if alone else [], states[members[0]]):
            results = type(first.kernel).apply_all(
                [groups[i].kernel for i in members], [grads[i] for i in members], [states[i] for i in members]
            )
        out.update(zip(members, results, strict=True))
    return [out[i] for i in range(len(groups))]


def kernel_batches(groups: Sequence[Group], alone: bool) -> list[list[int]]:
    """The positions of ``groups`` run in one call: the groups of one kernel type together, or with ``alone`` each
    on its own."""
    batches: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        batches.setdefault(i if alone else type(group.kernel), []).append(i)
    return list(batches.values())


@contextmanager
def naming(names: Sequence[str], members: Sequence[int], states: Sequence[LayerState]) -> Iterator[None]:
    """An error raised inside names its layer where ``members`` (positions in ``names``) is a group of one
    (docs/reliability.md, "Registration")."""
    try:
        yield
    except Exception as err:
        named = named_error(err, names[members[0]], type(states[0]).__name__) if len(members) == 1 else None
        if named is None:
            raise
        raise named from err


def write_back(
    layers: Sequence[RegisteredLayer], written: Mapping[str, Tensor], grads: Mapping[str, GradMatrix]
) -> None:
    """Write every layer's result into its ``.grad`` in place: two ``torch._foreach_copy_`` into the ∇W parts the
    step read (``grads``) where they are views of the ``.grad`` (every built-in layer type but transposed
    convolutions), the layer's own ``set_grad_matrix`` for the others (and for a type that writes its own way)."""
    weights: list[tuple[Tensor, Tensor]] = []
    biases: list[tuple[Tensor, Tensor]] = []
    for layer in layers:
        result = written.get(layer.name)
        if result is None:
            continue
        parts = grads[layer.name]
        if not _hylo_writer(type(layer.math)) or not _writes_through(layer, parts):
            layer.math.set_grad_matrix(result)
            continue
        d_w = parts.weight.shape[1]
        weights.append((parts.weight, result[:, :d_w]))
        if parts.bias is not None:
            biases.append((parts.bias, result[:, d_w]))
    for pairs in (weights, biases):
        if pairs:
            torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])


@functools.cache
def _hylo_writer(kind: type) -> bool:
    """Whether a layer type writes its gradient as hylo's own types do (a type of another package that overrides
    ``set_grad_matrix`` or ``write_weight_matrix`` has it called: its writing may do more than a copy)."""
    return all(
        getattr(kind, name).__module__.startswith("hylo.") for name in ("set_grad_matrix", "write_weight_matrix")
    )


def _writes_through(layer: RegisteredLayer, parts: GradMatrix) -> bool:
    """Whether ∇W's parts are views of the parameters' ``.grad`` (writing them writes the gradient)."""
    weight_grad, bias_grad = layer.math.weight_grad(), layer.math.bias_grad()
    if weight_grad is None or not _shares(parts.weight, weight_grad):
        return False
    return parts.bias is None or (bias_grad is not None and _shares(parts.bias, bias_grad))


def _shares(view: Tensor, tensor: Tensor) -> bool:
    return view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
