"""The methods of ``scripts/bench_peers.py``: the optimizers users would otherwise pick, and hylo's solvers.

:data:`METHODS` maps a name to a :class:`Method`: the package it needs (imported lazily, when a
run is built: a missing one skips the method with its reason, :func:`missing`), its default
learning-rate grid per task, and how a run is built — hylo's solver (through the run's
``RunConfig``), an optimizer factory, or a preconditioner-like object stepped before the task's
baseline optimizer (:func:`hylo_scripts.training.loop.train`'s ``optimizer_factory`` and
``preconditioner_factory``). docs/benchmarks.md, "Peers", lists the methods and their settings.

Parameters a method does not train itself — Muon's non-matrix parameters, SINGD's parameters
outside ``Linear``/``Conv2d`` modules — are trained by the task's baseline optimizer (SGD with
momentum on ``classification``, AdamW on ``lm``) at the baseline's tuned learning rate (``rest_lr``),
through a :class:`~hylo_scripts.training.optimizers.CombinedOptimizer` whose param groups the run's one lr schedule scales, each
group from its own base lr.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim._muon as muon_module
from torch import Tensor, nn

from hylo_scripts.training.hylo_options import ADAPTIVE
from hylo_scripts.training.loop import OptimizerFactory, PreconditionerFactory, Steppable
from hylo_scripts.training.optimizers import combine
from hylo_scripts.training.runconfig import RunConfig

#: The benchmark's tasks and each one's baseline method (the per-seed target comes from it).
BASELINES = {"classification": "sgd", "lm": "adamw"}
#: The steps between the preconditioner refreshes of SOAP, Shampoo, SINGD and KAISA (each :class:`Method`'s ``cycle``).
PEER_CYCLE = 10


def baseline_optimizer(params: Iterable[nn.Parameter], cfg: RunConfig, lr: float) -> torch.optim.Optimizer:
    """The task's baseline optimizer over ``params``: AdamW on ``lm``, momentum SGD elsewhere (the run's decay)."""
    if cfg.task == "lm":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def curvature_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The ``Linear`` and ``Conv2d`` modules that run their own forward, by name.

    ``nn.MultiheadAttention`` calls its ``out_proj``'s weight functionally (its module hooks never
    fire), so the modules inside one are left out: the Kronecker-factored peers (SINGD, KAISA)
    cannot see their inputs, unlike hylo (docs/transformers.md, "Attention").
    """
    inside = {
        id(sub)
        for module in model.modules()
        if isinstance(module, nn.MultiheadAttention)
        for sub in module.modules()
        if sub is not module
    }
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv2d)) and id(module) not in inside
    }


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon trains: the 2-D weights of the hidden layers.

    Per ``torch.optim.Muon``'s documentation, embeddings, the output head (the last ``Linear``),
    biases and norms are left to AdamW; convolution filters (4-D) are too, as the optimizer takes
    2-D parameters only.
    """
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = {id(p) for p in linears[-1].parameters()} if linears else set()
    return [p for p in model.parameters() if p.ndim == 2 and id(p) not in embeddings | head]


def _rest(model: nn.Module, mine: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """The model's parameters not in ``mine``."""
    taken = {id(p) for p in mine}
    return [p for p in model.parameters() if id(p) not in taken]


def newton_schulz_float32(
    grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """``torch.optim.Muon``'s orthogonalisation of ``grad`` — the quintic Newton–Schulz iteration
    X ← aX + (bXXᵀ + c(XXᵀ)²)X from X = G/‖G‖_F, on the wide orientation — in float32, where the stock one runs in
    bfloat16 (several times slower on CPUs without bfloat16 units)."""
    a, b, c = ns_coefficients
    x = grad.to(torch.float32)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / x.norm().clamp_min(eps)
    for _ in range(ns_steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton–Schulz iteration in float32 (:func:`newton_schulz_float32`): the same
    step to float32 round-off instead of bfloat16's. Its ``step`` swaps the function torch's Muon calls for the
    length of the step."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """torch's step, orthogonalising in float32."""
        stock = muon_module._zeropower_via_newtonschulz
        muon_module._zeropower_via_newtonschulz = newton_schulz_float32
        try:
            return super().step(closure)
        finally:
            muon_module._zeropower_via_newtonschulz = stock


def _muon(lr: float, rest_lr: float, float32: bool = False) -> OptimizerFactory:
    def build(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        matrices = muon_matrices(model)
        muon = (Float32Muon if float32 else torch.optim.Muon)(matrices, lr=lr, weight_decay=cfg.weight_decay)
        rest = _rest(model, matrices)
        # Muon's documentation prescribes AdamW for the rest; on classification the tuned baseline is SGD, so
        # the rest keeps the baseline's optimizer and lr there (docs/benchmarks.md, "Peers").
        return combine([muon, baseline_optimizer(rest, cfg, rest_lr)] if rest else [muon])

    return build


def _muon_float32(lr: float, rest_lr: float) -> OptimizerFactory:
    return _muon(lr, rest_lr, float32=True)


def _soap(lr: float, rest_lr: float) -> OptimizerFactory:
    def build(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        from pytorch_optimizer import SOAP

        return SOAP(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, precondition_frequency=PEER_CYCLE)

    return build


def _shampoo(lr: float, rest_lr: float) -> OptimizerFactory:
    def build(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        from pytorch_optimizer import ScalableShampoo
        from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting

        return ScalableShampoo(
            model.parameters(),
            lr=lr,
            weight_decay=cfg.weight_decay,
            decoupled_weight_decay=True,
            start_preconditioning_step=PEER_CYCLE,
            preconditioning_compute_steps=PEER_CYCLE,
            # AdaGrad's magnitude: the package's RMSprop graft has no bias correction, so its first steps are
            # ~30× too long (they diverge on both tasks).
            graft_type=LayerWiseGrafting.ADAGRAD,
        )

    return build


def _singd(lr: float, rest_lr: float) -> OptimizerFactory:
    def build(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        from singd.optim.optimizer import SINGD

        mine = [p for module in curvature_modules(model).values() for p in module.parameters()]
        singd = SINGD(
            model,
            params=mine,
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            T=PEER_CYCLE,
            loss_average="batch+sequence" if cfg.task == "lm" else "batch",
            warn_unsupported=False,
        )
        rest = _rest(model, mine)
        return combine([singd, baseline_optimizer(rest, cfg, rest_lr)] if rest else [singd])

    return build


def kaisa_preconditioner(
    model: nn.Module, optimizer: torch.optim.Optimizer, update_freq: int = PEER_CYCLE, damping: float = 0.003
) -> Steppable:
    """KAISA's ``KFACPreconditioner`` (kfac-pytorch) on ``model``'s :func:`curvature_modules`, its factors and
    inverses updated every ``update_freq`` steps, its lr read from ``optimizer``'s first group."""
    from kfac.preconditioner import KFACPreconditioner

    included = set(curvature_modules(model))
    skipped = [
        f"^{re.escape(name)}$"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name not in included
    ]
    pre: Steppable = KFACPreconditioner(
        model,
        factor_update_steps=update_freq,
        inv_update_steps=update_freq,
        damping=damping,
        lr=lambda _step: optimizer.param_groups[0]["lr"],
        skip_layers=skipped,
        loglevel=0,
    )
    return pre


@dataclass(frozen=True)
class Method:
    """One method of the benchmark.

    ``package``: the module it imports (None: torch alone); ``grids``: the default lr grid per task
    (a task absent: the method does not run on it); ``optimizer``: ``(lr, rest_lr) -> factory`` of
    the run's optimizer (None: the baseline's, :func:`hylo_scripts.training.loop.make_optimizer` of the run's
    ``RunConfig``);
    ``preconditioner``: a :data:`~hylo_scripts.training.loop.PreconditionerFactory` stepped before it;
    ``solver``: hylo's solver; ``attribute``: a name the package must have (``torch.optim.Muon``);
    ``cycle``: the steps of its update cycle (its preconditioner's refresh period; 1: every step costs the same;
    hylo's: the run's ``update_freq``), which the interleaved timing's blocks are whole multiples of.
    """

    name: str
    description: str
    grids: Mapping[str, tuple[float, ...]]
    package: str | None = None
    attribute: str | None = None
    optimizer: Callable[[float, float], OptimizerFactory] | None = None
    preconditioner: PreconditionerFactory | None = None
    solver: str | None = None
    cycle: int = 1
    #: hylo's options of this method's runs over the task's and ``--set``'s (a ``--variant``'s).
    options: tuple[tuple[str, Any], ...] = ()


#: Learning-rate grids of Muon in either form.
_MUON_GRIDS = {"classification": (0.02, 0.05, 0.1), "lm": (0.02, 0.04, 0.08)}
#: Learning-rate grids shared by the methods that step the baseline optimizer (hylo, KAISA).
_PRECONDITIONED = {"classification": (0.05, 0.1, 0.2), "lm": (1e-3, 2e-3, 4e-3)}

#: Every method, by name (``hylo-<solver>`` for hylo's).
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "sgd",
            "SGD, momentum 0.9 (the classification baseline)",
            {"classification": (0.015, 0.03, 0.05)},
        ),
        Method("adamw", "AdamW, weight decay 0.01 (the lm baseline)", {"lm": (1e-3, 2e-3, 4e-3)}),
        *(
            Method(name, description, _MUON_GRIDS, package="torch.optim", attribute="Muon", optimizer=factory)
            for name, description, factory in (
                ("muon", "torch.optim.Muon on hidden 2-D weights, the baseline at its tuned lr elsewhere", _muon),
                (
                    "muon-f32",
                    "muon with its Newton–Schulz iteration in float32 (the stock one: bfloat16), for CPUs without "
                    "fast bfloat16 products",
                    _muon_float32,
                ),
            )
        ),
        Method(
            "soap",
            "pytorch_optimizer.SOAP, preconditioner every 10 steps",
            {"classification": (1e-2, 3e-2, 0.1), "lm": (3e-3, 6e-3, 1.2e-2)},
            package="pytorch_optimizer",
            optimizer=_soap,
            cycle=PEER_CYCLE,
        ),
        Method(
            "shampoo",
            "pytorch_optimizer.ScalableShampoo, AdaGrad grafting, roots every 10 steps",
            {"classification": (1e-3, 3e-3, 1e-2), "lm": (1e-3, 2e-3, 4e-3)},
            package="pytorch_optimizer",
            optimizer=_shampoo,
            cycle=PEER_CYCLE,
        ),
        Method(
            "singd",
            "singd's SINGD (dense factors, T = 10) on Linear/Conv2d, the baseline at its tuned lr elsewhere",
            {"classification": (0.01, 0.03, 0.1), "lm": (3e-3, 1e-2, 3e-2)},
            package="singd",
            optimizer=_singd,
            cycle=PEER_CYCLE,
        ),
        Method(
            "kaisa",
            "KAISA's KFACPreconditioner (damping 0.003, updates every 10 steps) + the baseline optimizer",
            _PRECONDITIONED,
            package="kfac",
            preconditioner=kaisa_preconditioner,
            cycle=PEER_CYCLE,
        ),
    )
}


#: Learning-rate grids of hylo's adaptive solvers (``kfac_adam``: Adam's scale, applied by SGD without momentum).
_ADAPTIVE = {"classification": (3e-3, 1e-2, 3e-2), "lm": (2e-3, 4e-3, 8e-3)}


def hylo_method(solver: str, variant: str | None = None, options: Mapping[str, Any] | None = None) -> Method:
    """hylo with ``solver`` on the task's baseline optimizer (damping 0.3, ``kl_clip`` 0.01, updates every 10 steps);
    an adaptive solver (``kfac_adam``) on SGD without momentum, the baseline at its tuned lr elsewhere, no kl_clip.
    A ``variant`` (``hylo-<solver>-<variant>``) runs with ``options`` over the others."""
    name = f"hylo-{solver}" if variant is None else f"hylo-{solver}-{variant}"
    extra = tuple((options or {}).items())
    if solver in ADAPTIVE:
        description = f"hylo's {solver} + SGD (no momentum), the baseline at its tuned lr elsewhere"
        return Method(name, description, _ADAPTIVE, solver=solver, options=extra)
    return Method(name, f"hylo's {solver} + the baseline optimizer", _PRECONDITIONED, solver=solver, options=extra)


def missing(method: Method) -> str | None:
    """Why ``method`` cannot run here (its package or attribute is missing), or None."""
    if method.package is None:
        return None
    try:
        module = importlib.import_module(method.package)
    except ImportError as err:
        return f"{method.package} is not importable ({err})"
    if method.attribute is not None and not hasattr(module, method.attribute):
        return f"{method.package}.{method.attribute} does not exist in this version"
    return None
