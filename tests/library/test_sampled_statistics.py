"""K-FAC factors from a strided sample of each call's rows (``factor_sample``; docs/solvers.md, "Sampled factors").

The references are plain torch products of the layer's true input and output gradient, captured here
(``retain_grad`` on the layer's output, or an attention written with ``F.linear`` projections), never
hylo's rows: the exact factors A = Σ a aᵀ / n_k and G = Σ g gᵀ / n with g = n·∂L/∂s, and the sampled
ones, k times the sums over the rows ≡ o (mod k). Over the k offsets the sampled factors average to the
exact ones (to round-off: the strided sampler is unbiased by construction, each row in exactly one of
the k samples); a run is bit-exact across a checkpoint; two ranks equal one process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.layers.sampling import row_sample
from tests.kit.checks import DT, assert_rel_close, assert_same_tensors, rel_err
from tests.kit.harness import run_distributed
from tests.kit.reference import conv_reference, linear_rows

pytestmark = [pytest.mark.usefixtures("single_thread")]

#: Relative error of the mean over the k offsets against the exact factors (float64 round-off).
MEAN_RTOL = 1e-10
#: The stride k of the tests (factor_sample = 1/K).
K = 4


def _factors(pre: HyLoPreconditioner) -> dict[str, tuple[Tensor, Tensor]]:
    """Each K-FAC layer's running factors (A, G), by layer name."""
    out = {}
    for info in pre.layer_info():
        assert info.state is not None, info.name
        out[info.name] = (info.state.tensors["factor_a"].clone(), info.state.tensors["factor_g"].clone())
    return out


def _seed_for(offset: int, layer: str, step: int = 0, stride: int = K) -> int:
    """A seed whose draw for ``layer`` at ``step`` is ``offset`` (the draw is a public pure function)."""
    for seed in range(10_000):
        sample = row_sample(1.0 / stride, "strided", seed, step, layer)
        if sample is not None and sample.offset == offset:
            return seed
    raise AssertionError(f"no seed draws offset {offset}")


# --------------------------------------------------------------------------- the layers and their exact factors
def _linear_case() -> tuple[nn.Module, Callable[[nn.Module], dict[str, tuple[Tensor, Tensor]]]]:
    """A Linear on (B, T, d) sequences: its rows are the B·T tokens."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 5, dtype=DT)
    x = torch.randn(4, 8, 6, dtype=DT)
    target = torch.randn(4, 8, 5, dtype=DT)

    def run(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
        out = model(x)
        out.retain_grad()
        F.mse_loss(out, target).backward()
        assert out.grad is not None
        a, g = linear_rows(model, x, out.grad)  # type: ignore[arg-type]
        return {"": (a.mT @ a / a.shape[0], g.mT @ g / a.shape[0])}

    return layer, run


def _conv_case() -> tuple[nn.Module, Callable[[nn.Module], dict[str, tuple[Tensor, Tensor]]]]:
    """A Conv2d on 8 images: its sampling units are the images, each with all its positions."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, dtype=DT)
    x = torch.randn(8, 2, 5, 5, dtype=DT)
    target = torch.randn(8, 3, 5, 5, dtype=DT)

    def run(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
        out = model(x)
        out.retain_grad()
        F.mse_loss(out, target).backward()
        assert out.grad is not None
        ref = conv_reference(model, x, out, out.grad)  # type: ignore[arg-type]
        return {"": (ref["A"], ref["G"])}

    return conv, run


def _embedding_case() -> tuple[nn.Module, Callable[[nn.Module], dict[str, tuple[Tensor, Tensor]]]]:
    """An Embedding on (B, T) tokens: A = diag(counts)/n from one-hot rows."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 6, dtype=DT)
    idx = torch.randint(0, 10, (4, 8))
    target = torch.randn(4, 8, 6, dtype=DT)

    def run(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
        out = model(idx)
        out.retain_grad()
        F.mse_loss(out, target).backward()
        assert out.grad is not None
        n = idx.numel()
        a = F.one_hot(idx.reshape(-1), 10).to(DT)
        g = n * out.grad.reshape(n, 6)
        return {"": (a.mT @ a / n, g.mT @ g / n)}

    return emb, run


def _attention_case() -> tuple[nn.Module, Callable[[nn.Module], dict[str, tuple[Tensor, Tensor]]]]:
    """nn.MultiheadAttention's four projections; the reference runs the same attention with ``F.linear``."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=DT)
    x = torch.randn(4, 6, 8, dtype=DT)
    target = torch.randn(4, 6, 8, dtype=DT)
    e, heads = 8, 2

    def run(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
        assert isinstance(model, nn.MultiheadAttention)
        out, _ = model(x, x, x, need_weights=False)
        F.mse_loss(out, target).backward()
        # the reference: the same attention from its definition, on detached copies of the weights
        w, b = model.in_proj_weight.detach(), model.in_proj_bias.detach()
        parts = [F.linear(x, w[i * e : (i + 1) * e], b[i * e : (i + 1) * e]).requires_grad_() for i in range(3)]
        split = [p.reshape(4, 6, heads, e // heads).transpose(1, 2) for p in parts]
        core = F.scaled_dot_product_attention(*split).transpose(1, 2).reshape(4, 6, e).detach().requires_grad_()
        s = F.linear(core, model.out_proj.weight.detach(), model.out_proj.bias.detach())
        s.retain_grad()
        torch.testing.assert_close(s, out.detach(), rtol=1e-12, atol=1e-12)
        F.mse_loss(s, target).backward()
        assert core.grad is not None and s.grad is not None
        attn = F.scaled_dot_product_attention(*split).transpose(1, 2).reshape(4, 6, e)
        torch.autograd.backward(attn, core.grad)
        factors = {}
        for name, inputs, out_grad in (
            ("q_proj", x, parts[0].grad),
            ("k_proj", x, parts[1].grad),
            ("v_proj", x, parts[2].grad),
            ("out_proj", core.detach(), s.grad),
        ):
            assert out_grad is not None
            a = torch.cat([inputs.reshape(-1, e), torch.ones(24, 1, dtype=DT)], dim=1)
            g = 24 * out_grad.reshape(-1, e)
            factors[name] = (a.mT @ a / 24, g.mT @ g / 24)
        return factors

    return mha, run


CASES = {"linear": _linear_case, "conv2d": _conv_case, "embedding": _embedding_case, "attention": _attention_case}


def factors_after_an_update(
    case: str, solver: str = "kfac", **options: Any
) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, tuple[Tensor, Tensor]]]:
    """One update step of ``case``'s layer under ``options``: hylo's factors and the exact reference, by the
    reference's names (hylo's names end with them)."""
    module, run = CASES[case]()
    pre = HyLoPreconditioner(module, solver=solver, update_freq=1, damping=0.1, **options)
    exact = run(module)
    pre.step()
    got = _factors(pre)
    return {key: next(v for name, v in got.items() if name.endswith(key)) for key in exact}, exact


# --------------------------------------------------------------------------- (a) unbiased
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_factors_average_to_the_exact_factors_over_the_offsets(case: str) -> None:
    """Each row is in exactly one of the k strided samples: the mean of k·(sampled sums) over the k offsets is the
    exact factors, to round-off; one draw alone is not (the sample is really taken)."""
    module, _ = CASES[case]()
    names = [info.name for info in HyLoPreconditioner(copy.deepcopy(module), solver="kfac").layer_info()]
    for name in names:  # each layer draws its own offset: seeds that draw each of the k for this one
        draws: list[tuple[Tensor, Tensor]] = []
        for offset in range(K):
            got, exact = factors_after_an_update(case, factor_sample=1 / K, seed=_seed_for(offset, name))
            key = next(key for key in exact if name.endswith(key))
            draws.append(got[key])
        want_a, want_g = exact[key]
        mean_a = torch.stack([d[0] for d in draws]).mean(0)
        mean_g = torch.stack([d[1] for d in draws]).mean(0)
        assert rel_err(mean_a, want_a) < MEAN_RTOL, f"{case} {name}: A"
        assert rel_err(mean_g, want_g) < MEAN_RTOL, f"{case} {name}: G"
        assert rel_err(draws[0][1], want_g) > 1e-3, f"{case} {name}: one draw's G is exact: nothing was sampled"


def packed_blocks(full: Tensor, block: int) -> Tensor:
    """The diagonal blocks of ``full`` (balanced sizes: the first d mod k one wider), flattened in order and joined:
    a blocked side as hylo holds it (docs/solvers.md, "Blocked factors"), written out independently of hylo."""
    d = full.shape[0]
    k = -(-d // block)
    sizes = [d // k + (1 if i < d % k else 0) for i in range(k)]
    starts = [sum(sizes[:i]) for i in range(k)]
    return torch.cat([full[s : s + n, s : s + n].flatten() for s, n in zip(starts, sizes, strict=True)])


def test_sampled_blocked_factors_average_to_the_exact_blocks() -> None:
    """With ``factor_block`` too, a sampled call's factors are the blocks of k·Σ over the sampled rows: over the k
    offsets their mean is the exact factors' diagonal blocks, to round-off."""
    module, _ = CASES["linear"]()
    name = HyLoPreconditioner(copy.deepcopy(module), solver="kfac").layer_info()[0].name
    draws = []
    for offset in range(K):
        got, exact = factors_after_an_update(
            "linear", factor_sample=1 / K, factor_block=3, seed=_seed_for(offset, name)
        )
        draws.append(next(iter(got.values())))
    want_a, want_g = (packed_blocks(f, 3) for f in next(iter(exact.values())))
    assert rel_err(torch.stack([d[0] for d in draws]).mean(0), want_a) < MEAN_RTOL
    assert rel_err(torch.stack([d[1] for d in draws]).mean(0), want_g) < MEAN_RTOL
    assert rel_err(draws[0][1], want_g) > 1e-3


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam", "hybrid"])
def test_the_sample_is_every_kth_row_from_the_drawn_offset(solver: str) -> None:
    """Every family that keeps K-FAC factors forms them from the rows ≡ o (mod k) of the (B·T) tokens, sums ×k."""
    got, _ = factors_after_an_update("linear", solver, factor_sample=0.5, seed=3)
    torch.manual_seed(0)  # the linear case's layer and data, replayed
    layer = nn.Linear(6, 5, dtype=DT)
    x = torch.randn(4, 8, 6, dtype=DT)
    target = torch.randn(4, 8, 5, dtype=DT)
    out = layer(x)
    out.retain_grad()
    F.mse_loss(out, target).backward()
    assert out.grad is not None
    a, g = linear_rows(layer, x, out.grad)
    sample = row_sample(0.5, "strided", 3, 0, "")
    assert sample is not None and sample.stride == 2
    a_s, g_s = a[sample.offset :: 2], g[sample.offset :: 2]
    assert_rel_close(got[""][0], 2 * a_s.mT @ a_s / 32, 1e-12)
    assert_rel_close(got[""][1], 2 * g_s.mT @ g_s / 32, 1e-12)


# --------------------------------------------------------------------------- (b) 1.0 is the exact path; small calls
def test_fraction_one_and_small_calls_keep_every_row_bit_for_bit() -> None:
    """factor_sample=1 is the default's path; a call with no more rows than the layer's width keeps all its rows
    under any fraction: the factors are the exact path's, bit for bit."""
    exact, reference = factors_after_an_update("linear")
    one, _ = factors_after_an_update("linear", factor_sample=1.0)
    assert_same_tensors(one, exact)
    assert_rel_close(exact[""][0], reference[""][0], 1e-12)
    torch.manual_seed(0)
    wide = nn.Linear(40, 5, dtype=DT)  # width 41 ≥ 32 rows
    x = torch.randn(4, 8, 40, dtype=DT)
    states = []
    for fraction in (1.0, 0.25):
        model = copy.deepcopy(wide)
        pre = HyLoPreconditioner(model, solver="kfac", update_freq=1, damping=0.1, factor_sample=fraction)
        model(x).square().sum().backward()
        pre.step()
        states.append(_factors(pre))
    assert_same_tensors(states[0], states[1])


def test_calls_kept_raw_give_the_bits_of_calls_reduced_in_the_hook() -> None:
    """A user's solver_fn keeps every call raw until step(); a fixed solver reduces them in the hook: same bits."""
    runs = []
    for options in ({"solver": "kfac"}, {"solver": "hybrid", "solver_fn": lambda name, step, stats: "kfac"}):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).to(DT)
        pre = HyLoPreconditioner(model, update_freq=1, damping=0.1, factor_sample=0.25, seed=5, **options)
        for step in range(3):
            x = torch.randn(64, 6, dtype=DT, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            pre.step()
            model.zero_grad()
        runs.append(_factors(pre))
    assert_same_tensors(runs[0], runs[1])


# --------------------------------------------------------------------------- (c) resume; factor_update_freq
def _lm_run(steps: int, options: dict[str, Any], stop: int | None = None, state: Any = None) -> Any:
    """SGD on a tiny token model with hylo; ``stop``: return the state dicts after that many steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(12, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12)).to(DT)
    pre = HyLoPreconditioner(model, damping=0.1, **options)
    start = 0
    if state is not None:
        model.load_state_dict(state[0])
        pre.load_state_dict(state[1])
        start = state[2]
    for step in range(start, steps):
        if stop is not None and step == stop:
            return copy.deepcopy((model.state_dict(), pre.state_dict(), step))
        idx = torch.randint(0, 12, (8, 8), generator=torch.Generator().manual_seed(step))
        F.cross_entropy(model(idx).reshape(-1, 12), idx.roll(1, 1).reshape(-1)).backward()
        pre.step()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p -= 0.1 * p.grad
                p.grad = None
    return {k: v.clone() for k, v in model.state_dict().items()}, _factors(pre)


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam"])
def test_a_resumed_run_draws_the_same_samples_bit_for_bit(solver: str) -> None:
    """The draw is a function of the seed, the step and the layer: a run resumed from a checkpoint between updates
    (running factors refreshed at every step) ends with the uninterrupted run's bits, and unlike an exact run."""
    options = {"solver": solver, "update_freq": 3, "factor_update_freq": 1, "factor_sample": 0.25, "seed": 1}
    whole = _lm_run(7, options)
    resumed = _lm_run(7, options, state=_lm_run(7, options, stop=4))
    assert_same_tensors(resumed, whole)
    exact = _lm_run(7, {**options, "factor_sample": 1.0})
    assert rel_err(exact[1]["1"][1], whole[1]["1"][1]) > 1e-3


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam"])
def test_every_step_of_a_cycle_folds_its_own_sample(solver: str) -> None:
    """factor_update_freq=1 with factor_sample=1/k: each step blends k·(its sampled sums) into the running
    factors, the offset drawn anew for each step (rows spread over the steps of a cycle)."""
    decay = 0.5
    torch.manual_seed(0)
    layer = nn.Linear(6, 5, dtype=DT)
    pre = HyLoPreconditioner(
        layer, solver=solver, update_freq=3, factor_update_freq=1, factor_decay=decay, damping=0.1,
        factor_sample=0.25, seed=2,
    )  # fmt: skip
    running: tuple[Tensor, Tensor] | None = None
    for step in range(4):
        x = torch.randn(4, 8, 6, dtype=DT)
        out = layer(x)
        out.retain_grad()
        out.square().mean().backward()
        assert out.grad is not None
        pre.step()
        layer.zero_grad()
        a, g = linear_rows(layer, x, out.grad)
        sample = row_sample(0.25, "strided", 2, step, "")
        assert sample is not None
        a_s, g_s = a[sample.offset :: 4], g[sample.offset :: 4]
        batch = (4 * a_s.mT @ a_s / 32, 4 * g_s.mT @ g_s / 32)
        if running is None:
            running = batch
        else:
            running = (decay * running[0] + (1 - decay) * batch[0], decay * running[1] + (1 - decay) * batch[1])
        got = _factors(pre)[""]
        assert_rel_close(got[0], running[0], 1e-12)
        assert_rel_close(got[1], running[1], 1e-12)


# --------------------------------------------------------------------------- (d) P ranks
def _ranks_run(rank: int, world_size: int, xs: Tensor, fraction: float = 0.25) -> dict[str, Any]:
    """Rank ``rank`` trains on its share of each step's sequences under DDP; returns the factors and parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(DT)
    net: nn.Module = model
    if world_size > 1:
        net = nn.parallel.DistributedDataParallel(model)
    pre = HyLoPreconditioner(net, solver="kfac", update_freq=2, damping=0.1, factor_sample=fraction, seed=4)
    share = xs.shape[1] // world_size
    for x in xs:
        local = x[rank * share : (rank + 1) * share]  # (sequences, tokens, features): 2·16 = 32 rows a rank
        net(local).square().mean().backward()
        pre.step()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p -= 0.1 * p.grad
                p.grad = None
    return {"factors": _factors(pre), "params": {k: v.clone() for k, v in model.state_dict().items()}}


def test_two_ranks_equal_one_process_on_the_whole_batch() -> None:
    """Each rank's rows a multiple of k (and more than the layers' widths, so that no rank keeps a small call whole)
    and the same offset on every rank: the union of the ranks' samples is one process's sample of the concatenated
    batch, so the factors and parameters agree (float64 round-off); not vacuous: the exact run differs."""
    xs = torch.randn(3, 4, 16, 6, dtype=DT, generator=torch.Generator().manual_seed(0))
    reference = _ranks_run(0, 1, xs)
    for result in run_distributed(_ranks_run, 2, xs):
        for name, (a, g) in reference["factors"].items():
            assert_rel_close(result["factors"][name][0], a, 1e-10)
            assert_rel_close(result["factors"][name][1], g, 1e-10)
        for key, value in reference["params"].items():
            assert_rel_close(result["params"][key], value, 1e-10)
    exact = _ranks_run(0, 1, xs, 1.0)
    assert rel_err(exact["factors"]["0"][1], reference["factors"]["0"][1]) > 1e-3


# --------------------------------------------------------------------------- (e) bad values
@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"factor_sample": 0.0}, "factor_sample"),
        ({"factor_sample": 0.3}, "factor_sample"),
        ({"factor_sample": 2.0}, "factor_sample"),
        ({"factor_sample": True}, "factor_sample"),
        ({"factor_sample": float("nan")}, "factor_sample"),
        ({"factor_sampler": "norm"}, "factor_sampler"),
    ],
)
def test_bad_values_are_refused_at_construction(options: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        HyLoPreconditioner(nn.Linear(3, 2), **options)
