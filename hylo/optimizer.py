"""HyLoOptimizer: hylo as a ``torch.optim.Optimizer`` — the preconditioner and the user's optimizer in one ``step()``.

docs/usage.md, "The optimizer form". Training stacks take an optimizer (Hugging Face ``Trainer``'s
``optimizers=(optimizer, scheduler)`` and its LR schedulers, Lightning's ``configure_optimizers``, Accelerate's
``prepare``); this is one. Its ``param_groups`` are the wrapped optimizer's own group dicts (so a scheduler scales
them), its ``state_dict`` holds the wrapped optimizer's and hylo's (so each stack's checkpoint carries both), and
its ``step()`` preconditions, then steps: once per optimizer step, whatever the gradient accumulation. The
options it gives hylo by default depend on the wrapped optimizer (:func:`default_options`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn

from hylo.adapted import AdaptedSplit
from hylo.config import HyLoConfig
from hylo.distributed import Communicator
from hylo.layers.walk import NoLayerError
from hylo.optimizer_state import Part, check_groups, check_numbering, check_part, stepped_parameters
from hylo.pipeline import liveness
from hylo.preconditioner import HyLoPreconditioner
from hylo.solvers import FAMILIES, HYBRID, family_of, whole_step

#: Optimizers that scale each coordinate by its own statistics: with one of these (or any optimizer whose
#: ``defaults`` hold ``betas``, as third-party Adam variants' do) the optimizer sets the step's length.
ADAPTIVE_BASES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.SparseAdam,
)
#: hylo's options under an adaptive optimizer with a natural-gradient ``solver`` given: a damping small enough for
#: the curvature to turn the gradient, which the optimizer then scales (docs/transformers.md, "Damping under AdamW").
NATURAL_UNDER_ADAPTIVE_DEFAULTS: dict[str, Any] = {"damping": 1e-3}
#: hylo's options under any other optimizer (SGD, …): the training scripts' damping, and the whole step bounded
#: by ``kl_clip`` at the optimizer's learning rate (read from its first group at every step).
PLAIN_DEFAULTS: dict[str, Any] = {"damping": 0.3, "kl_clip": 1e-3}

WHERE = "HyLoOptimizer.load_state_dict"

OptimizerOrFactory: TypeAlias = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def is_adaptive(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` sets the length of its step per coordinate (:data:`ADAPTIVE_BASES`, or ``betas``)."""
    return isinstance(optimizer, ADAPTIVE_BASES) or "betas" in optimizer.defaults


def adaptive_defaults() -> dict[str, Any] | None:
    """hylo's options under an adaptive optimizer when no ``solver`` is given: those of the first registered family
    that declares them (``SolverFamily.adaptive_defaults``: Adam in K-FAC's eigenbasis, updated every 3 steps with
    the warm-started refresh), None where no family does."""
    declared = [family.adaptive_defaults for family in FAMILIES if family.adaptive_defaults is not None]
    return dict(declared[0]) if declared else None


def default_options(optimizer: torch.optim.Optimizer, given: Mapping[str, Any]) -> dict[str, Any]:
    """hylo's options under ``optimizer``: the defaults for its kind, overridden by the options ``given``."""
    solver = given.get("solver")
    adaptive = adaptive_defaults()
    if solver is None and is_adaptive(optimizer) and adaptive is not None:
        chosen = adaptive
    elif solver is not None and whole_step(solver):
        chosen = {}
    elif is_adaptive(optimizer):
        chosen = dict(NATURAL_UNDER_ADAPTIVE_DEFAULTS)
    else:
        chosen = dict(PLAIN_DEFAULTS)
    final = given.get("solver", chosen.get("solver", HYBRID))
    if final != HYBRID:  # the options the solver's family takes from the optimizer (Adam's constants: its own)
        inherited = family_of(final).inherited_options
        chosen |= {
            ours: optimizer.defaults[theirs] for ours, theirs in inherited.items() if theirs in optimizer.defaults
        }
    return {**chosen, **given}


def output_layers(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s output layers: the modules its own or a submodule's ``get_output_embeddings()``
    returns (a Hugging Face model's LM head), at any depth, in the model's order."""
    names = {id(module): name for name, module in model.named_modules() if name}
    heads: dict[str, None] = {}
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, nn.Module) and id(head) in names:
            heads[names[id(head)]] = None
    return tuple(heads)


def adaptive_skips(model: nn.Module, optimizer: torch.optim.Optimizer, given: Mapping[str, Any]) -> dict[str, Any]:
    """``skip_layers`` the optimizer form adds under an adaptive optimizer when neither ``solver`` nor ``skip_layers``
    is given: the model's output layers (:func:`output_layers`), left to the optimizer as Muon's recipe leaves them
    (docs/usage.md, "The optimizer form": Adam in the eigenbasis of an LM head's factors lost to AdamW at lr 10⁻³);
    none otherwise."""
    if "solver" in given or "skip_layers" in given or not is_adaptive(optimizer) or adaptive_defaults() is None:
        return {}
    heads = output_layers(model)
    return {"skip_layers": heads} if heads else {}


class HyLoOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step()`` runs hylo's preconditioner, then the wrapped optimizer.

    Args:
        model: the model (as for :class:`HyLoPreconditioner`).
        optimizer: a ``torch.optim.Optimizer`` over the model's trainable parameters, not yet stepped, or a
            callable building one from a list of parameters (a class, or ``functools.partial(torch.optim.AdamW,
            lr=3e-4)``), which gets the model's trainable parameters.
        config: a :class:`HyLoConfig` taken as it is (no defaults are added to it; keyword options override it).
        communicator, grad_scaler: as for :class:`HyLoPreconditioner`.
        graft: under a whole-step solver, step each of hylo's parameters at the length of AdamW's step on its raw
            gradient (:mod:`hylo.graft`; docs/usage.md, "Grafting"); ``ValueError`` under any other solver.
        **options: hylo's options, over the defaults for the optimizer's kind (:func:`default_options`).

    When hylo's solver returns the whole step (:func:`hylo.solvers.whole_step`: Adam in K-FAC's eigenbasis) the
    parameters hylo preconditions leave the wrapped
    optimizer's groups and are stepped by SGD without momentum at their group's ``lr`` and ``weight_decay``
    (decoupled, as AdamW's); the wrapped optimizer keeps the rest, and takes back at the first update those of
    layers hylo captured no rows of (:mod:`hylo.adapted`). ``param_groups`` lists the wrapped optimizer's groups,
    then the SGD's.
    """

    _ready = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerOrFactory,
        *,
        config: HyLoConfig | None = None,
        communicator: Communicator | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        graft: bool = False,
        **options: Any,
    ) -> None:
        base = _built(model, optimizer)
        if not isinstance(graft, bool):
            raise ValueError(f"graft must be a bool, got {graft!r}")
        given = (
            dict(options)
            if config is not None
            else default_options(base, options | adaptive_skips(model, base, options))
        )
        start = config or HyLoConfig()
        if given.get("kl_clip", start.kl_clip) is not None and given.get("lr", start.lr) is None:
            given["lr"] = self._group_lr  # kl_clip bounds the step at the optimizer's learning rate
        chosen = start.replace(**given)
        adapted = _adapted_split(chosen)
        if graft and not adapted:
            raise ValueError(
                f"graft=True sets the length of a whole-step solver's step (hylo.solvers.whole_step); solver {chosen.solver!r} "
                f"returns a gradient that {type(base).__name__} scales itself"
            )
        with liveness.deferred():  # supersede a live preconditioner only once every check below has passed
            pre = _preconditioner(model, base, chosen, communicator, grad_scaler)
            split, names = _checked(model, base, pre, adapted, graft)
        self._pre = pre
        self._split = split
        self._names = names
        #: Whether the first update is still to come (when hylo's parameters not preconditioned are handed back).
        self._first_update = split is not None
        optimizers = [base] if split is None else [base, split.sgd]
        self._optimizers = optimizers
        super().__init__([group for opt in optimizers for group in opt.param_groups], {})
        self.defaults = base.defaults
        self._link()
        self._ready = True

    @property
    def preconditioner(self) -> HyLoPreconditioner:
        """The preconditioner whose ``step()`` runs first in :meth:`step`; ``ValueError`` when the model has no layer
        hylo can precondition (:attr:`preconditions` is False: the wrapped optimizer trains it alone)."""
        if self._pre is None:
            raise ValueError(
                "HyLoOptimizer preconditions nothing: the model has no layer hylo can precondition (see the warning "
                "given at construction); the wrapped optimizer trains it alone"
            )
        return self._pre

    @property
    def preconditions(self) -> bool:
        """Whether hylo preconditions any layer of the model; False when the wrapped optimizer trains it alone."""
        return self._pre is not None

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers it steps, in order: the wrapped one, then the SGD of the parameters whose preconditioned
        gradient is the whole step (a whole-step solver's layers), if any."""
        return tuple(self._optimizers)

    def _group_lr(self, _step: int) -> float:
        """The first group's learning rate: ``kl_clip``'s ``lr`` (read at each step, as a scheduler set it)."""
        return float(self.param_groups[0]["lr"])

    def _link(self) -> None:
        """Share the optimizers' group dicts and the first one's state (the SGD without momentum keeps none)."""
        self.param_groups = [group for opt in self._optimizers for group in opt.param_groups]
        self.state = self._optimizers[0].state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Evaluate ``closure`` (forward and backward, as Lightning passes it) if given, precondition the gradients
        and step every optimizer; the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._split is not None:
            self._split.observe()  # grafting reads the raw gradients
        if self._pre is not None:
            self._pre.step()
        if self._first_update:
            self._hand_back_unsolved()
        for optimizer in self._optimizers:
            optimizer.step()
        return loss

    def _hand_back_unsolved(self) -> None:
        """After hylo's first update: its parameters whose layers captured no rows (so hold no state, and keep raw
        gradients) go back to the wrapped optimizer, with one warning naming them."""
        assert self._split is not None
        solved = self.preconditioner.parameters(solved=True)
        if not solved:  # no update yet (a skipped step)
            return
        self._first_update = False
        raw = self._split.unsolved(solved)
        if not raw:
            return
        self._split.hand_back(raw)
        self._link()
        listed = [self._names.get(id(self._split.adapted[i]), "?") for i in raw]
        warnings.warn(
            f"HyLoOptimizer: hylo could not precondition {listed} (no rows at its first update: see its warning); "
            f"{type(self._optimizers[0]).__name__} trains them from now on instead of the SGD of the whole-step layers "
            '(docs/usage.md, "The optimizer form")',
            stacklevel=3,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (hylo does not precondition it: it registered its layers at
        construction); ``ValueError`` for a parameter already in one of :attr:`param_groups` (the SGD's of the
        whole-step split included), and for ``maximize=True`` under that split."""
        if not self._ready:  # the base class's constructor registering the groups it was given
            super().add_param_group(param_group)
            return
        params = param_group["params"]
        param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        held = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        # under the split, hylo's parameters are in the SGD's groups, which the wrapped optimizer does not see
        again = [(self._names.get(id(p), "?"), held[id(p)]) for p in param_group["params"] if id(p) in held]
        if again:
            raise ValueError(f"HyLoOptimizer.add_param_group: parameters already in a group (name, group): {again}")
        if self._split is not None:
            _refuse_maximize([param_group], "HyLoOptimizer.add_param_group")
        self._optimizers[0].add_param_group(param_group)
        self._link()

    def state_dict(self) -> dict[str, Any]:
        """The optimizers' states as one optimizer's (parameters numbered over ``param_groups``' order), and hylo's
        state under ``"hylo"``."""
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        offset = 0
        for optimizer in self._optimizers:
            part = optimizer.state_dict()
            merged["state"].update({offset + int(i): s for i, s in part["state"].items()})
            merged["param_groups"] += [
                {**group, "params": [offset + int(i) for i in group["params"]]} for group in part["param_groups"]
            ]
            offset += sum(len(group["params"]) for group in part["param_groups"])
        merged["hylo"] = None if self._pre is None else self._pre.state_dict()
        if self._split is not None:
            merged["returned"] = list(self._split.returned)
        return merged

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`: every part is checked against this optimizer before anything changes — hylo's,
        and the wrapped optimizers' (:mod:`hylo.optimizer_state`: group keys and options, the parameters'
        numbering, each state's keys, shapes and values, and a state wherever a parameter was certainly stepped)."""
        returned = self._returned(state_dict)
        parts = self._parts(state_dict, returned)
        self._check_parts(state_dict, parts, returned)
        if self._pre is not None:
            self._pre.load_state_dict(state_dict["hylo"], where=WHERE)
        if self._split is not None:
            self._split.hand_back(returned)
            self._first_update = False
        for optimizer, part in zip(self._optimizers, parts, strict=True):
            optimizer.load_state_dict(part)
        self._link()

    def _check_parts(self, state_dict: Mapping[str, Any], parts: list[dict[str, Any]], returned: list[int]) -> None:
        """Each optimizer's part against that optimizer, as it will be once ``returned`` are handed back."""
        hylo_part = state_dict["hylo"]
        steps = hylo_part.get("steps") if isinstance(hylo_part, Mapping) else None
        stepped = stepped_parameters(hylo_part, self._pre.layer_info()) if self._pre is not None else set()
        if self._split is not None:  # as at construction: the split's step descends
            _refuse_maximize(state_dict["param_groups"], WHERE)
        first_group = first_index = 0
        for optimizer, part, params in zip(self._optimizers, parts, self._params_after(returned), strict=True):
            check_part(
                Part(optimizer, part, params, first_group, first_index),
                names=self._names,
                stepped=stepped,
                steps=steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
                where=WHERE,
            )
            first_group += len(params)
            first_index += sum(len(group) for group in params)

    def _params_after(self, returned: list[int]) -> list[list[list[nn.Parameter]]]:
        """Each optimizer's groups' parameters once the adapted parameters ``returned`` are handed back."""
        groups = [[list(group["params"]) for group in opt.param_groups] for opt in self._optimizers]
        if self._split is not None:
            for i in returned:
                if i in self._split.returned:
                    continue
                p, (g, s) = self._split.adapted[i], self._split.homes[i]
                groups[0][g].append(p)
                groups[1][s] = [q for q in groups[1][s] if q is not p]
        return groups

    def _returned(self, state_dict: Mapping[str, Any]) -> list[int]:
        """The saved hand-backs (:mod:`hylo.adapted`), checked; ``ValueError`` where they do not fit this optimizer."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"HyLoOptimizer.load_state_dict: expected a mapping, got {type(state_dict).__name__}")
        if "hylo" in state_dict and (state_dict["hylo"] is None) != (self._pre is None):
            raise ValueError(
                f"{WHERE}: the state was saved by a HyLoOptimizer that preconditions "
                f"{'nothing' if state_dict['hylo'] is None else 'layers'}, this one preconditions "
                f"{'nothing' if self._pre is None else 'layers'}"
            )
        if self._split is None:
            if state_dict.get("returned"):
                raise ValueError(
                    "HyLoOptimizer.load_state_dict: the state was saved by a whole-step split, this is none"
                )
            return []
        return self._split.check_returned(state_dict.get("returned", []))

    def _parts(self, state_dict: Mapping[str, Any], returned: list[int]) -> list[dict[str, Any]]:
        """``state_dict`` split into each optimizer's state dict (once ``returned`` are handed back), or
        ``ValueError`` naming what does not fit."""
        if not {"state", "param_groups", "hylo"} <= set(state_dict):
            raise ValueError(
                "HyLoOptimizer.load_state_dict: expected a HyLoOptimizer.state_dict() (keys 'state', 'param_groups', "
                f"'hylo'), got {sorted(state_dict)}"
            )
        check_groups(state_dict["param_groups"], state_dict["state"], WHERE)
        groups = list(state_dict["param_groups"])
        sizes = [len(group["params"]) for group in groups]
        now = [len(group["params"]) for group in self.param_groups]
        expected = now if self._split is None else self._split.sizes_after(returned)
        if sizes != expected:
            raise ValueError(
                f"HyLoOptimizer.load_state_dict: the saved groups hold {sizes} parameters, this optimizer's {expected}"
            )
        check_numbering(groups, state_dict["state"], WHERE)
        parts, first, offset = [], 0, 0
        for optimizer in self._optimizers:  # the group counts never change (empty groups stay)
            mine = groups[first : first + len(optimizer.param_groups)]
            count = sum(len(group["params"]) for group in mine)
            state = {int(i) - offset: s for i, s in state_dict["state"].items() if offset <= int(i) < offset + count}
            renumbered = [{**group, "params": [int(i) - offset for i in group["params"]]} for group in mine]
            parts.append({"state": state, "param_groups": renumbered})
            first, offset = first + len(mine), offset + count
        return parts


def _preconditioner(
    model: nn.Module,
    base: torch.optim.Optimizer,
    config: HyLoConfig,
    communicator: Communicator | None,
    grad_scaler: torch.amp.GradScaler | None,
) -> HyLoPreconditioner | None:
    """hylo's preconditioner of ``model``, or None, with a warning, when the model has no layer it can precondition:
    the wrapped optimizer would train it, so the optimizer form does too, alone (docs/usage.md, "The optimizer
    form")."""
    try:
        return HyLoPreconditioner(model, config=config, communicator=communicator, grad_scaler=grad_scaler)
    except NoLayerError as error:
        warnings.warn(
            f"HyLoOptimizer: {error}; {type(base).__name__} trains {type(model).__name__} alone, as it would without "
            "hylo",
            stacklevel=4,
        )
        return None


def _checked(
    model: nn.Module, base: torch.optim.Optimizer, pre: HyLoPreconditioner | None, adapted: bool, graft: bool
) -> tuple[AdaptedSplit | None, dict[int, str]]:
    """The whole-step split (or None) and the model's parameter names by id, once ``base`` holds every parameter hylo
    preconditions and, under a whole-step solver, maximizes nothing; else ``ValueError``, ``pre`` removed. Without a
    preconditioner: no split."""
    names = {id(p): name for name, p in model.named_parameters()}
    if pre is None:
        return None, names
    try:
        held = {id(p) for group in base.param_groups for p in group["params"]}
        missing = [names.get(id(p), "?") for p in pre.parameters() if id(p) not in held]
        if missing:
            raise ValueError(
                f"HyLoOptimizer: hylo preconditions {missing}, which the optimizer does not hold: give it every "
                "trainable parameter of the model (or leave those layers out with skip_layers)"
            )
        if adapted:
            _refuse_maximize(base.param_groups, "HyLoOptimizer")
        return (AdaptedSplit(base, pre.parameters(), graft) if adapted else None), names
    except BaseException:
        pre.remove()
        raise


def _refuse_maximize(groups: Sequence[Mapping[str, Any]], where: str) -> None:
    """``ValueError`` naming the groups that hold ``maximize=True``: a whole-step solver's step descends."""
    flipped = [g for g, group in enumerate(groups) if group.get("maximize", False) is True]
    if flipped:
        raise ValueError(
            f"{where}: groups {flipped} hold maximize=True, not supported with a whole-step solver (its step descends)"
        )


def _built(model: nn.Module, optimizer: OptimizerOrFactory) -> torch.optim.Optimizer:
    """The wrapped optimizer: ``optimizer`` itself, or built from the model's trainable parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer or a callable building one, got {optimizer!r}")
        optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer's callable returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    if isinstance(optimizer, HyLoOptimizer):
        raise ValueError("optimizer is a HyLoOptimizer already: wrap the optimizer it wraps")
    if any(optimizer.state.values()):
        raise ValueError("optimizer has taken steps already: wrap it before its first step")
    return optimizer


def _adapted_split(config: HyLoConfig) -> bool:
    """Whether hylo's parameters take SGD without momentum (every layer's solver returns the whole step), or
    ``ValueError`` where layers could mix Adam-scaled and natural-gradient steps under one split."""
    policy = config.policy
    solvers = {config.solver, *policy.layer_solvers.values()}
    if config.solver == HYBRID:  # any of the policy's choices (docs/hybrid-policy.md)
        solvers |= {policy.kfac_solver, policy.critical_variant, policy.stable_variant}
    kinds = {whole_step(solver) for solver in solvers if solver != HYBRID}
    if len(kinds) > 1 or policy.solver_fn is not None:
        raise ValueError(
            "HyLoOptimizer splits the parameters once, at construction, between the wrapped optimizer and SGD for the "
            "layers whose hylo step is the whole step (whole_step solvers); these options can give both kinds of layer "
            f"(solver={config.solver!r}, kfac_solver={policy.kfac_solver!r}, layer_solvers, solver_fn): use "
            'HyLoPreconditioner with optimizers of your own (docs/usage.md, "Adaptive solvers")'
        )
    return kinds == {True}
