"""The exact solvers (``kfac``, ``sngd``) against dense references built independently here.

Every reference is assembled from the layer's input and the autograd gradient w.r.t. its output
(``out.retain_grad()``), never from hylo's own capture or row code, and then solved densely:

- K-FAC: (A ⊗ G + λI) vec(V) = vec(∇W) with column-major vec, W of shape (d_g, d_a);
- SNGD:  (F + λI) vec(V) = vec(∇W), F = (1/B) Σ u_i u_iᵀ, u_i = vec(g_i a_iᵀ).

Models are float64 so the comparisons can be tight (relative 1e-8 in the Frobenius norm).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64
RTOL = 1e-8


# --------------------------------------------------------------------------- dense references
def rel_err(actual: Tensor, expected: Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def assert_rel_close(actual: Tensor, expected: Tensor, rtol: float = RTOL) -> None:
    assert actual.shape == expected.shape
    err = rel_err(actual, expected)
    assert err <= rtol, f"relative error {err:.3e} > {rtol:g}"


def grad_matrix(module: nn.Module) -> Tensor:
    """∇W of a Linear/Conv2d as (d_g, d_a), bias as the last column (a copy)."""
    weight = module.weight
    grad = weight.grad.reshape(weight.shape[0], -1)
    if module.bias is not None:
        grad = torch.cat([grad, module.bias.grad.reshape(-1, 1)], dim=1)
    return grad.detach().clone()


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
    rows = a.shape[0]
    u = torch.einsum("bi,bj->bij", g, a).reshape(rows, -1)
    fisher = u.mT @ u / rows
    sol = torch.linalg.solve(fisher + damping * torch.eye(fisher.shape[0], dtype=grad.dtype), grad.reshape(-1))
    return sol.reshape(grad.shape)


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
    """Gradient, per-sample surrogate rows and KFC factors of a Conv2d, from unfold."""
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
        "A": torch.einsum("nal,nbl->ab", patches, patches) / (n * positions),
        "G": torch.einsum("ngl,nhl->gh", gs, gs) / n,
    }


def one_step(
    module: nn.Module, x: Tensor, loss_fn: Callable[[Tensor], Tensor], **options: object
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One forward/backward/precondition of a single-layer model: (out, out.grad, ∇W, V̂)."""
    pre = HyLoPreconditioner(module, update_freq=1, **options)
    out = module(x)
    out.retain_grad()
    loss_fn(out).backward()
    grad = grad_matrix(module)
    pre.step()
    return out, out.grad, grad, grad_matrix(module)


def fixed_target(shape: torch.Size, seed: int = 1) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def test_reference_vec_convention() -> None:
    """kron(A, G) acts on column-major vec as X ↦ G X Aᵀ (the convention dense_kfac relies on)."""
    a, g, x = torch.randn(4, 4, dtype=DT), torch.randn(3, 3, dtype=DT), torch.randn(3, 4, dtype=DT)
    torch.testing.assert_close(torch.kron(a, g) @ vec_cm(x), vec_cm(g @ x @ a.mT), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- 1. Linear
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(6, 5), (4, 3, 5)], ids=["2d", "leading-dims"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_linear_matches_dense(solver: str, bias: bool, shape: tuple[int, ...], loss: str) -> None:
    damping = 0.05
    layer = nn.Linear(5, 3, bias=bias, dtype=DT)
    x = torch.randn(shape, dtype=DT)
    labels = torch.randint(0, 3, shape[:-1])
    if loss == "ce":

        def loss_fn(out: Tensor) -> Tensor:
            return F.cross_entropy(out.reshape(-1, 3), labels.reshape(-1))

    else:

        def loss_fn(out: Tensor) -> Tensor:
            return F.mse_loss(out, fixed_target(out.shape))

    _, dout, grad, got = one_step(layer, x, loss_fn, solver=solver, damping=damping)
    a, g = linear_rows(layer, x, dout)
    rows = a.shape[0]
    assert rows == x[..., 0].numel()
    assert_rel_close(g.mT @ a / rows, grad, 1e-12)  # the reference rows reproduce ∇W
    if solver == "kfac":
        expected = dense_kfac(a.mT @ a / rows, g.mT @ g / rows, grad, damping)
    else:
        expected = dense_sngd(a, g, grad, damping)
    assert rel_err(expected, grad / damping) > 1e-2  # the curvature matters at this damping
    assert_rel_close(got, expected)


# --------------------------------------------------------------------------- 1. Conv2d
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


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv2d_matches_dense(solver: str, bias: bool, case: str) -> None:
    damping = 1e-5
    conv = nn.Conv2d(2, 3, bias=bias, dtype=DT, **CONV_CASES[case])
    x = torch.randn(3, 2, 6, 7, dtype=DT)

    def loss_fn(out: Tensor) -> Tensor:
        return F.mse_loss(out, fixed_target(out.shape))

    out, dout, grad, got = one_step(conv, x, loss_fn, solver=solver, damping=damping)
    ref = conv_reference(conv, x, out, dout)
    assert_rel_close(ref["grad"], grad, 1e-12)  # unfold + padding reproduce autograd's ∇W
    if solver == "kfac":
        expected = dense_kfac(ref["A"], ref["G"], grad, damping)
    else:
        expected = dense_sngd(ref["a"], ref["g"], grad, damping)
    assert rel_err(expected, grad / damping) > 1e-2
    assert_rel_close(got, expected)


# --------------------------------------------------------------------------- 2. 1×1 conv == Linear
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv1x1_on_1x1_image_equals_linear(solver: str, bias: bool) -> None:
    lin = nn.Linear(4, 3, bias=bias, dtype=DT)
    conv = nn.Conv2d(4, 3, 1, bias=bias, dtype=DT)
    with torch.no_grad():
        conv.weight.copy_(lin.weight.reshape(3, 4, 1, 1))
        if bias:
            conv.bias.copy_(lin.bias)
    x = torch.randn(5, 4, dtype=DT)
    labels = torch.randint(0, 3, (5,))
    _, _, grad_lin, v_lin = one_step(lin, x, lambda out: F.cross_entropy(out, labels), solver=solver, damping=0.05)
    _, _, grad_conv, v_conv = one_step(
        conv,
        x.reshape(5, 4, 1, 1),
        lambda out: F.cross_entropy(out.reshape(5, 3), labels),
        solver=solver,
        damping=0.05,
    )
    torch.testing.assert_close(grad_conv, grad_lin, rtol=1e-12, atol=1e-14)
    assert rel_err(v_lin, grad_lin / 0.05) > 1e-2
    torch.testing.assert_close(v_conv, v_lin, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- 3. in-place ReLU
def _conv_relu_net(inplace: bool) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, dtype=DT),
        nn.ReLU(inplace=inplace),
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 4, dtype=DT),
    )


@pytest.mark.parametrize("solver", ["sngd", "kfac"])
def test_conv_followed_by_inplace_relu(solver: str) -> None:
    damping = 0.01
    model = _conv_relu_net(inplace=True)
    ref = _conv_relu_net(inplace=False)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    labels = torch.randint(0, 4, (4,))

    pre = HyLoPreconditioner(model, solver=solver, update_freq=1, damping=damping)
    F.cross_entropy(model(x), labels).backward()
    conv_layer = next(layer for layer in pre.layers if layer.name == "0")
    (record,) = conv_layer.capture.records
    grads = [grad_matrix(model[0]), grad_matrix(model[3])]
    pre.step()

    # independent reference: same weights, out-of-place ReLU, gradients via retain_grad
    s = ref[0](x)
    s.retain_grad()
    h = ref[1](s)
    h.retain_grad()
    flat = ref[2](h)
    logits = ref[3](flat)
    logits.retain_grad()
    F.cross_entropy(logits, labels).backward()
    assert not torch.equal(s.grad, h.grad)  # the ReLU masks something: pre- and post-ReLU differ
    torch.testing.assert_close(record.grad_output, s.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[0], grad_matrix(ref[0]), rtol=1e-12, atol=1e-14)

    conv_ref = conv_reference(ref[0], x, s, s.grad)
    a, g = linear_rows(ref[3], flat, logits.grad)
    if solver == "sngd":
        expected_conv = dense_sngd(conv_ref["a"], conv_ref["g"], grads[0], damping)
        expected_lin = dense_sngd(a, g, grads[1], damping)
    else:
        expected_conv = dense_kfac(conv_ref["A"], conv_ref["G"], grads[0], damping)
        expected_lin = dense_kfac(a.mT @ a / 4, g.mT @ g / 4, grads[1], damping)
    assert_rel_close(grad_matrix(model[0]), expected_conv)
    assert_rel_close(grad_matrix(model[3]), expected_lin)


# --------------------------------------------------------------------------- 5. callable damping
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_callable_damping_is_evaluated_per_update(solver: str) -> None:
    def schedule(step: int) -> float:
        return 0.2 / (step + 1)

    layer = nn.Linear(4, 3, dtype=DT)
    # factor_decay=0 makes every K-FAC update use the batch factors alone
    pre = HyLoPreconditioner(layer, solver=solver, update_freq=1, damping=schedule, factor_decay=0.0)
    for step in range(3):
        layer.zero_grad()
        x = torch.randn(6, 4, dtype=DT)
        labels = torch.randint(0, 3, (6,))
        out = layer(x)
        out.retain_grad()
        F.cross_entropy(out, labels).backward()
        grad = grad_matrix(layer)
        pre.step()
        a, g = linear_rows(layer, x, out.grad)
        lam = schedule(step)
        if solver == "kfac":
            expected = dense_kfac(a.mT @ a / 6, g.mT @ g / 6, grad, lam)
        else:
            expected = dense_sngd(a, g, grad, lam)
        assert_rel_close(grad_matrix(layer), expected)


# --------------------------------------------------------------------------- 6. K-FAC running average
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_kfac_running_average(kind: str) -> None:
    decay, damping = 0.7, 0.05
    if kind == "linear":
        layer: nn.Module = nn.Linear(4, 3, dtype=DT)
    else:
        layer = nn.Conv2d(2, 3, 3, stride=2, padding=1, dtype=DT)
    pre = HyLoPreconditioner(layer, solver="kfac", update_freq=1, factor_decay=decay, damping=damping)
    running: tuple[Tensor, Tensor] | None = None
    for step in range(3):
        layer.zero_grad()
        x = torch.randn((6, 4) if kind == "linear" else (3, 2, 5, 5), dtype=DT)
        out = layer(x)
        out.retain_grad()
        F.mse_loss(out, fixed_target(out.shape, seed=step)).backward()
        grad = grad_matrix(layer)
        pre.step()
        if kind == "linear":
            a, g = linear_rows(layer, x, out.grad)
            batch = (a.mT @ a / a.shape[0], g.mT @ g / a.shape[0])
        else:
            ref = conv_reference(layer, x, out, out.grad)
            batch = (ref["A"], ref["G"])
        if running is None:  # the first update takes the batch factors as they are
            running = batch
        else:
            running = tuple(decay * old + (1 - decay) * new for old, new in zip(running, batch, strict=True))
        state = pre.layers[0].state
        assert_rel_close(state.factor_a, running[0], 1e-12)
        assert_rel_close(state.factor_g, running[1], 1e-12)
        assert_rel_close(grad_matrix(layer), dense_kfac(running[0], running[1], grad, damping))


# --------------------------------------------------------------------------- several forward calls per step
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_gradient_accumulation_matches_one_batch(solver: str) -> None:
    damping = 0.05
    whole = nn.Linear(4, 3, dtype=DT)
    accumulated = nn.Linear(4, 3, dtype=DT)
    accumulated.load_state_dict(whole.state_dict())
    x = torch.randn(8, 4, dtype=DT)
    labels = torch.randint(0, 3, (8,))
    _, dout, grad, expected_v = one_step(
        whole, x, lambda out: F.cross_entropy(out, labels), solver=solver, damping=damping
    )
    a, g = linear_rows(whole, x, dout)
    if solver == "kfac":
        assert_rel_close(expected_v, dense_kfac(a.mT @ a / 8, g.mT @ g / 8, grad, damping))
    else:
        assert_rel_close(expected_v, dense_sngd(a, g, grad, damping))

    pre = HyLoPreconditioner(accumulated, solver=solver, update_freq=1, damping=damping)
    for xs, ys in zip(x.split(4), labels.split(4), strict=True):  # two micro-batches, loss / 2 each
        (F.cross_entropy(accumulated(xs), ys) / 2).backward()
    assert_rel_close(grad_matrix(accumulated), grad, 1e-12)
    pre.step()
    assert_rel_close(grad_matrix(accumulated), expected_v)


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_layer_called_twice_matches_one_call_on_stacked_input(solver: str) -> None:
    once = nn.Linear(4, 3, dtype=DT)
    twice = nn.Linear(4, 3, dtype=DT)
    twice.load_state_dict(once.state_dict())
    x1, x2 = torch.randn(5, 4, dtype=DT), torch.randn(5, 4, dtype=DT)
    labels = torch.randint(0, 3, (10,))
    _, _, _, expected_v = one_step(
        once, torch.cat([x1, x2]), lambda out: F.cross_entropy(out, labels), solver=solver, damping=0.05
    )
    pre = HyLoPreconditioner(twice, solver=solver, update_freq=1, damping=0.05)
    F.cross_entropy(torch.cat([twice(x1), twice(x2)]), labels).backward()
    pre.step()
    assert_rel_close(grad_matrix(twice), expected_v)


# --------------------------------------------------------------------------- eigh failures
def _failing_eigh(*args: object, **kwargs: object) -> None:
    raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge (simulated)")


def test_kfac_falls_back_when_torch_eigh_does_not_converge(monkeypatch: pytest.MonkeyPatch) -> None:
    """LAPACK's syevd can fail on large factors with repeated eigenvalues, even in float64: the
    SciPy QR-iteration fallback must give the same preconditioned gradient as the dense solve."""
    damping = 0.05
    layer = nn.Linear(5, 3, dtype=DT)
    x = torch.randn(7, 5, dtype=DT)
    monkeypatch.setattr(torch.linalg, "eigh", _failing_eigh)
    _, dout, grad, got = one_step(layer, x, lambda out: F.mse_loss(out, fixed_target(out.shape)), solver="kfac",
                                  damping=damping)  # fmt: skip
    a, g = linear_rows(layer, x, dout)
    rows = a.shape[0]
    assert_rel_close(got, dense_kfac(a.mT @ a / rows, g.mT @ g / rows, grad, damping))


def test_kfac_keeps_previous_state_when_every_eigh_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import scipy.linalg

    layer = nn.Linear(5, 3, dtype=DT)
    pre = HyLoPreconditioner(layer, solver="kfac", update_freq=1, damping=0.05)
    x = torch.randn(7, 5, dtype=DT)
    F.mse_loss(layer(x), fixed_target((7, 3))).backward()
    pre.step()
    stored = {k: v.clone() for k, v in pre.layers[0].state.tensors().items()}

    def fail_scipy(*args: object, **kwargs: object) -> None:
        raise scipy.linalg.LinAlgError("simulated")

    monkeypatch.setattr(torch.linalg, "eigh", _failing_eigh)
    monkeypatch.setattr(scipy.linalg, "eigh", fail_scipy)
    layer.zero_grad()
    F.mse_loss(layer(2 * x), fixed_target((7, 3))).backward()
    grad = grad_matrix(layer)
    with pytest.warns(UserWarning, match="non-finite curvature"):
        pre.step()
    for key, value in pre.layers[0].state.tensors().items():
        assert torch.equal(value, stored[key]), key
    state = pre.layers[0].state
    expected = dense_kfac(stored["factor_a"], stored["factor_g"], grad, 0.05)
    assert state is not None and rel_err(grad_matrix(layer), expected) < RTOL
