"""The optimizer form's split under an adaptive solver: hylo's parameters in SGD without momentum, the rest in the
wrapped optimizer, and the parameters hylo cannot precondition handed back to it (docs/usage.md, "The optimizer
form").

A whole-step solver's result (Adam in K-FAC's eigenbasis) is the whole step, so its parameters take SGD without
momentum at their group's ``lr`` and ``weight_decay`` (decoupled, as AdamW's). A registered layer whose hooks capture
no rows at the first update (its weight used without its module's forward, as Mamba's ``dt_proj``) holds no state, and hylo leaves its gradient
raw: SGD at an Adam-scale learning rate would barely move it, so at that step its parameters go back to the group
of the wrapped optimizer they came from, which steps them from then on. The wrapped optimizer keeps every group it
had (a group left empty stays, so that group indices and an LR scheduler's lists stay aligned). With grafting the SGD
is :class:`~hylo.graft.GraftedSGD`, each step at the length of AdamW's (docs/usage.md, "Grafting").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hylo.graft import ADAM_KEYS, GraftedSGD


class AdaptedSplit:
    """``adapted`` taken out of ``base``'s groups into :attr:`sgd` (a :class:`~hylo.graft.GraftedSGD` with
    ``graft``: ``ValueError`` where a group holds no ``betas`` and ``eps``); :meth:`hand_back` returns some to
    ``base``."""

    def __init__(self, base: torch.optim.Optimizer, adapted: Iterable[nn.Parameter], graft: bool = False) -> None:
        self.base = base
        self.adapted = list(adapted)
        index = {id(p): i for i, p in enumerate(self.adapted)}
        #: Per adapted parameter (in :attr:`adapted`'s order): its base group and its SGD group.
        self.homes: list[tuple[int, int]] = [(-1, -1)] * len(self.adapted)
        moved: list[dict[str, Any]] = []
        for g, group in enumerate(base.param_groups):
            mine = [p for p in group["params"] if id(p) in index]
            if not mine:
                continue
            group["params"] = [p for p in group["params"] if id(p) not in index]
            for p in mine:
                self.homes[index[id(p)]] = (g, len(moved))
            moved.append({"params": mine, "lr": group["lr"], "weight_decay": group.get("weight_decay", 0.0)})
            if graft:
                missing = [key for key in ADAM_KEYS if key not in group]
                if missing:
                    raise ValueError(
                        f"HyLoOptimizer: graft=True takes AdamW's moments from the wrapped optimizer's groups; group {g} "
                        f"of {type(base).__name__} holds no {missing}"
                    )
                moved[-1] |= {key: group[key] for key in ADAM_KEYS}
        foreach = base.defaults.get("foreach")  # the wrapped optimizer's kernels: one per list, or one per tensor
        #: The grafted SGD where ``graft``, else None (:attr:`sgd` is then plain SGD).
        self.grafted = GraftedSGD(moved) if graft else None
        self.sgd: torch.optim.Optimizer = self.grafted or torch.optim.SGD(
            moved, lr=moved[0]["lr"], momentum=0.0, foreach=foreach
        )
        #: Indices (in :attr:`adapted`) of the parameters handed back to ``base``, in the order they were.
        self.returned: list[int] = []

    def unsolved(self, solved: Iterable[nn.Parameter]) -> list[int]:
        """The adapted parameters with a gradient that are not among ``solved`` (hylo left their gradient raw)."""
        done = {id(p) for p in solved}
        return [
            i for i, p in enumerate(self.adapted) if p.grad is not None and id(p) not in done and i not in self.returned
        ]

    def sizes_after(self, returned: Sequence[int]) -> list[int]:
        """The parameter counts of ``base``'s groups, then the SGD's, once ``returned`` have been handed back."""
        new = [i for i in returned if i not in self.returned]
        base = [len(group["params"]) for group in self.base.param_groups]
        sgd = [len(group["params"]) for group in self.sgd.param_groups]
        for i in new:
            g, s = self.homes[i]
            base[g] += 1
            sgd[s] -= 1
        return base + sgd

    def check_returned(self, returned: object) -> list[int]:
        """``returned`` as saved by a :class:`~hylo.optimizer.HyLoOptimizer`, or ``ValueError``: distinct indices of
        adapted parameters, including every one this split has handed back already."""
        if not isinstance(returned, list) or not all(isinstance(i, int) for i in returned):
            raise ValueError(f"HyLoOptimizer.load_state_dict: 'returned' must be a list of ints, got {returned!r}")
        if len(set(returned)) != len(returned) or not all(0 <= i < len(self.adapted) for i in returned):
            raise ValueError(
                f"HyLoOptimizer.load_state_dict: 'returned' must hold distinct indices below {len(self.adapted)}, "
                f"got {returned}"
            )
        if not set(self.returned) <= set(returned):
            raise ValueError(
                f"HyLoOptimizer.load_state_dict: this optimizer handed parameters {self.returned} back to the wrapped "
                f"optimizer, the saved one only {returned}"
            )
        return returned

    def hand_back(self, indices: Iterable[int]) -> None:
        """Move the adapted parameters ``indices`` from their SGD group to the base group they came from."""
        for i in indices:
            if i in self.returned:
                continue
            p, (g, s) = self.adapted[i], self.homes[i]
            sgd_group = self.sgd.param_groups[s]
            sgd_group["params"] = [q for q in sgd_group["params"] if q is not p]
            self.base.param_groups[g]["params"].append(p)
            if self.grafted is not None:
                self.grafted.forget(p)
            self.returned.append(i)

    def observe(self) -> None:
        """Before hylo rewrites the gradients: the grafted SGD reads the raw ones (nothing without grafting)."""
        if self.grafted is not None:
            self.grafted.observe()
