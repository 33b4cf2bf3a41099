"""What a layer's gradient hook reduces one forward call to (docs/design.md, "Memory").

Every solver family needs one statistic of each call of a layer (:class:`CallStatistic`): the
K-FAC family the call's Kronecker factor sums (:data:`FACTORS`), the low-rank family its
per-sample rows (:data:`ROWS`). A step's :class:`CapturePlan` says which statistics a layer's
calls are reduced to in their output-gradient hook; :func:`capture_call` reduces a call when the
statistics take fewer bytes than its input and output gradient, and keeps the pair otherwise, so
either way the update can compute every planned statistic of the call (:class:`CapturedCall`).

Output gradients are multiplied by the plan's ``scale`` (1 over the loss scale) in the hook; the
batch (:mod:`hylo.layers.batch`) rescales them to the step's sample count at the update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import Tensor

from hylo.layers.blocks import call_factors, side_numbers, zero_factor
from hylo.layers.math import LayerMath, naming_layer
from hylo.layers.rows import DenseRows, FactoredRows, SampleRows, concat_rows
from hylo.layers.sampling import RowSample

T = TypeVar("T")


class CallStatistic(ABC, Generic[T]):
    """One statistic of a layer's forward calls that a solver family reads at an update."""

    #: The statistic's name (in messages and :attr:`CapturedCall.reduced`).
    name: ClassVar[str]

    @abstractmethod
    def numbers(self, math: LayerMath, rows: int, kfac_rows: int) -> int:
        """How many numbers one call's statistic holds (compared with the call's own bytes)."""

    @abstractmethod
    def of_call(self, math: LayerMath, x: Tensor, grad_out: Tensor, scale: float) -> T:
        """The statistic of one call, output gradients multiplied by ``scale``."""

    def of_sampled_call(
        self, math: LayerMath, x: Tensor, grad_out: Tensor, scale: float, sample: RowSample | None
    ) -> T:
        """The statistic of one call under the step's row ``sample`` (None: every row); a statistic that does not
        sample (this default) is :meth:`of_call`'s (docs/solvers.md, "Sampled factors")."""
        return self.of_call(math, x, grad_out, scale)

    @abstractmethod
    def rescaled(self, math: LayerMath, value: T, factor: float) -> T:
        """``value`` as if its output gradients had been multiplied by ``factor`` more."""

    @abstractmethod
    def merged(self, math: LayerMath, values: Sequence[T], rows: int, kfac_rows: int) -> T:
        """The step's statistic from its calls' (at the same output-gradient scale), over ``rows`` samples."""

    @abstractmethod
    def empty(self, math: LayerMath) -> T:
        """The statistic of a rank without rows."""

    @abstractmethod
    def tensors(self, value: T) -> list[Tensor]:
        """Every tensor ``value`` holds (memory accounting)."""


class KroneckerFactors(CallStatistic[tuple[Tensor, Tensor]]):
    """Σ a aᵀ and Σ g gᵀ of a call (:meth:`LayerMath.kfac_factors`); merged, the batch factors A and G."""

    name = "factors"

    def numbers(self, math: LayerMath, rows: int, kfac_rows: int) -> int:
        """d_a² + d_g² (Σ sᵢ² of a blocked side), whatever the call's size."""
        block_a, block_g = math.factor_blocks
        return side_numbers(math.d_a, block_a) + side_numbers(math.d_g, block_g)

    def of_call(self, math: LayerMath, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """The call's unnormalised factors (a blocked side's diagonal blocks, packed: :func:`call_factors`)."""
        if math.factor_blocks != (None, None):
            return call_factors(math, x, grad_out, scale)
        return math.kfac_factors(x, grad_out, scale)

    def of_sampled_call(
        self, math: LayerMath, x: Tensor, grad_out: Tensor, scale: float, sample: RowSample | None
    ) -> tuple[Tensor, Tensor]:
        """k·Σ a aᵀ and k·Σ g gᵀ over the sampled rows (an unbiased estimate of the call's sums), or every row's
        when ``sample`` is None or keeps them all (docs/solvers.md, "Sampled factors")."""
        part = None if sample is None else sample.of_call(math, x, grad_out)
        if sample is None or part is None:
            return self.of_call(math, x, grad_out, scale)
        factor_a, factor_g = self.of_call(math, *part, scale)
        return factor_a.mul_(sample.stride), factor_g.mul_(sample.stride)

    def rescaled(self, math: LayerMath, value: tuple[Tensor, Tensor], factor: float) -> tuple[Tensor, Tensor]:
        """G scales by ``factor``² (A does not depend on the output gradients)."""
        return value[0], value[1] * factor**2

    def merged(
        self, math: LayerMath, values: Sequence[tuple[Tensor, Tensor]], rows: int, kfac_rows: int
    ) -> tuple[Tensor, Tensor]:
        """A: the sum over calls divided by the K-FAC rows; G: divided by the samples."""
        a = torch.stack([value[0] for value in values]).sum(0) / kfac_rows
        g = torch.stack([value[1] for value in values]).sum(0) / rows
        return a, g

    def empty(self, math: LayerMath) -> tuple[Tensor, Tensor]:
        """Zero factors (packed where a side is blocked)."""
        device = math.weight.device
        return (
            zero_factor(math.d_a, math.factor_blocks[0], math.dtype, device),
            zero_factor(math.d_g, math.factor_blocks[1], math.dtype, device),
        )

    def tensors(self, value: tuple[Tensor, Tensor]) -> list[Tensor]:
        """Both sums."""
        return list(value)


class PerSampleRows(CallStatistic[SampleRows]):
    """The call's per-sample gradients (:meth:`LayerMath.lowrank_rows`); merged, the step's rows in call order."""

    name = "rows"

    def numbers(self, math: LayerMath, rows: int, kfac_rows: int) -> int:
        """n·(d_a + d_g) factored, n·d_a·d_g dense."""
        return rows * (math.d_a * math.d_g if math.dense_rows else math.d_a + math.d_g)

    def of_call(self, math: LayerMath, x: Tensor, grad_out: Tensor, scale: float) -> SampleRows:
        """The call's rows."""
        return math.lowrank_rows(x, grad_out, scale)

    def rescaled(self, math: LayerMath, value: SampleRows, factor: float) -> SampleRows:
        """Every row scaled by ``factor``."""
        return value.scaled(torch.full((value.count,), factor, dtype=torch.float64, device=math.weight.device))

    def merged(self, math: LayerMath, values: Sequence[SampleRows], rows: int, kfac_rows: int) -> SampleRows:
        """The calls' rows concatenated."""
        return concat_rows(values)

    def empty(self, math: LayerMath) -> SampleRows:
        """No rows, in the layer's form."""
        device = math.weight.device
        own = math.empty_rows()
        if own is not None:
            return own
        if math.dense_rows:
            return DenseRows(torch.zeros(0, math.d_g, math.d_a, dtype=math.dtype, device=device))
        return FactoredRows(
            torch.zeros(0, math.d_a, dtype=math.dtype, device=device),
            torch.zeros(0, math.d_g, dtype=math.dtype, device=device),
        )

    def tensors(self, value: SampleRows) -> list[Tensor]:
        """The rows' fields."""
        return list(value.fields().values())


#: The K-FAC family's statistic.
FACTORS = KroneckerFactors()
#: The low-rank family's statistic.
ROWS = PerSampleRows()


@dataclass(frozen=True)
class CapturePlan:
    """What a layer's gradient hook reduces a call to at this step: ``statistics`` (never empty), with
    output gradients multiplied by ``scale`` (1 over the loss scale)."""

    statistics: frozenset[CallStatistic[Any]]
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.statistics:
            raise ValueError("a capture plan reduces calls to at least one statistic (None keeps them raw)")


@dataclass(frozen=True)
class CapturedCall:
    """One forward call of a layer as an update uses it: its row counts and either its input and
    output gradient (``raw``) or the statistics its gradient hook reduced them to (``reduced``, by
    statistic, computed with output gradients multiplied by ``scale``; a raw call's statistics are computed at that
    scale too, then rescaled like a reduced call's)."""

    rows: int
    kfac_rows: int
    raw: tuple[Tensor, Tensor] | None = None
    reduced: Mapping[CallStatistic[Any], Any] = field(default_factory=dict)
    scale: float = 1.0
    #: The step's row sample its statistics are (or, kept raw, will be) computed under (None: every row).
    sample: RowSample | None = None

    @classmethod
    def of(cls, math: LayerMath, call: Call) -> CapturedCall:
        """``call`` itself, or an (input, output gradient) pair kept raw."""
        if isinstance(call, CapturedCall):
            return call
        x, grad_out = call
        return cls(*math.row_counts(x, grad_out), raw=(x, grad_out))

    def gives(self, statistic: CallStatistic[Any]) -> bool:
        """Whether the update can compute ``statistic`` from this call."""
        return self.raw is not None or statistic in self.reduced

    def tensors(self) -> list[Tensor]:
        """Every tensor the call holds."""
        held = list(self.raw or ())
        for statistic, value in self.reduced.items():
            held += statistic.tensors(value)
        return held


#: A captured call: reduced in its hook, or the (input, output gradient) pair.
Call = CapturedCall | tuple[Tensor, Tensor]


def capture_call(
    math: LayerMath, x: Tensor, grad_out: Tensor, plan: CapturePlan | None, sample: RowSample | None = None
) -> CapturedCall:
    """One call as the update needs it: reduced per ``plan`` when that takes fewer bytes than its input
    and output gradient, else kept raw (docs/design.md, "Memory").

    The rule keeps a Linear's low-rank calls raw (its rows are its input and output gradient) and
    reduces a convolution's (its rows and factors are far smaller than its feature maps), except
    where a K-FAC factor (d_a² numbers) outweighs a small batch's feature maps. ``sample``: the step's row
    sample of the layer, kept with the call either way, so that a call kept raw gives at the update the bits
    its hook would have (docs/solvers.md, "Sampled factors"). An error raised here (in the backward that runs
    the hook) names the layer.
    """
    with naming_layer(math):
        rows, kfac_rows = math.row_counts(x, grad_out)
        if plan is None:
            return CapturedCall(rows, kfac_rows, raw=(x, grad_out), sample=sample)
        statistics = sorted(plan.statistics, key=lambda statistic: statistic.name)
        numbers = sum(statistic.numbers(math, rows, kfac_rows) for statistic in statistics)
        raw_bytes = x.numel() * x.element_size() + grad_out.numel() * grad_out.element_size()
        if numbers * math.dtype.itemsize >= raw_bytes:
            return CapturedCall(rows, kfac_rows, raw=(x, grad_out), scale=plan.scale, sample=sample)
        reduced = {s: s.of_sampled_call(math, x, grad_out, plan.scale, sample) for s in statistics}
        return CapturedCall(rows, kfac_rows, reduced=reduced, scale=plan.scale, sample=sample)
