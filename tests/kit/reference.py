"""Dense references, built independently of hylo from a layer's input and autograd's output gradient.

- K-FAC: (A ⊗ G + λI) vec(V) = vec(∇W) with column-major vec, W of shape (d_g, d_a);
- SNGD:  (F + λI) vec(V) = vec(∇W), F = (1/B) Σ u_i u_iᵀ, u_i = vec(g_i a_iᵀ);
- the true empirical-Fisher natural gradient, F built from the model's per-sample gradients
  (autograd, one sample at a time; :func:`per_sample_matrices`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.kit.checks import grad_matrix

#: Conv2d configurations the dense comparisons cover (padding modes, strides, dilations, "same").
CONV_CASES: dict[str, dict[str, object]] = {
    "plain": {"kernel_size": 3},
    "stride2-pad1": {"kernel_size": 3, "stride": 2, "padding": 1},
    "dilation2": {"kernel_size": 3, "dilation": 2, "padding": 1},
    "rect-stride": {"kernel_size": (3, 2), "stride": (2, 1), "padding": (1, 0)},
    "same-even": {"kernel_size": (2, 4), "padding": "same"},
    "same-even-dilated": {"kernel_size": 2, "dilation": 3, "padding": "same"},
    "reflect": {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
    "reflect-same-even": {"kernel_size": (2, 4), "padding": "same", "padding_mode": "reflect"},
    "replicate-stride2": {"kernel_size": 3, "stride": 2, "padding": 2, "padding_mode": "replicate"},
    "circular": {"kernel_size": 3, "padding": 1, "padding_mode": "circular"},
}


def vec_cm(mat: Tensor) -> Tensor:
    """Column-major vec."""
    return mat.mT.reshape(-1)


def dense_kfac(factor_a: Tensor, factor_g: Tensor, grad: Tensor, damping: float) -> Tensor:
    """V with (A ⊗ G + λI) vec(V) = vec(∇W), column-major vec (so kron(A, G) vec(X) = vec(G X Aᵀ))."""
    d_g, d_a = grad.shape
    mat = torch.kron(factor_a, factor_g) + damping * torch.eye(d_a * d_g, dtype=grad.dtype)
    return torch.linalg.solve(mat, vec_cm(grad)).reshape(d_a, d_g).mT


def dense_sngd(a: Tensor, g: Tensor, grad: Tensor, damping: float) -> Tensor:
    """V with (F + λI) vec(V) = vec(∇W), F = (1/B) Σ u_i u_iᵀ, u_i = vec(g_i a_iᵀ) (row-major vec)."""
    return dense_natural_gradient(torch.einsum("bi,bj->bij", g, a), grad, damping)


def dense_natural_gradient(per_sample: Tensor, grad: Tensor, damping: float) -> Tensor:
    """V with (F + λI) vec(V) = vec(∇W), F = (1/B) Σ vec(U_i) vec(U_i)ᵀ for per-sample matrices U (B, d_g, d_a)."""
    rows = per_sample.shape[0]
    u = per_sample.reshape(rows, -1)
    fisher = u.mT @ u / rows
    sol = torch.linalg.solve(fisher + damping * torch.eye(fisher.shape[0], dtype=grad.dtype), grad.reshape(-1))
    return sol.reshape(grad.shape)


def per_sample_matrices(
    model: nn.Module, layers: dict[str, nn.Module], x: Tensor, loss_fn: Callable[[Tensor], Tensor]
) -> dict[str, Tensor]:
    """True per-sample gradients U_i (B, d_g, d_a; bias as the last column) of each of ``layers``.

    Sample i's forward runs alone and the others' outputs are detached, so the backward of the
    batch loss gives sample i's share; U_i is B times it, so ∇W = (1/B) Σ U_i for a loss that
    is a mean over samples. Plain autograd, one sample at a time: nothing of hylo is used.
    """
    n = x.shape[0]
    mats: dict[str, list[Tensor]] = {name: [] for name in layers}
    for i in range(n):
        model.zero_grad()
        outs = [model(x[j : j + 1]) if j == i else model(x[j : j + 1]).detach() for j in range(n)]
        loss_fn(torch.cat(outs)).backward()
        for name, layer in layers.items():
            mats[name].append(n * grad_matrix(layer))
    model.zero_grad()
    return {name: torch.stack(m) for name, m in mats.items()}


def u_rows(a: Tensor, g: Tensor) -> Tensor:
    """U (n × d_g·d_a) with rows u_i = vec(g_i a_iᵀ)."""
    return (g[:, :, None] * a[:, None, :]).reshape(a.shape[0], -1)


def linear_rows(layer: nn.Linear, x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    """a_i = input row (trailing 1 with bias), g_i = n · ∂L/∂s_i; every leading position is a row."""
    a = x.detach().reshape(-1, x.shape[-1])
    if layer.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
    n = a.shape[0]
    g = n * grad_out.reshape(-1, grad_out.shape[-1])
    return a, g


def explicit_padding(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """The padded input the convolution actually sees (checked against the layer's output)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            pads = [(0, 0), (0, 0)]
        else:
            totals = [d * (k - 1) for k, d in zip(conv.kernel_size, conv.dilation, strict=True)]
            pads = [(t // 2, t - t // 2) for t in totals]
    else:
        pads = [(p, p) for p in conv.padding]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    return F.pad(x, [*pads[1], *pads[0]], mode=mode)


def conv_reference(conv: nn.Conv2d, x: Tensor, out: Tensor, grad_out: Tensor) -> dict[str, Tensor]:
    """Gradient, per-sample surrogate rows and KFC factors of a Conv2d, from unfold.

    ``a`` holds the mean patches, ``g`` HyLo's mean output gradients and ``g_sum`` their sums
    over positions (B·∂L/∂s throughout); ``A`` is the mean over samples and positions of the
    patches' outer products, ``G`` the sum over positions (mean over samples) of g gᵀ, and
    ``positions`` the number L of output positions.
    """
    x = x.detach()
    xp = explicit_padding(conv, x)
    # the reference padding must reproduce the layer's own output
    replay = F.conv2d(xp, conv.weight, conv.bias, conv.stride, 0, conv.dilation)
    torch.testing.assert_close(replay, out.detach(), rtol=1e-12, atol=1e-12)
    patches = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)  # (n, C·kh·kw, L)
    n, _, positions = patches.shape
    if conv.bias is not None:
        patches = torch.cat([patches, torch.ones(n, 1, positions, dtype=patches.dtype)], dim=1)
    ds = grad_out.reshape(n, grad_out.shape[1], positions)
    gs = n * ds
    return {
        "grad": torch.einsum("ngl,nal->ga", ds, patches),
        "a": patches.mean(dim=2),
        "g": gs.mean(dim=2),
        "g_sum": gs.sum(dim=2),
        "A": torch.einsum("nal,nbl->ab", patches, patches) / (n * positions),
        "G": torch.einsum("ngl,nhl->gh", gs, gs) / n,
        "positions": torch.tensor(float(positions), dtype=patches.dtype),
    }


def numpy_power_refresh(factor: np.ndarray, basis: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step of subspace iteration on F + σI from ``basis`` (σ = ``POWER_SHIFT`` times the largest Rayleigh
    quotient; docs/solvers.md, "The warm-started basis"), written with NumPy: (eigenvalue estimates ascending,
    basis, old column of each)."""
    from hylo.numerics import POWER_SHIFT

    sym = (factor + factor.T) / 2
    quotients = np.einsum("ij,ij->j", basis, sym @ basis)
    order = np.argsort(-quotients, kind="stable")
    shift = POWER_SHIFT * quotients.max() if quotients.max() > 0 else 1.0
    q, r = np.linalg.qr((sym + shift * np.eye(sym.shape[0])) @ basis[:, order])
    q = q * np.where(np.diag(r) < 0, -1.0, 1.0)
    return np.maximum(quotients[order][::-1], 0.0), q[:, ::-1], order[::-1]
