"""Kronecker factors from a strided sample of a call's rows (docs/solvers.md, "Sampled factors").

With ``factor_sample`` = 1/k (k > 1), a call's factors are k·Σ a aᵀ and k·Σ g gᵀ over the rows whose
index is ≡ o (mod k): a strided view of the call's rows, no copy. The offset o is drawn from the run's
seed, the step and the layer's name (:func:`row_sample`): a Python int, the same on every rank and after
a resume, so that each row is in the sample with probability exactly 1/k over the draw and the sampled
sums are unbiased. A call whose K-FAC rows do not exceed the layer's width max(d_a, d_g), or that has
fewer sampling units than k (:meth:`~hylo.layers.math.LayerMath.sampled_call`), keeps all its rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from torch import Tensor

from hylo.layers.math import LayerMath
from hylo.rules import Rule, is_real

#: How a call's rows are sampled: ``"strided"`` takes the rows ≡ o (mod k) (docs/solvers.md, "Sampled factors").
FACTOR_SAMPLERS = ("strided",)
#: How far 1/``factor_sample`` may lie from the integer k it names (1/3 is 0.333…).
STRIDE_TOLERANCE = 1e-6


def sample_stride(fraction: float) -> int:
    """k with ``fraction`` = 1/k; ``ValueError`` when there is none (1/``fraction`` not within
    :data:`STRIDE_TOLERANCE` of an integer)."""
    inverse = 1.0 / float(fraction)
    stride = round(inverse)
    if stride < 1 or abs(inverse - stride) > STRIDE_TOLERANCE:
        raise ValueError(f"factor_sample must be 1/k for an integer k >= 1 (1, 0.5, 0.25, 1/3, ...), got {fraction}")
    return stride


def is_stride(fraction: object) -> bool:
    """Whether ``fraction`` is a number 1/k in (0, 1] for an integer k (:func:`sample_stride`)."""
    if not is_real(fraction) or not 0.0 < float(fraction) <= 1.0:  # type: ignore[arg-type]
        return False
    try:
        sample_stride(float(fraction))  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


#: KFACConfig's ``factor_sample``: its doc and rule (docs/usage.md, "Options").
FACTOR_SAMPLE_DOC = (
    "the fraction 1/k of each call's rows its K-FAC factors are formed from, their sums multiplied by k (unbiased): "
    "the rows ≡ o (mod k) across the whole batch, the offset o drawn per layer and step from seed; a call with no "
    "more K-FAC rows than the layer's width max(d_a, d_g) keeps all of them; 1: every row, the exact factors"
)
FACTOR_SAMPLE_RULE = Rule(is_stride, "1/k for an integer k >= 1 (1, 0.5, 0.25, 1/3, ...)")
#: KFACConfig's ``factor_sampler``: its doc and rule.
FACTOR_SAMPLER_DOC = "how factor_sample picks a call's rows: 'strided', every k-th row from the drawn offset (a view)"
FACTOR_SAMPLER_RULE = Rule(lambda x: x in FACTOR_SAMPLERS, f"one of {FACTOR_SAMPLERS}")


@dataclass(frozen=True)
class RowSample:
    """The rows ≡ ``offset`` (mod ``stride``) of each call of a layer at one step, their sums multiplied by ``stride``."""

    stride: int
    offset: int

    def of_call(self, math: LayerMath, x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor] | None:
        """The call's sampled input and output gradient, or None when it keeps all its rows: its K-FAC rows do not
        exceed the layer's width max(d_a, d_g), or the layer cannot sample it (:meth:`LayerMath.sampled_call`)."""
        _, kfac_rows = math.row_counts(x, grad_out)
        if kfac_rows <= max(math.d_a, math.d_g):
            return None
        return math.sampled_call(x, grad_out, self.stride, self.offset)


def row_sample(fraction: float, sampler: str, seed: int, step: int, layer: str) -> RowSample | None:
    """Layer ``layer``'s sample at step ``step`` (None: every row, ``fraction`` 1): the offset is a hash of the seed,
    the step and the layer's name, uniform over 0..k−1, a pure function of values every rank holds and a checkpoint
    restores (docs/solvers.md, "Sampled factors")."""
    stride = sample_stride(fraction)
    if stride == 1:
        return None
    assert sampler in FACTOR_SAMPLERS, sampler
    digest = hashlib.blake2b(f"{seed}/{step}/{layer}".encode(), digest_size=8).digest()
    return RowSample(stride, int.from_bytes(digest, "little") % stride)
