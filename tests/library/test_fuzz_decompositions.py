"""Fuzz of the eigendecompositions K-FAC's factors go through (``hylo.numerics.eigh_many``; docs/solvers.md, "Numerics").

Each example draws a batch of symmetric PSD matrices — equal shapes (one batched call) and others — whose spectra are
tiny (down to 10⁻⁴⁰, subnormal in float32), huge (up to 10³⁰), rank-deficient, repeated, or spread over 40 orders of
magnitude, or shaped like a dead layer's A factor (zeros, entries near 10⁻¹⁶ and a bias entry of 1), in float32 or
float64; and optionally a batched ``torch.linalg.eigh`` that fails *without raising* on some of them (NaN eigenvalues
or eigenvectors, or eigenvectors that are not orthogonal), as float32 LAPACK ``syevd`` does on some processors.

Properties, checked against the matrix itself in float64 (not against another decomposition):

1. every result is finite, its eigenvalues are ≥ 0, its eigenvectors orthogonal (‖QᵀQ − I‖ ≤ tolerance);
2. it reconstructs the matrix: ‖Q diag(e) Qᵀ − A‖ ≤ tolerance · ‖A‖ (eigenvalues clamped at 0 move it by at most
   the round-off of the negative ones);
3. a matrix whose batched decomposition failed gets the same answer as one whose decomposition did not.

``test_decompositions`` runs a bounded, derandomized set; ``test_decompositions_many`` (``-m slow``) many more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import Tensor

from hylo.numerics import eigh_many

pytestmark = pytest.mark.usefixtures("single_thread")

SPECTRA = ("tiny", "huge", "rank_deficient", "repeated", "spread", "dead_layer")
#: Tolerance of the orthogonality and reconstruction checks per dtype, times the matrix's size.
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12}


@dataclass(frozen=True)
class Matrix:
    """One drawn factor: its size, spectrum kind, seed, and how the batched call breaks on it (None: it doesn't)."""

    size: int
    spectrum: str
    seed: int
    breaks: str | None


def _eigenvalues(kind: str, size: int, gen: torch.Generator) -> Tensor:
    u = torch.rand(size, dtype=torch.float64, generator=gen)
    if kind == "tiny":
        return 10.0 ** (-40.0 + 25.0 * u)
    if kind == "huge":
        return 10.0 ** (10.0 + 20.0 * u)
    if kind == "rank_deficient":
        return torch.where(torch.arange(size) < max(1, size // 3), u + 0.1, torch.zeros_like(u))
    if kind == "repeated":
        return torch.where(torch.arange(size) % 2 == 0, torch.ones_like(u), torch.full_like(u, 1e-3))
    return 10.0 ** (-30.0 + 40.0 * u)  # spread


def factor(m: Matrix, dtype: torch.dtype) -> Tensor:
    """The drawn symmetric PSD matrix in ``dtype``."""
    gen = torch.Generator().manual_seed(m.seed)
    if m.spectrum == "dead_layer":  # A = E[a aᵀ] of inputs that died (≈ 10⁻⁸) beside the bias's constant 1
        a = torch.randn(32, m.size, dtype=torch.float64, generator=gen) * 1e-8
        a[:, torch.rand(m.size, generator=gen) < 0.5] = 0.0
        a[:, -1] = 1.0
        return (a.mT @ a / 32).to(dtype)
    q, _ = torch.linalg.qr(torch.randn(m.size, m.size, dtype=torch.float64, generator=gen))
    mat = (q * _eigenvalues(m.spectrum, m.size, gen)) @ q.mT
    return (0.5 * (mat + mat.mT)).to(dtype)


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.dtype, list[Matrix]]:
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    shared = draw(st.integers(1, 24))  # several matrices of this size: one batched call
    sizes = [shared] * draw(st.integers(1, 4)) + draw(st.lists(st.integers(1, 24), max_size=2))
    mats = [
        Matrix(
            size,
            draw(st.sampled_from(SPECTRA)),
            draw(st.integers(0, 2**31 - 1)),
            draw(st.sampled_from([None, None, "nan_values", "nan_vectors", "not_orthogonal"])),
        )
        for size in sizes
    ]
    return dtype, mats


def _silently_failing(
    eigh: Callable[[Tensor], tuple[Tensor, Tensor]], broken: list[tuple[Tensor, str]]
) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """``eigh`` whose batched call returns garbage, without raising, for the matrices equal to one in ``broken``
    (the kind of garbage after each: NaN eigenvalues, NaN eigenvectors, or eigenvectors scaled by 1.5)."""

    def call(stack: Tensor) -> tuple[Tensor, Tensor]:
        evals, evecs = eigh(stack)
        if stack.dim() == 3:
            evals, evecs = evals.clone(), evecs.clone()
            for k in range(stack.shape[0]):
                for mat, how in broken:
                    if mat.shape == stack[k].shape and mat.dtype == stack.dtype and torch.equal(mat, stack[k]):
                        if how == "nan_values":
                            evals[k] = math.nan
                        elif how == "nan_vectors":
                            evecs[k, 0, 0] = math.nan
                        else:
                            evecs[k] *= 1.5
        return evals, evecs

    return call


def check(dtype: torch.dtype, mats: list[Matrix], monkeypatch: pytest.MonkeyPatch) -> None:
    factors = [factor(m, dtype) for m in mats]
    syms = [0.5 * (f + f.mT) for f in factors]  # what eigh_many decomposes
    broken = [(sym, m.breaks) for sym, m in zip(syms, mats, strict=True) if m.breaks is not None]
    with monkeypatch.context() as patch:
        patch.setattr(torch.linalg, "eigh", _silently_failing(torch.linalg.eigh, broken))
        results = eigh_many(factors)
    clean = eigh_many(factors)
    tol = TOLERANCE[dtype]
    for m, mat, (evals, evecs), (clean_evals, _) in zip(mats, factors, results, clean, strict=True):
        event(f"{dtype} {m.spectrum} breaks={m.breaks}")
        assert evals.dtype == evecs.dtype == dtype
        assert torch.isfinite(evals).all() and torch.isfinite(evecs).all(), m
        assert (evals >= 0).all(), m
        q, e, a = evecs.double(), evals.double(), mat.double()
        eye = torch.eye(m.size, dtype=torch.float64)
        assert torch.linalg.matrix_norm(q.mT @ q - eye) <= tol * m.size, m
        scale = torch.linalg.matrix_norm(a)
        assert torch.linalg.matrix_norm((q * e) @ q.mT - a) <= tol * m.size * max(float(scale), 1e-300), m
        # the repaired decomposition has the eigenvalues of the intact one (up to its accuracy)
        assert (e - clean_evals.double()).abs().max() <= tol * m.size * max(float(scale), 1e-300), m


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(case=batches())
def test_decompositions(case: tuple[torch.dtype, list[Matrix]]) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        check(*case, monkeypatch)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, database=None)
@given(case=batches())
def test_decompositions_many(case: tuple[torch.dtype, list[Matrix]]) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        check(*case, monkeypatch)
