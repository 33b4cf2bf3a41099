"""A step that changes nothing: hylo warns, once, with the fix, when at an update every layer's preconditioned
gradient points where its raw gradient does (docs/reliability.md, "A step that changes nothing")."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import hylo
from hylo.pipeline.effect import UNCHANGED, unchanged
from tests.kit.models import backward, mlp


def _run(steps: int, rows: int = 8, **options: object) -> list[str]:
    """The hylo warnings of ``steps`` steps of the MLP (batches of ``rows``) under ``options`` (``solver="kfac"``
    unless given)."""
    model = mlp()
    pre = hylo.HyLoPreconditioner(model, **{"solver": "kfac", **options})  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            model.zero_grad()
            backward(model, step, rows)
            pre.step()
    return [str(w.message) for w in caught if "changes no direction" in str(w.message)]


def test_a_damping_that_dominates_the_curvature_is_reported_once_with_the_fix() -> None:
    """At λ = 10⁶ (F̃ + λI)⁻¹∇W is ∇W/λ on every layer: one warning, at the first update, naming the damping and the
    fix; the later updates say nothing more."""
    caught = _run(6, damping=1e6, update_freq=2)
    assert len(caught) == 1
    assert "at step 0" in caught[0] and "damping (1e+06)" in caught[0] and "HyLoOptimizer" in caught[0]


def test_a_damping_that_turns_the_gradient_is_not_reported() -> None:
    assert _run(6, damping=1e-3, update_freq=2) == []


@pytest.mark.parametrize("grouped", [True, False])
def test_a_whole_step_solver_is_never_reported(grouped: bool) -> None:
    """A result without a length bound (``kfac_adam``'s: its own step, not (F̃ + λI)⁻¹∇W) counts as turned on both
    paths: with one row its first step is ∇W's direction (R has one entry), which is Adam's, not a damping that
    dominates. Before, the grouped path measured its length and warned."""
    assert _run(4, rows=1, solver="kfac_adam", update_freq=2, grouped=grouped) == []


def _sines(results: list[np.ndarray], raws: list[np.ndarray], layer_of: list[int], layers: int) -> np.ndarray:
    """sin² of the angle between each layer's result and gradient (all its parts as one vector), in NumPy."""
    sines = np.zeros(layers)
    for layer in range(layers):
        a = np.concatenate([r.ravel() for r, i in zip(results, layer_of, strict=True) if i == layer])
        b = np.concatenate([g.ravel() for g, i in zip(raws, layer_of, strict=True) if i == layer])
        sines[layer] = 1 - (a @ b) ** 2 / ((a @ a) * (b @ b))
    return sines


@pytest.mark.parametrize("seed", range(3))
def test_unchanged_is_the_angle_between_a_layers_result_and_gradient(seed: int) -> None:
    """Against NumPy: a layer (weight and bias parts together) counts as unchanged exactly when sin² ≤ 1%² and the
    result points forward, read from the check's terms [⟨∇W, V̂⟩, ‖V̂‖²] and ‖∇W‖. Layer 0 turned by a fifth of the
    bound, layer 1 by twice it, layer 2 reversed, layer 3 scaled; then layer 1 fallen back to its gradient, and
    layer 3 with its length unmeasured (0)."""
    gen = torch.Generator().manual_seed(seed)
    raw = [torch.randn(5, 4, generator=gen), torch.randn(5, generator=gen), torch.randn(3, 6, generator=gen)]
    raw += [torch.randn(2, 2, generator=gen), torch.randn(7, 3, generator=gen)]
    layer_of = [0, 0, 1, 2, 3]
    turn = [UNCHANGED / 5, UNCHANGED / 5, 2 * UNCHANGED, 0.0, 0.0]
    result = []
    for g, t in zip(raw, turn, strict=True):
        noise = torch.randn(g.shape, generator=gen, dtype=g.dtype)
        result.append(3.0 * g + 3.0 * t * g.norm() * noise / noise.norm())
    result[3] = -raw[3]
    sines = _sines([r.numpy() for r in result], [g.numpy() for g in raw], layer_of, 4)
    assert sines[0] <= UNCHANGED**2 < sines[1] and sines[2] < 1e-12
    terms = torch.zeros(4, 2, dtype=torch.float64)
    squares = torch.zeros(4, dtype=torch.float64)
    for r, g, i in zip(result, raw, layer_of, strict=True):
        terms[i] += torch.stack([(r * g).sum(), (r * r).sum()]).double()
        squares[i] += (g * g).sum().double()
    norms, kept = squares.sqrt(), torch.zeros(4, dtype=torch.long)
    assert unchanged(terms, norms, kept).tolist() == [True, False, False, True]
    assert unchanged(terms, norms, torch.tensor([0, 1, 0, 0])).tolist() == [True, True, False, True]
    terms[3, 1] = 0.0
    assert unchanged(terms, norms, kept).tolist() == [True, False, False, False]
