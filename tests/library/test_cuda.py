"""What the device tier adds on CUDA (docs/contributing.md, "The device tier"); skipped unless ``--device cuda``.

- One process on CUDA equals one process on the CPU, in float64, step by step, for every solver (and K-FAC's inverse
  method): the model and data are placed explicitly and the default device stays the CPU, so a tensor the library
  creates without its layer's device fails here.
- A step between updates synchronises the host once (docs/design.md, "Host synchronisation"), counted by CUDA's
  sync debug mode, for every solver.
- ``max_unfold_mb`` bounds the memory a convolution's unfolded patches take, measured with
  ``torch.cuda.max_memory_allocated``.

bf16 autocast, CUDA-event profiling and the dense oracles run on CUDA in the tier's other modules
(tests/library/test_mixed_precision.py, tests/library/test_profiling.py, ...).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

import hylo
from hylo.solvers import solver_names
from tests.kit.checks import rel_err
from tests.kit.devices import chosen, tolerances
from tests.library.test_distributed import Net  # conv (stride 2) → Linear → Linear; full-rank factors at batch 32

pytestmark = [
    pytest.mark.device_tier,
    pytest.mark.explicit_device(reason="places the model and data on the GPU itself; the default device stays cpu"),
    pytest.mark.skipif(chosen().type != "cuda", reason="needs the device tier on CUDA: python -m pytest --device cuda"),
]

#: Every registered solver, and K-FAC with its inverse method.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (name, {}) for name in (*solver_names(), "hybrid")},
    "kfac-inverse": ("kfac", {"kfac_method": "inverse"}),
}
#: kfac_adam's ε bounds Adam's amplification of round-off (tests/library/test_distributed.py's cases do the same).
EXTRA: dict[str, dict[str, Any]] = {"kfac_adam": {"adam_eps": 1e-3}}
STEPS, BATCH = 6, 32


def _data(dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, 2, 5, 5, generator=gen, dtype=dtype), torch.randint(0, 3, (BATCH,), generator=gen))
        for _ in range(STEPS)
    ]


def _train(device: torch.device, case: str) -> list[dict[str, Tensor]]:
    """Preconditioned gradients (on the CPU) of each of ``STEPS`` SGD steps, updates every other step; the raw
    gradients of the last step under the key ``"raw"`` of one more entry."""
    solver, options = CASES[case]
    torch.manual_seed(0)
    model = Net().to(torch.float64).to(device)
    pre = hylo.HyLoPreconditioner(
        model, solver=solver, update_freq=2, damping=1e-2, rank_ratio=0.5, **options, **EXTRA.get(solver, {})
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for x, y in _data(torch.float64):
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        raw = {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}
        pre.step()
        out.append({name: p.grad.detach().cpu() for name, p in model.named_parameters()})
        opt.step()
    pre.remove()
    return [*out, raw]


@pytest.mark.parametrize("case", CASES)
def test_one_process_on_cuda_equals_the_cpu_in_float64(case: str) -> None:
    on_cpu, on_gpu = _train(torch.device("cpu"), case), _train(chosen(), case)
    for step, (want, got) in enumerate(zip(on_cpu, on_gpu, strict=True)):
        for name, expected in want.items():
            err = rel_err(got[name], expected)
            assert err <= tolerances().cross_device, f"{case} step {step} {name}: CUDA vs CPU {err:.2e}"
    # not vacuous: the last step preconditioned every parameter (its result is not the raw gradient)
    *_, last, raw = on_cpu
    assert all(rel_err(last[name], raw[name]) > 1e-3 for name in raw), case


def _syncs(pre: hylo.HyLoPreconditioner) -> list[str]:
    """Where ``pre.step()`` synchronised the host with the GPU (CUDA's sync debug mode), as file:line."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("solver", [*solver_names(), "hybrid"])
def test_a_step_between_updates_synchronises_the_host_once(solver: str) -> None:
    device = chosen()
    torch.manual_seed(0)
    model = Net().to(device)
    pre = hylo.HyLoPreconditioner(model, solver=solver, update_freq=4, damping=1e-2, **EXTRA.get(solver, {}))
    x, y = (t.to(device) for t in _data(torch.float32)[0])
    for step in range(3):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step < 2:  # the update, then a first step between updates (lazy buffers settle)
            pre.step()
            continue
        where = _syncs(pre)
        assert len(where) == 1, f"{solver}: {len(where)} host synchronisations in a step between updates: {where}"
    pre.remove()


def _extra_peak(conv: nn.Conv2d, x: Tensor, **options: Any) -> int:
    """Bytes above what the forward left allocated, at the peak of backward (+ an update step when ``options``)."""
    pre = hylo.HyLoPreconditioner(conv, update_freq=1, **options) if options else None
    conv.zero_grad(set_to_none=True)
    out = conv(x)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.square().mean().backward()
    if pre is not None:
        pre.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    if pre is not None:
        pre.remove()
    return peak


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_max_unfold_mb_bounds_the_unfolded_patches_on_the_gpu(solver: str) -> None:
    """A 37.7 MB unfold of a batch, in blocks of at most 2 MB: the step's peak stays within a few blocks of
    plain backward's, while one whole block holds most of the unfold at once (the bound is what keeps it down). SNGD with its
    exact per-sample rows: the default rows of a convolution are built without the whole unfold."""
    device = chosen()
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 32, 3, padding=1).to(device)
    x = torch.randn(64, 16, 32, 32, device=device)
    unfold_bytes = 64 * (16 * 9) * (32 * 32) * 4
    cap_mb = 2.0
    plain = _extra_peak(conv, x)
    options = {"solver": solver, "conv_rows": "exact"} if solver == "sngd" else {"solver": solver}
    bounded = _extra_peak(conv, x, max_unfold_mb=cap_mb, **options)
    whole = _extra_peak(conv, x, max_unfold_mb=1e6, **options)
    mb = 2**20
    assert whole - plain >= 0.5 * unfold_bytes, (plain / mb, whole / mb)
    assert bounded - plain <= 4 * cap_mb * mb + mb, (plain / mb, bounded / mb, whole / mb)


def test_an_optimizer_state_moved_to_the_device_loads() -> None:
    """Accelerate's ``prepare`` (device placement) and a Trainer loading ``optimizer.pt`` with ``map_location`` move
    every tensor of ``HyLoOptimizer.state_dict()`` to the GPU, the KIS generator's state included: it loads, and
    the state read back is the one saved."""
    device = chosen()
    torch.manual_seed(0)
    model = Net().to(device)
    opt = hylo.HyLoOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), solver="kis", update_freq=1)
    x, y = _data(torch.float32)[0]
    F.cross_entropy(model(x.to(device)), y.to(device)).backward()
    opt.step()
    saved = opt.state_dict()
    opt.load_state_dict(tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, saved))
    again = opt.state_dict()["hylo"]
    assert (
        torch.equal(again["generator"], saved["hylo"]["generator"]) and again["checksum"] == saved["hylo"]["checksum"]
    )
    opt.preconditioner.remove()
