"""The per-layer-type contract: how a layer's inputs and output gradients become rows and factors.

docs/solvers.md, "Notation": a layer has weight W of shape (d_g, d_a); with a bias, the bias is
W's last column and every activation row gets a trailing 1. From a mean-reduced loss over n rows,
``g_i = n · ∂L/∂s_i`` so that ∇W = (1/n) Σ g_i a_iᵀ. When a layer runs several times in one step
(gradient accumulation, shared weights) n is the step's total, passed in as ``scale`` by the caller.

:class:`LayerMath` is public: a new layer type is a subclass registered with
:func:`hylo.register_layer_type` (docs/extending.md). The built-in types are in
:mod:`hylo.layers.linear`, :mod:`hylo.layers.conv`, :mod:`hylo.layers.conv_transpose`,
:mod:`hylo.layers.embedding` and :mod:`hylo.layers.attention`.
"""

from __future__ import annotations

import functools
import math
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from hylo.layers.gradmatrix import GradMatrix, GradShard
from hylo.layers.rows import SampleRows
from hylo.layers.sharded import grad_shard, is_sharded, local, unsupported_layout
from hylo.numerics import working_dtype
from hylo.rules import Rule

_Method = TypeVar("_Method", bound=Callable[..., Any])

#: KFACConfig's ``factor_dtype``: the dtypes the products of the K-FAC statistics may run in, its doc and rule.
FACTOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FACTOR_DTYPE_DOC = (
    "the dtype of the products that form each call's K-FAC statistics Σ a aᵀ and Σ g gᵀ (rows cast to it, sums "
    "returned in the working dtype, where the running factors and their decompositions stay), as kfac-pytorch's "
    "factor_dtype: 'bfloat16' runs them on bf16 units (a GPU's tensor cores, a CPU's AVX512-BF16 or AMX) at a "
    'rounding of about 2⁻⁹ of each entry (docs/solvers.md, "Low-precision statistics"); None: the working dtype'
)
FACTOR_DTYPE_RULE = Rule(lambda x: x is None or x in FACTOR_DTYPES, f"None or one of {tuple(FACTOR_DTYPES)}")

#: The :class:`LayerMath` methods whose errors name the layer (:func:`named_error`), in every subclass too.
NAMED_METHODS = (
    "row_counts",
    "lowrank_rows",
    "empty_rows",
    "row_work",
    "kfac_factors",
    "sampled_call",
    "kaisa_ratio",
    "exact_rows_math",
    "grad_tensor",
    "weight_grad",
    "bias_grad",
    "sharding_problem",
    "grad_shard",
    "grad_parts",
    "weight_matrix",
    "write_weight_matrix",
    "grad_matrix",
    "set_grad_matrix",
)


def named_error(err: Exception, name: str, kind: str) -> Exception | None:
    """``err`` as an error whose message names the layer ``name`` (of module type ``kind``), or None when
    its message names the layer already (docs/reliability.md, "Registration").

    The new error is of ``err``'s type where that type takes a message alone (so that what catches
    the type still does: ``torch.OutOfMemoryError``, ``LinAlgError``), a ``RuntimeError`` otherwise;
    raise it ``from err``, which keeps the original and its traceback as the cause.
    """
    text = str(err)
    if getattr(err, "hylo_layer", None) is not None or f"layer {name!r}" in text:
        return None
    message = f"layer {name!r} ({kind}): {text}"
    try:
        named = type(err)(message)
    except Exception:
        named = RuntimeError(message)
    if str(named) != message:  # e.g. KeyError quotes its message
        named = RuntimeError(message)
    setattr(named, "hylo_layer", name)  # noqa: B010 (an attribute no exception class declares)
    return named


def _raise_named(math: LayerMath, err: Exception) -> None:
    """Raise ``err`` renamed after ``math``'s layer (chained), or nothing when it names the layer already."""
    module = getattr(math, "module", None)
    named = named_error(err, getattr(math, "name", type(math).__name__), type(module).__name__)
    if named is not None:
        raise named from err


@contextmanager
def naming_layer(math: LayerMath) -> Iterator[None]:
    """Errors raised inside name ``math``'s layer (:func:`named_error`)."""
    try:
        yield
    except Exception as err:
        _raise_named(math, err)
        raise


def _names_layer(method: _Method) -> _Method:
    """``method`` of a :class:`LayerMath`, its errors naming the layer."""
    if getattr(method, "_hylo_names_layer", False):
        return method

    @functools.wraps(method)
    def named(self: LayerMath, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as err:
            _raise_named(self, err)
            raise

    setattr(named, "_hylo_names_layer", True)  # noqa: B010
    return named  # type: ignore[return-value]


def with_ones(a: Tensor) -> Tensor:
    """Rows of ``a`` with a trailing 1 (the bias column of hylo's W)."""
    return torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)


class LayerMath(ABC):
    """Shapes, rows, Kronecker factors and gradient access of one supported module (docs/extending.md).

    A layer type implements :meth:`row_counts`, :meth:`lowrank_rows`, :meth:`row_work` and
    :meth:`kfac_factors` from one call's input and output gradient. Where the module's parameters
    are not a Linear's ``weight`` (d_g × d_in) and ``bias``, it also says which tensors form hylo's
    W (the :attr:`weight` and :attr:`bias` properties) and where ∇W is read and written in place
    (:meth:`weight_grad`, :meth:`bias_grad`, as views of the parameters' ``.grad``, and
    :meth:`grad_tensor`), and where the weight's gradient is not ∇W's weight part reshaped, how one
    maps to the other (:meth:`weight_matrix`, :meth:`write_weight_matrix`). The rest has defaults: :attr:`dense_rows`, :attr:`rows_form`,
    :meth:`kaisa_ratio`, :meth:`exact_rows_math`, :attr:`module_type`.

    An error raised by one of these methods (:data:`NAMED_METHODS`, in a subclass too) names the
    layer: it is re-raised as ``layer '<name>' (<module type>): <message>``, chained to the original
    (docs/reliability.md, "Registration").
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in NAMED_METHODS:
            method = cls.__dict__.get(name)
            if isinstance(method, types.FunctionType):
                setattr(cls, name, _names_layer(method))

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        #: The layer's name in messages (the registry sets the module's name in the model).
        self.name = type(module).__name__
        self._shapes = self._current_shapes()
        weight_shape, bias_shape = self._shapes
        self.d_g = int(weight_shape[0])
        self.d_a = math.prod(weight_shape[1:]) + (1 if bias_shape is not None else 0)

    @property
    def weight(self) -> Tensor:
        """The module's current weight (read on every access: replacing the Parameter is followed)."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight

    @property
    def bias(self) -> Tensor | None:
        """The module's current bias, or None (also for modules without a ``bias`` attribute)."""
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, Tensor) else None

    def _current_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """The weight's and bias's shapes now (the bias's None without a bias)."""
        weight, bias = self.weight, self.bias
        return tuple(weight.shape), None if bias is None else tuple(bias.shape)

    def _check_shapes(self) -> None:
        """Raise ``ValueError`` if the weight or bias no longer has its shape at registration."""
        now = self._current_shapes()
        if now != self._shapes:
            raise ValueError(
                f"layer {self.name!r}: weight/bias shapes are now {now[0]}/{now[1]}, registered as "
                f"{self._shapes[0]}/{self._shapes[1]}; hylo's factor sizes are fixed at registration: "
                "create a new HyLoPreconditioner after changing a layer's shape"
            )

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of factor and kernel math for this layer (float32 at least)."""
        return working_dtype(self.weight.dtype)

    @abstractmethod
    def row_counts(self, x: Tensor, grad_out: Tensor) -> tuple[int, int]:
        """Rows of the low-rank path (samples) and of the K-FAC factors (incl. positions)."""

    #: Whether the low-rank rows are whole per-sample gradient matrices (:class:`DenseRows`).
    dense_rows: bool = False
    #: Whether the rows are the tokens routed to the layer (an expert's): a share of the samples the loss averages
    #: over, which differs from rank to rank, so output gradients are scaled by the layer's rows over all ranks
    #: divided by the world size rather than by the rank's own (docs/moe.md, "P ranks").
    routed_rows: bool = False
    #: Whether the input factor A is diagonal by construction (one-hot inputs: an embedding's token counts), so that
    #: its eigenbasis is the identity and a solver that keeps a basis need not decompose it (docs/solvers.md,
    #: "Embeddings").
    diagonal_input_factor: bool = False
    #: What the low-rank rows are, in the studies' ``reference`` column: ``"exact"`` per-sample gradients,
    #: or the name of a surrogate (a convolution's ``conv_rows``).
    rows_form: str = "exact"
    #: How many maps of equal width the layer's outputs concatenate (a fused expert's gate and up projections: 2).
    #: With ``split_gate_up`` its G is held as one block per map, as K-FAC holds separate layers (docs/moe.md,
    #: "Gate and up").
    output_parts: int = 1
    #: The maximum block sizes of the layer's K-FAC factors, A's and G's (None: whole), which the statistic reads
    #: when it forms them (:func:`~hylo.layers.blocks.layer_blocks`; docs/solvers.md, "Blocked factors").
    factor_blocks: tuple[int | None, int | None] = (None, None)
    #: The dtype the products of the layer's K-FAC statistics run in (``factor_dtype``; None: the working dtype):
    #: :meth:`gram` (docs/solvers.md, "Low-precision statistics").
    factor_dtype: torch.dtype | None = None

    def gram(self, rows: Tensor) -> Tensor:
        """Σ r rᵀ over ``rows`` (n, d), in the rows' dtype; the product in :attr:`factor_dtype` where it is another."""
        if self.factor_dtype is None or self.factor_dtype == rows.dtype:
            return rows.mT @ rows
        low = rows.to(self.factor_dtype)
        return (low.mT @ low).to(rows.dtype)

    @abstractmethod
    def lowrank_rows(self, x: Tensor, grad_out: Tensor, scale: float) -> SampleRows:
        """Per-sample gradients of one call (output gradients scaled by ``scale``) for the SMW solvers."""

    def empty_rows(self) -> SampleRows | None:
        """This layer's rows when a rank has none, if not the plain empty factored or dense ones (None)."""
        return None

    @abstractmethod
    def row_work(self, rows: int, kfac_rows: int) -> float:
        """Multiply-adds to build the low-rank rows of ``rows`` samples (``kfac_rows`` positions)."""

    @abstractmethod
    def kfac_factors(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Unnormalised Kronecker factors Σ a aᵀ (d_a×d_a) and Σ g gᵀ (d_g×d_g), g scaled by ``scale``.

        Divide the first by the K-FAC row count and the second by the sample count (see
        :meth:`row_counts`) summed over the step's calls.
        """

    def sampled_call(self, x: Tensor, grad_out: Tensor, stride: int, offset: int) -> tuple[Tensor, Tensor] | None:
        """The call restricted to its sampling units (a Linear's rows, a convolution's samples) ≡ ``offset``
        (mod ``stride``), for :meth:`kfac_factors` (docs/solvers.md, "Sampled factors"); None: all its rows are
        kept (this default, and a call with fewer units than ``stride``)."""
        return None

    def kaisa_ratio(self, rows: int, kfac_rows: int) -> float:
        """c = hylo's Fisher over KAISA's on this layer: n², KAISA's G being of the raw ∂L/∂s = g/n."""
        return float(rows) ** 2

    def layer_output(self, output: Any) -> Tensor | None:
        """The tensor of the module's output that is the layer's output s, whose gradient the hooks capture: the
        output itself when it is a tensor (a module returning several, such as a router's (logits, weights,
        index), says which), or None: nothing to capture in this call."""
        return output if isinstance(output, Tensor) else None

    def exact_rows_math(self) -> LayerMath | None:
        """The same layer with rows that are its exact per-sample gradients, where :meth:`lowrank_rows` are
        a surrogate (the studies' reference); None when they already are exact."""
        return None

    @property
    def module_type(self) -> str:
        """The layer's kind in summaries: the module's class name."""
        return type(self.module).__name__

    def grad_tensor(self) -> Tensor | None:
        """The ``.grad`` whose identity and version tell that a backward reached the layer (this rank's part,
        under FSDP2)."""
        return local(self.weight.grad)

    def weight_grad(self) -> Tensor | None:
        """The weight's gradient (written in place), or None; this rank's rows under FSDP2."""
        return local(self.weight.grad)

    def bias_grad(self) -> Tensor | None:
        """The bias's gradient (written in place), or None; this rank's rows under FSDP2."""
        bias = self.bias
        return None if bias is None else local(bias.grad)

    def sharding_problem(self) -> str | None:
        """Why this layer's FSDP2-sharded parameters cannot be preconditioned by rows, or None (also when
        unsharded; docs/distributed.md, "FSDP2")."""
        weight, bias = self.weight, self.bias
        if not is_sharded(weight) and not is_sharded(bias):
            return None
        cls = type(self)
        own = all(
            getattr(cls, name) is getattr(LayerMath, name)
            for name in (
                "weight",
                "bias",
                "grad_tensor",
                "weight_grad",
                "bias_grad",
                "grad_parts",
                "set_grad_matrix",
                "weight_matrix",
                "write_weight_matrix",
            )
        )
        return unsupported_layout(weight, bias, self.d_g, own)

    def grad_shard(self) -> GradShard | None:
        """The rows of ∇W this rank holds under FSDP2 (the weight's dim-0 shard), or None when unsharded."""
        return grad_shard(self.weight)

    def grad_parts(self) -> GradMatrix | None:
        """∇W as views of the weight's and bias's gradients (docs/design.md, "Memory"), or None before backward;
        under FSDP2 this rank's rows of it (docs/distributed.md, "FSDP2")."""
        self._check_shapes()
        weight_grad, bias = self.weight_grad(), self.bias
        if weight_grad is None:
            return None
        shard = self.grad_shard()
        rows = self.d_g if shard is None else shard.stop - shard.start
        bias_grad = None
        if bias is not None:
            bias_grad = self.bias_grad()
            if bias_grad is None:
                bias_grad = torch.zeros_like(bias) if shard is None else weight_grad.new_zeros(rows)
        if shard is None:
            return GradMatrix(self.weight_matrix(weight_grad), None if bias_grad is None else bias_grad.reshape(-1))
        if weight_grad.shape[0] != rows:
            raise ValueError(
                f"layer {self.name!r}: its gradient holds {weight_grad.shape[0]} rows where the sharding gives "
                f"{shard}; hylo supports fully_shard's even torch.chunk split on dim 0 only"
            )
        width = self.d_a - (bias is not None)  # a shard may hold no row
        return GradMatrix(weight_grad.reshape(rows, width), None if bias_grad is None else bias_grad.reshape(-1), shard)

    def weight_matrix(self, weight_grad: Tensor) -> Tensor:
        """∇W's weight part (d_g, d_a − bias) from :meth:`weight_grad` (a view where its layout allows)."""
        return weight_grad.reshape(self.d_g, -1)

    def write_weight_matrix(self, weight_grad: Tensor, matrix: Tensor) -> None:
        """Write ∇W's weight part ``matrix`` (d_g, d_a − bias) into :meth:`weight_grad` in place: the inverse
        of :meth:`weight_matrix`."""
        weight_grad.copy_(matrix.reshape(weight_grad.shape))

    def grad_matrix(self) -> Tensor | None:
        """∇W as one (d_g, d_a) matrix, bias last (a copy when there is a bias), or None before backward."""
        parts = self.grad_parts()
        return None if parts is None else parts.full()

    def set_grad_matrix(self, matrix: Tensor) -> None:
        """Write a (d_g, d_a) matrix back into the parameters' ``.grad`` in place."""
        self._check_shapes()
        weight_grad, bias_grad = self.weight_grad(), self.bias_grad()
        assert weight_grad is not None
        n_weight = self.d_a - (1 if self.bias is not None else 0)
        self.write_weight_matrix(weight_grad, matrix[:, :n_weight])
        if bias_grad is not None:
            bias_grad.copy_(matrix[:, n_weight].reshape(bias_grad.shape))


for _name in NAMED_METHODS:
    _method = LayerMath.__dict__[_name]
    if not getattr(_method, "__isabstractmethod__", False):
        setattr(LayerMath, _name, _names_layer(_method))
