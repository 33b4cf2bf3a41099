"""``damping_convention="kaisa"`` against KAISA's eigen-method K-FAC step, re-derived here from its definitions.

KAISA (kfac-pytorch) is not on the package index, so its step is written out below from the
definitions of its factors, not imported and not taken from hylo:

- Linear: A = mean over rows of a aᵀ (a trailing 1 with a bias), G = mean over rows of ĝ ĝᵀ with
  ĝ = ∂L/∂s the raw output gradient of the mean loss.
- Conv2d: the patches of each output position (its own unfold of the padded input, channel-major
  like the weight) and ĝ are both divided by L, the number of output positions, before the same
  means over the n·L rows.
- Running averages F ← β F + (1 − β) F_batch, the first update taking the batch factors.
- Eigen method: G = Q_g diag(d_g) Q_gᵀ, A = Q_a diag(d_a) Q_aᵀ (eigenvalues clamped at 0),
  V = Q_g [(Q_gᵀ ∇W Q_a) / (d_g d_aᵀ + λ)] Q_aᵀ.

The layer inputs and raw output gradients come from the test's own forward hooks and
``retain_grad``. The conversion (docs/solvers.md, "K-FAC conventions") is pinned too:
KAISA(λ_K) = c · hylo(c·λ_K) with c = n² on a Linear and n²·L^(4+e) on a Conv2d.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.layers import DEFAULT_KFC_EXPONENT
from tests.kit.checks import DT, assert_rel_close, assert_same_tensors, grad_matrix, rel_err, state_snapshot

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]


def mlp() -> nn.Sequential:
    """Two Linear layers, the first with a bias, the second without."""
    return nn.Sequential(nn.Linear(6, 5, dtype=DT), nn.Tanh(), nn.Linear(5, 4, bias=False, dtype=DT))


def convnet() -> nn.Sequential:
    """A strided, padded Conv2d with bias (7×7 → 4×4, L = 16), a 2×2 Conv2d without (L = 9), a Linear head."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1, dtype=DT),
        nn.ReLU(),
        nn.Conv2d(3, 4, 2, bias=False, dtype=DT),
        nn.Flatten(),
        nn.Linear(36, 3, dtype=DT),
    )


#: Each net's builder, input shape and KAISA damping λ_K. KAISA's conv factors are L⁴ smaller than the
#: position means, so λ_K must be far below KAISA's default 1e-3 for the convolutions' curvature to count.
NETS: dict[str, tuple[Callable[[], nn.Sequential], tuple[int, ...], float]] = {
    "mlp": (mlp, (6,), 1e-3),
    "conv": (convnet, (2, 7, 7), 1e-10),
}


def kaisa_patches(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """(n, L, C·kh·kw) patches by sliding windows over the zero-padded input, channel-major like the weight."""
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    x = F.pad(x, (pw, pw, ph, ph))
    windows = x.unfold(2, kh, sh).unfold(3, kw, sw)  # (n, C, oh, ow, kh, kw)
    n, c, oh, ow = windows.shape[:4]
    return windows.permute(0, 2, 3, 1, 4, 5).reshape(n, oh * ow, c * kh * kw)


def kaisa_factors(module: nn.Module, x: Tensor, raw_grad_out: Tensor) -> tuple[Tensor, Tensor]:
    """KAISA's batch factors A and G of one layer from its input and ∂L/∂s (see the module docstring)."""
    if isinstance(module, nn.Conv2d):
        patches = kaisa_patches(module, x)
        positions = patches.shape[1]
        a = patches.reshape(-1, patches.shape[-1])
        g = raw_grad_out.permute(0, 2, 3, 1).reshape(-1, raw_grad_out.shape[1]) / positions
    else:
        positions = 1
        a = x.reshape(-1, x.shape[-1])
        g = raw_grad_out.reshape(-1, raw_grad_out.shape[-1])
    if module.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
    a = a / positions
    return a.mT @ a / a.shape[0], g.mT @ g / g.shape[0]


def kaisa_step(factor_a: Tensor, factor_g: Tensor, grad: Tensor, damping: float) -> Tensor:
    """KAISA's eigen-method preconditioned gradient."""
    d_a, q_a = torch.linalg.eigh(factor_a)
    d_g, q_g = torch.linalg.eigh(factor_g)
    d_a, d_g = d_a.clamp(min=0.0), d_g.clamp(min=0.0)
    return q_g @ ((q_g.mT @ grad @ q_a) / (torch.outer(d_g, d_a) + damping)) @ q_a.mT


class Recorder:
    """The test's own hooks: each Linear/Conv2d's input and output (its gradient retained)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
        self.seen: dict[str, tuple[Tensor, Tensor]] = {}
        for name, module in self.layers.items():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            output.retain_grad()
            self.seen[name] = (inputs[0].detach(), output)

        return hook

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """KAISA's batch factors of every layer after the backward pass."""
        found = {}
        for name, (x, out) in self.seen.items():
            assert out.grad is not None
            found[name] = kaisa_factors(self.layers[name], x, out.grad)
        return found


def batch(shape: tuple[int, ...], n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """n random inputs of ``shape`` and class labels."""
    x = torch.randn(n, *shape, dtype=DT, generator=generator)
    return x, torch.randint(0, 3, (n,), generator=generator)


@pytest.mark.parametrize("net", list(NETS))
@pytest.mark.parametrize("exponent", [1.0, 2.0])
def test_kaisa_convention_reproduces_kaisa_eigen_steps(net: str, exponent: float) -> None:
    """Three updates with batch sizes 48, 40, 48 and factor_decay 0.9: every layer's step equals KAISA's."""
    build, shape, damping = NETS[net]
    torch.manual_seed(0)
    model = build()
    hylo_way = copy.deepcopy(model)  # the same steps with hylo's own convention and the same λ
    recorder = Recorder(model)
    pre = HyLoPreconditioner(
        model,
        solver="kfac",
        update_freq=1,
        damping=damping,
        factor_decay=0.9,
        damping_convention="kaisa",
        kfc_exponent=exponent,
    )
    hylo_pre = HyLoPreconditioner(hylo_way, solver="kfac", update_freq=1, damping=damping, factor_decay=0.9)
    generator = torch.Generator().manual_seed(1)
    running: dict[str, tuple[Tensor, Tensor]] = {}
    for n in (48, 40, 48):
        x, y = batch(shape, n, generator)
        for m in (model, hylo_way):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
        grads = {name: grad_matrix(module) for name, module in recorder.layers.items()}
        for name, (a, g) in recorder.factors().items():
            old = running.get(name)
            running[name] = (a, g) if old is None else (0.9 * old[0] + 0.1 * a, 0.9 * old[1] + 0.1 * g)
        pre.step()
        hylo_pre.step()
        for name, module in recorder.layers.items():
            expected = kaisa_step(*running[name], grads[name], damping)
            assert rel_err(expected, grads[name] / damping) > 1e-2, name  # the curvature matters
            other = grad_matrix(hylo_way.get_submodule(name))
            assert rel_err(expected, other) > 1e-2, name  # the convention matters
            assert_rel_close(grad_matrix(module), expected, 1e-9)
        with torch.no_grad():  # move the weights (both copies alike) so the next factors differ
            for p, q in zip(model.parameters(), hylo_way.parameters(), strict=True):
                p.add_(0.05 * torch.randn(p.shape, dtype=DT, generator=generator))
                q.copy_(p)


@pytest.mark.parametrize("net", list(NETS))
@pytest.mark.parametrize("exponent", [1.0, 2.0])
def test_hylo_damping_from_kaisa_damping(net: str, exponent: float) -> None:
    """KAISA(λ_K) = c · hylo(c·λ_K) per layer: c = n² (Linear), n²·L^(4+e) (Conv2d with L output positions)."""
    build, shape, damping = NETS[net]
    torch.manual_seed(0)
    model = build()
    recorder = Recorder(model)
    n = 16
    x, y = batch(shape, n, torch.Generator().manual_seed(1))
    F.cross_entropy(model(x), y).backward()
    factors = recorder.factors()
    for name, module in recorder.layers.items():
        positions = recorder.seen[name][1][0, 0].numel() if isinstance(module, nn.Conv2d) else 1
        c = n**2 * positions ** (4 + exponent)
        expected = kaisa_step(*factors[name], grad_matrix(module), damping)
        single = copy.deepcopy(model)
        pre = HyLoPreconditioner(single, solver="kfac", update_freq=1, damping=c * damping, kfc_exponent=exponent)
        F.cross_entropy(single(x), y).backward()
        pre.step()
        assert_rel_close(c * grad_matrix(single.get_submodule(name)), expected, 1e-9)


@pytest.mark.parametrize("solver", ["sngd", "kid", "kis", "kfac"])
def test_kaisa_convention_divides_every_solvers_fisher_by_c(solver: str) -> None:
    """hylo(kaisa, λ) = c · hylo(λ·c) on each layer, for the low-rank solvers too (ρ = 0.5: the same rows are kept)."""
    build, shape, damping = NETS["conv"]
    torch.manual_seed(0)
    model = build()
    x, y = batch(shape, 16, torch.Generator().manual_seed(1))
    options = {"solver": solver, "update_freq": 1, "rank_ratio": 0.5, "seed": 3}

    def step(damping: float, **extra: object) -> nn.Module:
        copied = copy.deepcopy(model)
        pre = HyLoPreconditioner(copied, damping=damping, **options, **extra)
        F.cross_entropy(copied(x), y).backward()
        pre.step()
        return copied

    kaisa = step(damping, damping_convention="kaisa")
    sizes = {"0": 16, "2": 9, "4": 1}  # output positions of each layer
    for name, positions in sizes.items():
        c = 16**2 * positions ** (4 + DEFAULT_KFC_EXPONENT)
        reference = step(c * damping)
        got, expected = grad_matrix(kaisa.get_submodule(name)), c * grad_matrix(reference.get_submodule(name))
        # both runs reduce rows at unit scale in the backward and rescale them at the update; with
        # c up to 16^7 the solves' rounding shows at ~1e-8 (a wrong c is off by orders of magnitude)
        assert_rel_close(got, expected, 5e-8)


@pytest.mark.parametrize(
    "saved, loading",
    [({"damping_convention": "kaisa"}, {}), ({}, {"kfc_exponent": 2.0}), ({"kfc_exponent": 0.5}, {})],
    ids=["convention", "exponent", "exponent-saved"],
)
def test_a_checkpoint_on_another_scale_is_refused(saved: dict[str, object], loading: dict[str, object]) -> None:
    """Running factors saved under another convention or exponent are on another scale: ValueError, nothing changed."""
    build, shape, _ = NETS["conv"]
    x, y = batch(shape, 8, torch.Generator().manual_seed(1))
    states = []
    for options in (saved, loading):
        torch.manual_seed(0)
        model = build()
        pre = HyLoPreconditioner(model, solver="kfac", update_freq=1, **options)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        states.append((pre, pre.state_dict()))
    (_, saved_state), (target, _) = states
    before = state_snapshot(target)
    option = next(iter(saved or loading))
    with pytest.raises(ValueError, match=f"state_dict was made with {option}="):
        target.load_state_dict(saved_state)
    assert_same_tensors(state_snapshot(target), before)
