"""An oracle independent of hylo: a model's true per-sample gradients and the exact damped SNGD step.

The tests and benchmarks compare hylo against these, never against rows hylo builds itself.
Layout (docs/solvers.md, "Notation"): a layer's weight W is a (d_g, d_a) matrix, a Conv2d
flattened to C_out × (C_in·kh·kw), with the bias gradient as the last column. For the
per-sample losses ℓ_i = loss_fn(model(x_i), y_i) of a mean-reduced loss, U_i = ∇_W ℓ_i and
∇W = (1/n) Σ_i U_i.

BatchNorm must be in eval mode (with running statistics; see :func:`batchnorm_eval`): in
training mode a sample's output depends on the whole batch and per-sample gradients are
undefined, so both functions raise ``ValueError`` then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm

#: A loss of (outputs, targets) of a batch; on a batch of one it is that sample's loss.
LossFn = Callable[[Tensor, Tensor], Tensor]
#: Largest d_g·d_a that :func:`sngd_reference` solves densely by default.
DENSE_LIMIT = 4096


def supported_layers(model: nn.Module) -> list[str]:
    """Names of the modules the oracle covers: every ``nn.Linear`` and ``nn.Conv2d`` with groups=1."""
    return [name for name, module in model.named_modules() if _is_supported(module)]


def _is_supported(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1)


def batchnorm_eval(model: nn.Module, inputs: Tensor | None = None) -> nn.Module:
    """Put every BatchNorm of ``model`` in eval mode, every other module as it was; returns ``model``.

    Per-sample gradients need running statistics, while hylo captures only modules in
    training mode. With ``inputs``, the running statistics are first set to those of one
    forward pass on ``inputs`` in training mode (a freshly built model's defaults, mean 0 and
    variance 1, would leave a deep network unnormalised).
    """
    norms = [module for module in model.modules() if isinstance(module, _BatchNorm)]
    if inputs is not None:
        momenta = [norm.momentum for norm in norms]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average: after one batch, that batch's statistics
            norm.train()
        with torch.no_grad():
            model(inputs)
        for norm, momentum in zip(norms, momenta, strict=True):
            norm.momentum = momentum
    for norm in norms:
        norm.eval()
    return model


def _check_batchnorm(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) and (module.training or module.running_mean is None):
            raise ValueError(
                f"BatchNorm {name or '<root>'} normalises with batch statistics (training mode or no "
                "running statistics), so per-sample gradients are undefined; call model.eval() or "
                "batchnorm_eval(model) first"
            )


def _layer_params(model: nn.Module, layer_names: Sequence[str]) -> dict[str, list[str]]:
    """Each layer's parameter names in ``model.named_parameters()`` (weight, then bias if any)."""
    params: dict[str, list[str]] = {}
    for layer in layer_names:
        module = model.get_submodule(layer)
        if not _is_supported(module):
            raise ValueError(f"layer {layer!r} is a {type(module).__name__}, not a Linear or a Conv2d with groups=1")
        prefix = f"{layer}." if layer else ""
        params[layer] = [prefix + "weight"] + ([prefix + "bias"] if module.bias is not None else [])
    return params


def _as_matrix(weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
    """Per-sample (n, *weight.shape) and (n, d_g) gradients as (n, d_g, d_a), bias last."""
    n, d_g = weight_grad.shape[:2]
    matrix = weight_grad.reshape(n, d_g, -1)
    if bias_grad is not None:
        matrix = torch.cat([matrix, bias_grad.reshape(n, d_g, 1)], dim=2)
    return matrix


def per_sample_grads(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, layer_names: Sequence[str]
) -> dict[str, Tensor]:
    """Per-sample gradient matrices U (n, d_g, d_a) of each named layer, by ``vmap(grad(...))``.

    Sample i is run as a batch of one through ``torch.func.functional_call``; every other
    parameter and buffer of ``model`` is held constant.
    """
    _check_batchnorm(model)
    layers = _layer_params(model, layer_names)
    named = dict(model.named_parameters())
    wanted = {name: named[name].detach() for names in layers.values() for name in names}

    def sample_loss(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    with torch.no_grad():  # no graph back to the other parameters; grad() still differentiates inside
        grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(wanted, inputs, targets)
    return {
        layer: _as_matrix(grads[names[0]], grads[names[1]] if len(names) > 1 else None)
        for layer, names in layers.items()
    }


def per_sample_grads_loop(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, layer_names: Sequence[str]
) -> dict[str, Tensor]:
    """The same as :func:`per_sample_grads` by one forward and backward per sample (slow; validates it)."""
    _check_batchnorm(model)
    layers = _layer_params(model, layer_names)
    named = dict(model.named_parameters())
    order = [name for names in layers.values() for name in names]
    per_param: dict[str, list[Tensor]] = {name: [] for name in order}
    for x, y in zip(inputs, targets, strict=True):
        loss = loss_fn(model(x.unsqueeze(0)), y.unsqueeze(0))
        for name, g in zip(order, torch.autograd.grad(loss, [named[name] for name in order]), strict=True):
            per_param[name].append(g)
    stacked = {name: torch.stack(gs) for name, gs in per_param.items()}
    return {
        layer: _as_matrix(stacked[names[0]], stacked[names[1]] if len(names) > 1 else None)
        for layer, names in layers.items()
    }


def sngd_reference(U: Tensor, grad: Tensor | None, damping: float, *, dense: bool | None = None) -> Tensor:
    """The exact damped empirical-Fisher step (F + λI)⁻¹ vec ∇W as a (d_g, d_a) float64 matrix.

    F = (1/n) Σ_i vec(U_i) vec(U_i)ᵀ for U of shape (n, d_g, d_a) (docs/solvers.md, "SNGD");
    ``grad`` is ∇W, the mean of U when None. ``dense`` (default: d_g·d_a ≤ ``DENSE_LIMIT``)
    solves with F itself; otherwise Woodbury with the n×n Gram matrix,
    (v − Uᵀ(nλI + U Uᵀ)⁻¹ U v) / λ.
    """
    if not damping > 0:
        raise ValueError(f"damping must be > 0, got {damping!r}")
    n, d_g, d_a = U.shape
    rows = U.reshape(n, -1).to(torch.float64)
    v = (U.mean(0) if grad is None else grad).reshape(-1).to(torch.float64)
    if rows.shape[1] != v.shape[0]:
        raise ValueError(f"grad of {v.shape[0]} entries does not match U's (d_g, d_a) = ({d_g}, {d_a})")
    if dense if dense is not None else d_g * d_a <= DENSE_LIMIT:
        fisher = rows.mT @ rows / n
        solved = torch.linalg.solve(fisher + damping * torch.eye(d_g * d_a, dtype=torch.float64, device=rows.device), v)
    else:
        gram = rows @ rows.mT + n * damping * torch.eye(n, dtype=torch.float64, device=rows.device)
        solved = (v - rows.mT @ torch.linalg.solve(gram, rows @ v)) / damping
    return solved.reshape(d_g, d_a)


def relative_error(x: Tensor, ref: Tensor) -> float:
    """‖x − ref‖_F / ‖ref‖_F, in float64."""
    ref64 = ref.to(torch.float64)
    return float(torch.linalg.norm(x.to(torch.float64) - ref64) / torch.linalg.norm(ref64))


def cosine(x: Tensor, ref: Tensor) -> float:
    """⟨x, ref⟩ / (‖x‖_F ‖ref‖_F) in float64: the direction alone, whatever the lengths."""
    x64, ref64 = x.to(torch.float64), ref.to(torch.float64)
    return float((x64 * ref64).sum() / (torch.linalg.norm(x64) * torch.linalg.norm(ref64)))
