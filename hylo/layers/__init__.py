"""The per-layer side: each layer type's math, capture hooks, per-sample rows and the layer-type registry.

- :mod:`~hylo.layers.math`: :class:`LayerMath`, the contract a layer type implements (public);
  :mod:`~hylo.layers.linear` (``nn.Linear``, and a Linear stored transposed: Hugging Face's
  ``Conv1D``), :mod:`~hylo.layers.conv` (Conv2d and Conv1d), :mod:`~hylo.layers.conv_transpose`,
  :mod:`~hylo.layers.embedding` and
  :mod:`~hylo.layers.attention`: the built-in types; :mod:`~hylo.layers.fused`: several layers of one module
  (:class:`~hylo.layers.fused.FusedLayers`), and :mod:`~hylo.layers.experts`: fused mixture-of-experts modules
  and their routers.
- :mod:`~hylo.layers.rows`: per-sample gradients (:class:`FactoredRows`, :class:`DenseRows`),
  what every low-rank solver works on; :mod:`~hylo.layers.gradmatrix`: ∇W read in parts.
- :mod:`~hylo.layers.capture`: the hooks that record a call's input and output gradient;
  :mod:`~hylo.layers.statistics`: what a hook reduces a call to; :mod:`~hylo.layers.batch`: a
  step's calls as an update reads them.
- :mod:`~hylo.layers.registry`: which module classes are preconditioned
  (:func:`register_layer_type`) and the walk over a model; :mod:`~hylo.layers.ties`: which
  parameters are tied (held by two modules), whose layers stay with the optimizer.
"""

from hylo.layers.batch import DAMPING_CONVENTIONS, DampingConvention, LayerBatch, LayerShape
from hylo.layers.conv import CONV_ROWS, DEFAULT_KFC_EXPONENT, DEFAULT_MAX_UNFOLD_MB, ConvMath, ConvRows
from hylo.layers.conv_transpose import ConvTransposeMath
from hylo.layers.embedding import EmbeddingMath
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.linear import LinearMath, TransposedLinearMath
from hylo.layers.math import LayerMath, with_ones
from hylo.layers.registry import LayerTypeHandle, layer_math, register_layer_type, unsupported_reason
from hylo.layers.rows import DenseRows, FactoredRows, OneHotRows, SampleRows
from hylo.layers.statistics import FACTORS, ROWS, CallStatistic, CapturedCall, CapturePlan

__all__ = [
    "CONV_ROWS",
    "DAMPING_CONVENTIONS",
    "DEFAULT_KFC_EXPONENT",
    "DEFAULT_MAX_UNFOLD_MB",
    "FACTORS",
    "ROWS",
    "CallStatistic",
    "CapturePlan",
    "CapturedCall",
    "ConvMath",
    "ConvRows",
    "ConvTransposeMath",
    "DampingConvention",
    "DenseRows",
    "EmbeddingMath",
    "FactoredRows",
    "GradMatrix",
    "LayerBatch",
    "LayerMath",
    "LayerShape",
    "LayerTypeHandle",
    "LinearMath",
    "OneHotRows",
    "SampleRows",
    "TransposedLinearMath",
    "layer_math",
    "register_layer_type",
    "unsupported_reason",
    "with_ones",
]
