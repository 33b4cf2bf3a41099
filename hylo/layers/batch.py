"""One layer's captured calls at an update, and its shape for the cost model (docs/design.md, "Memory").

A :class:`LayerBatch` counts a step's calls once and gives each solver family the statistic it
needs (:meth:`LayerBatch.collect`), with output gradients rescaled to g = n·∂L/∂s for the step's
n samples (and KAISA's ratio under ``damping_convention="kaisa"``, docs/solvers.md, "K-FAC
conventions"). A :class:`LayerShape` is what the hybrid policy's cost model reads of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

from hylo.layers.math import LayerMath, naming_layer
from hylo.layers.statistics import Call, CallStatistic, CapturedCall

#: What damping λ is measured against (docs/solvers.md, "K-FAC conventions"): hylo's Fisher of
#: g = n·∂L/∂s, or KAISA's factors of the raw output gradients (convolutions: both divided by L).
DampingConvention = Literal["hylo", "kaisa"]
DAMPING_CONVENTIONS: tuple[DampingConvention, ...] = get_args(DampingConvention)

T = TypeVar("T")


@dataclass(frozen=True)
class LayerShape:
    """What the cost model needs of a layer at an update: its dimensions, rows and world size.

    ``rows`` are the local samples n, ``kfac_rows`` the K-FAC rows n_k (samples × output
    positions for a convolution), ``kept_local`` the rows r a rank keeps on the KID/KIS path,
    ``dense_rows`` whether the low-rank rows are whole per-sample gradients, ``row_work`` the
    multiply-adds of building them, ``itemsize`` the bytes per number sent, and ``blocks`` the
    maximum block sizes of its K-FAC factors, A's and G's (:attr:`LayerMath.factor_blocks`).
    """

    d_a: int
    d_g: int
    rows: int = 0
    kfac_rows: int = 0
    kept_local: int = 0
    world_size: int = 1
    dense_rows: bool = False
    row_work: float = 0.0
    itemsize: int = 4
    blocks: tuple[int | None, int | None] = (None, None)

    @classmethod
    def of(cls, math: LayerMath, rows: int, kfac_rows: int, kept: int, world_size: int) -> LayerShape:
        """The shape of ``math``'s layer with these row counts, its rows gathered from ``world_size`` ranks."""
        return cls(
            math.d_a,
            math.d_g,
            rows,
            kfac_rows,
            kept,
            world_size,
            math.dense_rows,
            math.row_work(rows, kfac_rows),
            math.dtype.itemsize,
            math.factor_blocks,
        )

    @property
    def kept(self) -> int:
        """Rows m = P·r of the gathered KID/KIS solve."""
        return self.world_size * self.kept_local

    @property
    def row_width(self) -> int:
        """Numbers per low-rank row: d_a + d_g factored, d_a·d_g dense."""
        return self.d_a * self.d_g if self.dense_rows else self.d_a + self.d_g

    @property
    def step_work(self) -> float:
        """Multiply-adds of the layer's own forward and backward in one step, 3·n_k·d_a·d_g."""
        return 3.0 * self.kfac_rows * self.d_a * self.d_g


@dataclass(frozen=True)
class LayerBatch:
    """One layer's captured calls at an update step, with its row counts computed once.

    The same record feeds the hybrid policy (its shape and costs) and the update stage (the
    statistics its families read). ``rows`` are the step's samples n over all calls, ``kfac_rows``
    the K-FAC rows n_k (samples × output positions for a convolution) and ``kept`` the rows r a
    rank keeps on the KID/KIS path.
    """

    math: LayerMath
    calls: tuple[CapturedCall, ...]
    rows: int
    kfac_rows: int
    kept: int
    #: The loss scale of the step's backward passes (a GradScaler's): output gradients are divided by it.
    grad_scale: float = 1.0
    #: ``"kaisa"``: the Fisher is divided by :meth:`LayerMath.kaisa_ratio` (docs/solvers.md, "K-FAC conventions").
    convention: DampingConvention = "hylo"
    #: The n output gradients are scaled by when it is not :attr:`rows`: a routed layer's rows over all ranks over
    #: the world size (:attr:`LayerMath.routed_rows`; docs/moe.md, "P ranks").
    row_scale: float | None = None

    @classmethod
    def of(
        cls,
        math: LayerMath,
        calls: Sequence[Call],
        rows_kept: Callable[[int], int],
        grad_scale: float = 1.0,
        convention: DampingConvention = "hylo",
    ) -> LayerBatch:
        """Count the rows of this step's calls, reduced or (input, output gradient) pairs (none: a rank without rows);
        an error of the layer's math names the layer."""
        with naming_layer(math):
            captured = tuple(CapturedCall.of(math, call) for call in calls)
        rows = sum(c.rows for c in captured)
        kept = rows_kept(rows) if rows else 0
        return cls(math, captured, rows, sum(c.kfac_rows for c in captured), kept, grad_scale, convention)

    def shape(self, world_size: int, kept: int | None = None) -> LayerShape:
        """The layer's shape for the cost model, its rows gathered from ``world_size`` ranks; ``kept``: the rows a
        rank is expected to keep, when not :attr:`kept` (``rank_ratio="auto"``)."""
        return LayerShape.of(self.math, self.rows, self.kfac_rows, self.kept if kept is None else kept, world_size)

    def gives(self, statistic: CallStatistic[Any]) -> bool:
        """Whether every call can give ``statistic`` (kept raw, or reduced to it)."""
        return all(call.gives(statistic) for call in self.calls)

    @property
    def _g_scale(self) -> float:
        """What output gradients are multiplied by: n over the loss scale (docs/solvers.md, "Notation");
        under KAISA's convention also 1/√c, which divides every solver's Fisher by c = ``kaisa_ratio``."""
        scale = float(self.rows if self.row_scale is None else self.row_scale) / self.grad_scale
        if self.convention == "kaisa":
            scale /= self.math.kaisa_ratio(self.rows, self.kfac_rows) ** 0.5
        return scale

    def collect(self, statistic: CallStatistic[T]) -> T:
        """``statistic`` over all calls, output gradients scaled by the step's sample count (empty without rows);
        an error raised here names the layer."""
        math = self.math
        with naming_layer(math):
            if not self.calls or not self.rows:
                return statistic.empty(math)
            scale = self._g_scale
            values = []
            for call in self.calls:
                # with g·call.scale, rescaled to g·scale: a call kept raw gives what its hook would have reduced it
                # to, bit for bit, so that how a step's rows fall into calls changes nothing but the sums' rounding
                # (docs/usage.md, "Gradient accumulation")
                if statistic in call.reduced:
                    values.append(statistic.rescaled(math, call.reduced[statistic], scale / call.scale))
                elif call.raw is not None:
                    value = statistic.of_sampled_call(math, *call.raw, call.scale, call.sample)
                    values.append(statistic.rescaled(math, value, scale / call.scale))
                else:
                    raise RuntimeError(
                        f"layer {math.name!r}: this step's calls were reduced in the backward without their "
                        f"{statistic.name}; the update must use the path they were reduced for"
                    )
            return statistic.merged(math, values, self.rows, self.kfac_rows)
