"""nn.ConvTranspose2d, nn.ConvTranspose1d and nn.Conv1d against references built without hylo (docs/solvers.md,
"Transposed convolutions").

Every reference comes from the layer itself through torch: the true per-sample gradients by
``torch.func`` (vmap of grad on one sample's loss), and each output position's patch a_ip as the
Jacobian of output channel 0 with respect to that channel's weights (s_ip = W a_ip + b is linear
in W). Both are laid out in the module's own weight order: no zero insertion, padding or kernel
flip of hylo's is reused, and the dense solves of (F + λI), (A ⊗ G + λI) are invariant under that
reordering of W's entries. float64 throughout.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap

from hylo import HyLoPreconditioner
from hylo.layers import ConvMath, ConvTransposeMath, DenseRows
from tests.kit.checks import (
    DT,
    REPLAY_RTOL,
    Unfolds,
    assert_rel_close,
    assert_same_step,
    assert_same_tensors,
    rel_err,
)
from tests.kit.models import fixed_target
from tests.kit.reference import dense_kfac, dense_natural_gradient, dense_sngd

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d)


class Layer(nn.Module):
    """One convolution, called with ``output_size`` when given (the module is ``layer``)."""

    def __init__(self, layer: nn.Module, output_size: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.output_size = output_size

    def forward(self, x: Tensor) -> Tensor:
        if self.output_size is None:
            return self.layer(x)
        return self.layer(x, output_size=list(self.output_size))


@dataclass(frozen=True)
class Geometry:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    output_size: tuple[int, ...] | None = None


GEOMETRIES: dict[str, Geometry] = {
    "t2d-stride2-pad-outpad": Geometry(
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1), (4, 2, 3, 4)
    ),
    "t2d-unet-2x2": Geometry(lambda: nn.ConvTranspose2d(3, 2, 2, stride=2), (4, 3, 3, 3)),
    "t2d-dilation-rect": Geometry(
        lambda: nn.ConvTranspose2d(2, 3, (3, 2), stride=(1, 2), padding=(2, 0), dilation=(2, 1)), (4, 2, 4, 3)
    ),
    "t2d-nobias-crop": Geometry(lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=3, bias=False), (4, 2, 5, 4)),
    "t2d-output-size": Geometry(lambda: nn.ConvTranspose2d(2, 3, 3, stride=3, padding=1), (4, 2, 3, 3), (8, 9)),
    "t1d-stride3-dilation": Geometry(
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=3, padding=1, output_padding=2, dilation=2), (4, 2, 5)
    ),
    "t1d-nobias": Geometry(lambda: nn.ConvTranspose1d(3, 2, 4, stride=2, padding=1, bias=False), (4, 3, 6)),
    "c1d-stride2-pad": Geometry(lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1), (4, 2, 9)),
    "c1d-same-reflect": Geometry(lambda: nn.Conv1d(2, 3, 4, padding="same", padding_mode="reflect"), (4, 2, 7)),
}


@dataclass
class Reference:
    """What the dense oracles need from one float64 step of a geometry, all in W_ref's layout."""

    #: ∇W (d_g, d_a): W_ref[o, (c, k)] = the module's weight at (c, o, k) (transposed) or (o, c, k), bias last.
    grad: Tensor
    #: True per-sample gradients U_i (n, d_g, d_a).
    per_sample: Tensor
    #: Patches a_ip (n, L, d_a), a trailing 1 with a bias, and g_ip = n·∂L/∂s_ip (n, L, d_g).
    patches: Tensor
    g: Tensor


def ref_matrix(layer: nn.Module, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A weight-shaped tensor (and bias) as W_ref (d_g, d_a): output channels first, kernel order kept."""
    if isinstance(layer, TRANSPOSED):
        weight = weight.transpose(0, 1)
    matrix = weight.reshape(weight.shape[0], -1)
    return matrix if bias is None else torch.cat([matrix, bias.reshape(-1, 1)], dim=1)


def grad_ref(layer: nn.Module) -> Tensor:
    bias = layer.bias.grad if layer.bias is not None else None
    return ref_matrix(layer, layer.weight.grad, bias).detach().clone()


def loss_of(out: Tensor) -> Tensor:
    return F.mse_loss(out, fixed_target(out.shape))


def build(name: str, seed: int = 0) -> tuple[Layer, Tensor]:
    """The geometry's float64 layer (wrapped) and its input, the same for the same ``seed``."""
    geometry = GEOMETRIES[name]
    torch.manual_seed(seed)
    model = Layer(geometry.build().to(DT), geometry.output_size)
    return model, torch.randn(geometry.input_shape, dtype=DT)


def reference(name: str) -> Reference:
    """The geometry's ∇W, true per-sample gradients, patches and output gradients, each checked against ∇W."""
    model, x = build(name)
    layer, n = model.layer, x.shape[0]
    out = model(x)
    out.retain_grad()
    loss_of(out).backward()
    target = fixed_target(out.shape)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p: dict[str, Tensor], xi: Tensor, ti: Tensor) -> Tensor:
        return F.mse_loss(functional_call(model, p, (xi[None],)), ti[None])

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, target)  # U_i = n × sample i's share
    biases = grads["layer.bias"] if layer.bias is not None else [None] * n
    per_sample = torch.stack([ref_matrix(layer, grads["layer.weight"][i], biases[i]) for i in range(n)])
    jac = jacrev(lambda w: functional_call(model, {"layer.weight": w}, (x,)))(params["layer.weight"])
    # jac: out.shape + weight.shape; output channel 0 against the weights of output channel 0
    channel = x.dim() - 1 + (1 if isinstance(layer, TRANSPOSED) else 0)
    positions = out[0, 0].numel()
    patches = jac[:, 0].select(channel, 0).reshape(n, positions, -1)
    if layer.bias is not None:
        patches = torch.cat([patches, torch.ones(n, positions, 1, dtype=DT)], dim=2)
    assert out.grad is not None
    g = n * out.grad.reshape(n, out.shape[1], positions).transpose(1, 2)
    result = Reference(grad_ref(layer), per_sample, patches, g)
    assert_rel_close(torch.einsum("npg,npa->ga", g, patches) / n, result.grad, REPLAY_RTOL)  # the patches are right
    assert_rel_close(per_sample.mean(0), result.grad, REPLAY_RTOL)  # so are the per-sample gradients
    return result


def preconditioned(name: str, **options: object) -> Tensor:
    """hylo's preconditioned gradient of one step of the geometry, read from the module's .grad as W_ref."""
    model, x = build(name)
    pre = HyLoPreconditioner(model, update_freq=1, **options)
    loss_of(model(x)).backward()
    pre.step()
    pre.remove()
    return grad_ref(model.layer)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_exact_rows_sngd_is_the_true_natural_gradient(name: str) -> None:
    """``conv_rows="exact"``: sngd is (F + λI)⁻¹ vec ∇W, F from the true per-sample gradients."""
    ref, damping = reference(name), 1e-3
    expected = dense_natural_gradient(ref.per_sample, ref.grad, damping)
    assert rel_err(expected, ref.grad / damping) > 1e-2  # the curvature matters at this damping
    assert_rel_close(preconditioned(name, solver="sngd", conv_rows="exact", damping=damping), expected, 1e-10)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_kfac_is_the_dense_kronecker_solve(name: str) -> None:
    """A = mean over samples and positions of a aᵀ, G = Σ_p (mean over samples) of g gᵀ (the KFC factors, e = 1)."""
    ref, damping = reference(name), 1e-2
    n, positions = ref.patches.shape[:2]
    factor_a = torch.einsum("npa,npb->ab", ref.patches, ref.patches) / (n * positions)
    factor_g = torch.einsum("npg,nph->gh", ref.g, ref.g) / n
    expected = dense_kfac(factor_a, factor_g, ref.grad, damping)
    assert rel_err(expected, ref.grad / damping) > 1e-2
    assert_rel_close(preconditioned(name, solver="kfac", damping=damping), expected, 1e-10)


@pytest.mark.parametrize("rows", ["sum", "mean"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_surrogate_rows_match_their_formula(name: str, rows: str) -> None:
    """a_i = mean_p a_ip, g_i = Σ_p g_ip (``"sum"``: with a bias, the true per-sample bias gradient) or mean_p."""
    ref, damping = reference(name), 1e-4
    g = ref.g.sum(1) if rows == "sum" else ref.g.mean(1)
    if rows == "sum" and GEOMETRIES[name].build().bias is not None:
        assert_rel_close(g, ref.per_sample[:, :, -1], REPLAY_RTOL)
    expected = dense_sngd(ref.patches.mean(1), g, ref.grad, damping)
    assert rel_err(expected, ref.grad / damping) > 1e-2
    assert_rel_close(preconditioned(name, solver="sngd", conv_rows=rows, damping=damping), expected, 1e-10)


@pytest.mark.parametrize("rows", ["exact", "sum"])
@pytest.mark.parametrize("name", ["t2d-stride2-pad-outpad", "t1d-stride3-dilation", "c1d-stride2-pad"])
def test_kid_and_kis_at_full_rank_are_sngd(name: str, rows: str) -> None:
    sngd = preconditioned(name, solver="sngd", conv_rows=rows, damping=1e-3)
    for solver in ("kid", "kis"):
        got = preconditioned(name, solver=solver, conv_rows=rows, damping=1e-3, rank_ratio=1.0)
        assert_rel_close(got, sngd, 1e-9)


def decoder(seed: int) -> nn.Sequential:
    """A conv, then two up-convolutions (a U-Net's 2×2 stride-2 one, and a 3×3 with output padding)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 3, 2, stride=2),
        nn.ReLU(),
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
    ).to(DT)


def decoder_grads(solver: str, x: Tensor, **options: object) -> tuple[list[Tensor], HyLoPreconditioner]:
    model = decoder(0)
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1, damping=0.1, **options)
    loss_of(model(x)).backward()
    pre.step()
    return [p.grad.detach().clone() for p in model.parameters()], pre


def test_hybrid_gives_each_up_convolution_its_chosen_solvers_step() -> None:
    """Every layer's hybrid step is the step of the solver it chose (one up-convolution routed to kfac)."""
    x = torch.randn(6, 2, 3, 3, dtype=DT)
    hybrid, pre = decoder_grads("hybrid", x, layer_solvers={"4": "kfac"})
    chosen = {info.name: info.solver for info in pre.layer_info()}
    assert [info.module_type for info in pre.layer_info()] == ["Conv2d", "ConvTranspose2d", "ConvTranspose2d"]
    assert chosen["4"] == "kfac"
    for index, name in enumerate(["0", "2", "4"]):
        alone, _ = decoder_grads(chosen[name], x)
        for got, expected in zip(hybrid[2 * index : 2 * index + 2], alone[2 * index : 2 * index + 2], strict=True):
            assert_same_step(got, expected, name)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("t2d-stride2-pad-outpad", (5, 2, 7, 6)), ("t1d-stride3-dilation", (5, 2, 9)), ("c1d-stride2-pad", (5, 2, 19))],
)
def test_chunked_factors_and_rows_equal_one_block(name: str, shape: tuple[int, ...]) -> None:
    """Under a small ``max_unfold_mb`` the zero-inserted input is unfolded in blocks within the cap."""
    layer = GEOMETRIES[name].build().to(DT)
    torch.manual_seed(3)
    x = torch.randn(shape, dtype=DT)
    grad_out = torch.randn_like(layer(x))
    kind = ConvTransposeMath if isinstance(layer, TRANSPOSED) else ConvMath
    whole = {rows: kind(layer, rows, max_unfold_mb=1e6) for rows in ("exact", "sum", "mean")}
    one_row = grad_out.shape[-1] * whole["exact"].d_a * DT.itemsize / 2**20  # one output row of one sample
    out_rows = grad_out.shape[2] if grad_out.dim() == 4 else 1
    for cap in (one_row, 2.5 * one_row * out_rows):  # rows of one sample; whole samples
        chunked = {rows: kind(layer, rows, max_unfold_mb=cap) for rows in ("exact", "sum", "mean")}
        with Unfolds() as unfolds:  # the chunked exact math's blocks of patches
            factors = chunked["exact"].kfac_factors(x, grad_out, 3.0)
            exact = chunked["exact"].lowrank_rows(x, grad_out, 3.0)
        sizes = unfolds.sizes
        for got, expected in zip(factors, whole["exact"].kfac_factors(x, grad_out, 3.0), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        for rows in ("exact", "sum", "mean"):
            got_rows = exact if rows == "exact" else chunked[rows].lowrank_rows(x, grad_out, 3.0)
            expected_rows = whole[rows].lowrank_rows(x, grad_out, 3.0)
            for field, value in got_rows.fields().items():
                torch.testing.assert_close(value, expected_rows.fields()[field], rtol=1e-12, atol=1e-13)
        assert len(sizes) > 2 and max(sizes) <= cap * 2**20 * (1 + 1e-12), (cap, sizes)


def test_unbatched_input_is_a_batch_of_one() -> None:
    layer = GEOMETRIES["t2d-stride2-pad-outpad"].build().to(DT)
    x = torch.randn(2, 3, 4, dtype=DT)
    grad_out = torch.randn_like(layer(x))
    math = ConvTransposeMath(layer, "exact")
    assert math.row_counts(x, grad_out) == (1, grad_out[0].numel())
    single, batched = math.lowrank_rows(x, grad_out, 1.0), math.lowrank_rows(x[None], grad_out[None], 1.0)
    assert isinstance(single, DenseRows) and isinstance(batched, DenseRows)
    assert torch.equal(single.u, batched.u)


@pytest.mark.parametrize(("solver", "rows"), [("kfac", "sum"), ("kid", "exact"), ("sngd", "sum")])
def test_checkpoint_resumes_bit_for_bit(solver: str, rows: str) -> None:
    """Saved after 3 steps and loaded into a fresh model and preconditioner, a run takes the same 2 next steps."""
    data = [torch.randn(6, 2, 3, 3, dtype=DT, generator=torch.Generator().manual_seed(step)) for step in range(5)]
    options = {"solver": solver, "update_freq": 2, "rank_ratio": 0.5, "damping": 0.1, "conv_rows": rows}

    def sgd_step(model: nn.Module, pre: HyLoPreconditioner, x: Tensor) -> None:
        model.zero_grad()
        loss_of(model(x)).backward()
        pre.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad

    model = decoder(0)
    pre = HyLoPreconditioner(model, **options)
    for x in data[:3]:
        sgd_step(model, pre, x)
    buffer = io.BytesIO()
    torch.save([model.state_dict(), pre.state_dict()], buffer)
    buffer.seek(0)
    weights, saved = torch.load(buffer)
    twin = decoder(1)
    twin.load_state_dict(weights)
    twin_pre = HyLoPreconditioner(twin, **options)
    twin_pre.load_state_dict(saved)
    for x in data[3:]:
        sgd_step(model, pre, x)
        sgd_step(twin, twin_pre, x)
    assert_same_tensors(dict(model.named_parameters()), dict(twin.named_parameters()))
    assert_same_tensors(pre.state_dict(), twin_pre.state_dict())


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.ConvTranspose2d(4, 4, 3, groups=2),
        lambda: nn.ConvTranspose1d(4, 2, 3, groups=2),
        lambda: nn.Conv1d(4, 4, 3, groups=4),
    ],
    ids=["ConvTranspose2d", "ConvTranspose1d", "Conv1d"],
)
def test_grouped_convolutions_are_left_alone_with_the_reason(make: Callable[[], nn.Module]) -> None:
    layer = make()
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 4, *([5] * (len(layer.kernel_size)))))
    with pytest.warns(UserWarning, match="hylo leaves 1 modules"):
        pre = HyLoPreconditioner(model)
    kind = type(layer).__name__
    assert [info.name for info in pre.layer_info()] == ["2"]
    assert f"not preconditioned: 0 (grouped/depthwise {kind} (groups={layer.groups}) is not supported)" in pre.summary()
