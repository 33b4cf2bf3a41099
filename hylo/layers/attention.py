"""``nn.MultiheadAttention``'s projections preconditioned as the Linear layers they are.

docs/transformers.md, "Attention". The module applies its q/k/v and output projections functionally
(``F.multi_head_attention_forward``), so no module hook sees them. On capture steps only, a
forward pre-hook enters a torch-function mode that takes over that one call: it applies the
projections itself with ``F.linear`` (hooking their outputs like any captured layer). On the common
path (``need_weights=False``, no ``bias_k``/``bias_v``/``add_zero_attn``, masks of the shapes and
dtypes torch expects) it then computes torch's attention core step for step; for anything else it hands the
projected tensors to ``F.multi_head_attention_forward`` with identity projections, so masks,
dropout, ``need_weights`` and every other option keep torch's own semantics. The model's class,
forward and ``state_dict`` are untouched; between capture steps nothing runs at all."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._C import _disabled_torch_function_impl
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from hylo.layers.capture import LayerCapture, Record, watch_gradient
from hylo.layers.gradmatrix import GradShard
from hylo.layers.linear import LinearMath
from hylo.layers.sharded import dim0_chunk, is_sharded, local, unsupported_layout

#: The input projections in their packing order, then the output projection.
PROJECTIONS = ("q", "k", "v", "out")
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_MHA_DEFAULTS = {
    name: p.default for name, p in _MHA_SIGNATURE.parameters.items() if p.default is not inspect.Parameter.empty
}


def projection_name(attention_name: str, part: str) -> str:
    """The registered name of one projection: ``<attention>.q_proj`` … ``<attention>.out_proj``."""
    return f"{attention_name}.{part}_proj" if attention_name else f"{part}_proj"


class ProjectionMath(LinearMath):
    """One input projection (q, k or v) of an ``nn.MultiheadAttention``, as a Linear layer.

    Its weight is rows ``[iE, (i+1)E)`` of the packed ``in_proj_weight`` (or its own
    ``q/k/v_proj_weight`` when key and value dimensions differ), its bias the same rows of
    ``in_proj_bias``; gradients are read from and written to those rows of the parameters'
    ``.grad`` in place. (The output projection is the module's own ``out_proj`` Linear.)
    """

    def __init__(self, attention: nn.MultiheadAttention, part: str) -> None:
        index = PROJECTIONS.index(part)
        embed = attention.embed_dim
        self.part = part
        self._packed = attention.in_proj_weight is not None
        self._weight_name = "in_proj_weight" if self._packed else f"{part}_proj_weight"
        self._slice = slice(index * embed, (index + 1) * embed)
        super().__init__(attention)

    @property
    def module_type(self) -> str:
        """``MHA.q`` / ``MHA.k`` / ``MHA.v``."""
        return f"MHA.{self.part}"

    def _parameter(self) -> Tensor:
        weight = getattr(self.module, self._weight_name)
        assert isinstance(weight, Tensor)
        return weight

    def _current_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(E, d_in) and (E,), from the parameters' shapes (no slice: under FSDP2 slicing would gather them)."""
        embed = self._slice.stop - self._slice.start
        bias = self.module.in_proj_bias
        return (embed, *self._parameter().shape[1:]), (embed,) if isinstance(bias, Tensor) else None

    @property
    def weight(self) -> Tensor:
        """The projection's (E, d_in) weight: a view of the module's parameter; under FSDP2 the parameter itself
        (slicing a sharded DTensor would gather it; :meth:`grad_shard` says which rows are this projection's)."""
        weight = self._parameter()
        return weight[self._slice] if self._packed and not is_sharded(weight) else weight

    @property
    def bias(self) -> Tensor | None:
        """The projection's rows of ``in_proj_bias``, or None; under FSDP2 the parameter itself."""
        bias = self.module.in_proj_bias
        if not isinstance(bias, Tensor):
            return None
        return bias if is_sharded(bias) else bias[self._slice]

    def _held(self) -> tuple[slice, GradShard] | None:
        """Under FSDP2, this projection's part of the rank's rows of the parameter: where they are in its local
        tensor and which rows of ∇W they are (a packed parameter's shard may straddle q, k and v); else None."""
        held = dim0_chunk(self._parameter())
        if held is None:
            return None
        embed = self._slice.stop - self._slice.start
        if not self._packed:
            return slice(None), GradShard(*held, embed)
        low, high = (self._slice.start, self._slice.stop)
        first, last = (min(max(index, low), high) for index in held)
        return slice(first - held[0], last - held[0]), GradShard(first - low, last - low, embed)

    def grad_shard(self) -> GradShard | None:
        """This rank's rows of ∇W under FSDP2 (possibly none), or None when unsharded."""
        held = self._held()
        return None if held is None else held[1]

    def sharding_problem(self) -> str | None:
        """None for a packed ``in_proj_weight`` (and ``in_proj_bias``) sharded by ``fully_shard``: its shards are
        row blocks of q, k and v (docs/distributed.md, "FSDP2")."""
        weight, packed_bias = self._parameter(), self.module.in_proj_bias
        bias = packed_bias if isinstance(packed_bias, Tensor) else None
        if not is_sharded(weight) and not is_sharded(bias):
            return None
        problem = unsupported_layout(weight, bias, int(weight.shape[0]), True)
        if problem is None and not self._packed and bias is not None:
            return (
                "its weight (q/k/v_proj_weight, kdim or vdim != embed_dim) and its bias (rows of in_proj_bias) are "
                "sharded over different rows"
            )
        return problem

    def grad_tensor(self) -> Tensor | None:
        """The whole parameter's ``.grad`` (shared by q, k and v when packed; this rank's part under FSDP2)."""
        return local(self._parameter().grad)

    def weight_grad(self) -> Tensor | None:
        grad = local(self._parameter().grad)
        if grad is None:
            return None
        held = self._held()
        if held is not None:
            return grad[held[0]]
        return grad[self._slice] if self._packed else grad

    def bias_grad(self) -> Tensor | None:
        bias = self.module.in_proj_bias
        if not isinstance(bias, Tensor) or bias.grad is None:
            return None
        held = self._held()
        return local(bias.grad)[self._slice if held is None else held[0]]


class OutProjectionMath(LinearMath):
    """The output projection: the attention module's own ``out_proj`` Linear, captured by the tap."""

    def __init__(self, attention: nn.MultiheadAttention) -> None:
        super().__init__(attention.out_proj)

    @property
    def module_type(self) -> str:
        """``MHA.out``."""
        return "MHA.out"


class AttentionTap:
    """The capture hooks of one ``nn.MultiheadAttention``: its registered projections' inputs and output gradients.

    ``captures`` maps ``"q"``, ``"k"``, ``"v"``, ``"out"`` to the captures of the registered
    projections (a skipped projection is simply absent).
    """

    def __init__(self, attention: nn.MultiheadAttention, captures: dict[str, LayerCapture], name: str) -> None:
        self.attention = attention
        self.captures = captures
        self.name = name
        self._mode: _AttentionMode | None = None
        self._warned = False
        self._handles: list[RemovableHandle] = [
            attention.register_forward_pre_hook(self._enter),
            attention.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._mode is not None or not (module.training and torch.is_grad_enabled()):
            return
        wanted = {part: capture for part, capture in self.captures.items() if capture.wants()}
        if wanted:
            self._mode = _AttentionMode(self, wanted)
            self._mode.__enter__()

    def _exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        if self._warned:
            return
        if not mode.handled:
            self._warned = True
            warnings.warn(
                f"hylo: the attention module {self.name!r} did not call F.multi_head_attention_forward "
                "in this forward, so its projections were not captured (a custom forward or a torch "
                "version hylo does not know); they keep their previous state",
                stacklevel=2,
            )
        elif mode.foreign is not None:
            self._warned = True
            warnings.warn(
                f"hylo: the attention module {self.name!r} called F.multi_head_attention_forward with a "
                f"{mode.foreign} that is not its own parameter (a forward of its own), so its projections were "
                "not captured: hylo cannot tell their gradients' rows; they keep their previous state",
                stacklevel=2,
            )

    def foreign(self, call: inspect.BoundArguments) -> str | None:
        """The first projection parameter of ``F.multi_head_attention_forward``'s ``call`` that is not the attention
        module's own (read now, as its forward read it), or None: only then are the captured rows its projections'
        (docs/transformers.md, "Attention")."""
        args, attention = call.arguments, self.attention
        own: dict[str, Tensor | None] = {
            "in_proj_weight": attention.in_proj_weight,
            "in_proj_bias": attention.in_proj_bias,
            "out_proj_weight": attention.out_proj.weight,
            "out_proj_bias": attention.out_proj.bias,
        }
        if args.get("use_separate_proj_weight"):
            own.update(
                q_proj_weight=attention.q_proj_weight,
                k_proj_weight=attention.k_proj_weight,
                v_proj_weight=attention.v_proj_weight,
            )
        return next((name for name, tensor in own.items() if args.get(name) is not tensor), None)

    def remove(self) -> None:
        """Detach the hooks (a forward in progress finishes without capturing)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forward(self, call: inspect.BoundArguments, wanted: dict[str, LayerCapture]) -> Any:
        """``F.multi_head_attention_forward`` with the projections applied (and captured) here."""
        args = call.arguments
        query, key, value = args["query"], args["key"], args["value"]
        if args.get("static_k") is not None or args.get("static_v") is not None:
            raise ValueError(f"hylo: attention {self.name!r} called with static_k/static_v, which hylo cannot capture")
        attention = self.attention
        embed = attention.embed_dim
        # MultiheadAttention hands (L, N, E); with batch_first, rows are recorded in the user's (N, L) order
        flip = attention.batch_first and query.dim() == 3
        bias = args["in_proj_bias"]
        separate = bool(args.get("use_separate_proj_weight"))
        if not separate and key is value:  # one product per packed input, in torch's layout (contiguous parts)
            weight = args["in_proj_weight"]
            if query is key:  # self-attention
                q, k, v = _unpack(self._project(query, weight, bias, ("q", "k", "v"), wanted, flip), 3, embed)
            else:  # query against one memory: q, then k and v from one product, as torch does
                w_q, w_kv = weight.split([embed, 2 * embed])
                b_q, b_kv = (None, None) if bias is None else bias.split([embed, 2 * embed])
                q = self._project(query, w_q, b_q, ("q",), wanted, flip)
                k, v = _unpack(self._project(key, w_kv, b_kv, ("k", "v"), wanted, flip), 2, embed)
        else:
            biases: list[Tensor | None] = [None] * 3 if bias is None else list(bias.chunk(3))
            if separate:
                weights = [args["q_proj_weight"], args["k_proj_weight"], args["v_proj_weight"]]
            else:
                weights = list(args["in_proj_weight"].chunk(3))
            q = self._project(query, weights[0], biases[0], ("q",), wanted, flip)
            k = self._project(key, weights[1], biases[1], ("k",), wanted, flip)
            v = self._project(value, weights[2], biases[2], ("v",), wanted, flip)
        out_weight, out_bias = args["out_proj_weight"], args["out_proj_bias"]
        core = _attention_core({**_MHA_DEFAULTS, **args}, q, k, v)
        if core is not None:  # the common path: torch's attention core written out, no identity products
            return self._project(core, out_weight, out_bias, ("out",), wanted, flip), None
        eye = torch.eye(embed, dtype=out_weight.dtype, device=out_weight.device)
        args.update(
            query=q,
            key=k,
            value=v,
            in_proj_weight=None,
            in_proj_bias=None,
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            out_proj_weight=eye,
            out_proj_bias=None,
        )
        output, weights_out = F.multi_head_attention_forward(*call.args, **call.kwargs)
        return self._project(output, out_weight, out_bias, ("out",), wanted, flip), weights_out

    def _project(
        self,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        parts: tuple[str, ...],
        wanted: dict[str, LayerCapture],
        flip: bool,
    ) -> Tensor:
        """``F.linear(x, weight, bias)``, its input and output gradient recorded for the wanted parts."""
        output = F.linear(x, weight, bias)
        width = weight.shape[0] // len(parts)
        selected = [(wanted[part], slice(i * width, (i + 1) * width)) for i, part in enumerate(parts) if part in wanted]
        if not selected or not output.requires_grad:
            return output
        inputs = x.transpose(0, 1) if flip else x
        records: list[tuple[Record, Callable[[Tensor], Tensor]]] = []
        for capture, columns in selected:
            records.append((capture.open(inputs), _selector(columns, flip)))
        watch_gradient(output, records)
        return output


def _unpack(packed: Tensor, parts: int, embed: int) -> tuple[Tensor, ...]:
    """The ``parts`` projections of one packed product, each contiguous, in the layout torch's own packed
    in-projection gives them (so the attention core sees the tensors the stock forward gives it)."""
    return tuple(packed.unflatten(-1, (parts, embed)).movedim(-2, 0).contiguous().unbind(0))


def _float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask as torch's attention makes it additive (-inf where True); a float mask unchanged."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


#: The ``__torch_function__`` implementations of plain tensors and parameters (a classmethod's function, and
#: ``nn.Parameter``'s disabled one).
_PLAIN_TORCH_FUNCTIONS = (getattr(Tensor.__torch_function__, "__func__", None), _disabled_torch_function_impl)


def _overrides_torch_function(tensor: Tensor) -> bool:
    """Whether ``tensor``'s class has a ``__torch_function__`` of its own (a tensor subclass); an active function mode
    (``torch.set_default_device``, a profiler's) does not count: the core's calls go through it like torch's own."""
    own = getattr(type(tensor), "__torch_function__", None)
    return getattr(own, "__func__", own) not in _PLAIN_TORCH_FUNCTIONS


def _attention_core(args: dict[str, Any], q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """The attention core of ``F.multi_head_attention_forward`` on projected q, k and v, before the output
    projection, or None when the call is outside the common path (docs/transformers.md, "Attention").

    The common path is the ``need_weights=False`` branch of torch's code with no ``bias_k``/``bias_v``, no
    ``add_zero_attn``, 3-D (batched) or 2-D (unbatched) inputs, masks of the shapes torch accepts that are
    boolean or of the input query's dtype (one dtype when both are given), ``is_causal`` only with an
    ``attn_mask``, and no tensor with a ``__torch_function__`` of its own. The steps below are torch's, in
    its order (mask conversion and merging, head reshapes, one ``F.scaled_dot_product_attention`` call with
    the same tensors, dropout only in training), so outputs, gradients and the dropout's random stream are
    the stock forward's. Anything else takes the identity-projection path, i.e. torch's own code.
    """
    query, mask, padding = args["query"], args["attn_mask"], args["key_padding_mask"]
    if args["need_weights"] or args["bias_k"] is not None or args["bias_v"] is not None or args["add_zero_attn"]:
        return None
    masks = [m for m in (mask, padding) if m is not None]
    if (
        any(_overrides_torch_function(t) for t in (q, k, v, *masks))
        or query.dim() not in (2, 3)
        or {q.dim(), k.dim(), v.dim()} != {query.dim()}
    ):
        return None
    if any(m.dtype not in (torch.bool, query.dtype) for m in masks) or len({m.dtype for m in masks}) > 1:
        return None
    batched = query.dim() == 3
    if not batched:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        padding = None if padding is None else padding.unsqueeze(0)
    tgt, bsz, embed = q.shape
    src, heads = k.shape[0], args["num_heads"]
    head_dim = embed // heads
    if query.shape[-1] != args["embed_dim_to_check"] or head_dim * heads != embed or k.shape != v.shape:
        return None
    if k.shape[1] != bsz or (padding is not None and padding.shape != (bsz, src)):
        return None
    if mask is not None and mask.shape not in ((tgt, src), (bsz * heads, tgt, src)):
        return None
    is_causal = bool(args["is_causal"])
    if is_causal and mask is None:
        return None  # torch raises
    if padding is not None:
        padding = _float_mask(padding, query.dtype)
    if is_causal and padding is None:
        mask = None  # torch hands SDPA the is_causal hint instead of the mask
    else:
        mask = None if mask is None else _float_mask(mask, query.dtype)
        if mask is not None and mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if padding is not None:
            is_causal = False  # the merged mask is no longer causal
    if padding is not None:
        padding = padding.view(bsz, 1, 1, src).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src)
        mask = padding if mask is None else mask + padding
    if mask is not None:
        mask = mask.unsqueeze(0) if mask.size(0) == 1 and mask.dim() == 3 else mask.view(bsz, heads, -1, src)
    dropout = float(args["dropout_p"]) if args["training"] else 0.0
    q = q.view(tgt, bsz * heads, head_dim).transpose(0, 1).view(bsz, heads, tgt, head_dim)
    k = k.view(src, bsz * heads, head_dim).transpose(0, 1).view(bsz, heads, src, head_dim)
    v = v.view(src, bsz * heads, head_dim).transpose(0, 1).view(bsz, heads, src, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    out = out.permute(2, 0, 1, 3).reshape(tgt, bsz, embed)
    return out if batched else out.squeeze(1)


def _selector(columns: slice, flip: bool) -> Callable[[Tensor], Tensor]:
    """The part of a projection's output gradient that belongs to one projection, in the user's order."""

    def select(grad: Tensor) -> Tensor:
        part = grad[..., columns]
        return part.transpose(0, 1) if flip else part

    return select


class _AttentionMode(TorchFunctionMode):
    """Active during one capturing forward of one attention module: takes over its functional call."""

    def __init__(self, tap: AttentionTap, wanted: dict[str, LayerCapture]) -> None:
        super().__init__()
        self.tap = tap
        self.wanted = wanted
        self.handled = False
        #: The projection parameter the call passed that is not the module's own (then nothing is captured).
        self.foreign: str | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and not self.handled:
            self.handled = True
            call = _MHA_SIGNATURE.bind(*args, **kwargs)
            self.foreign = self.tap.foreign(call)
            if self.foreign is None:
                return self.tap.forward(call, self.wanted)
        return func(*args, **kwargs)
