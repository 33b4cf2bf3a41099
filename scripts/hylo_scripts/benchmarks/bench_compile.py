"""torch.compile with hylo: graphs per step and time per step, eager against compiled, with and without hylo.

Example:
    python scripts/bench_compile.py --threads 2
    python scripts/bench_compile.py --model decoder --solver kfac --update-freq 2 --steps 40

A small Llama-style decoder (Hugging Face ``LlamaForCausalLM`` built from a config with random
weights; ``--model decoder``: this repository's ``DecoderLM``, no ``transformers`` needed) trains on
random tokens with SGD. Each row is one set-up, run in a fresh process state (dynamo reset, the
same initial weights):

- ``eager``, ``compiled``: without hylo (``torch.compile(model)``, the default inductor backend);
- ``eager+hylo``;
- ``compiled+hylo (after)``: hylo attached, then the model compiled;
- ``compiled+hylo (before)``: the model compiled and run, then hylo attached (the compiled wrapper
  handed to it).

``graphs`` is the number of compiled graphs run in one step that does not capture (the ones that
do run eagerly, see docs/wrappers.md, "torch.compile"), ``compiled`` the graphs compiled over the
whole run, ``update ms`` and ``other ms`` the median time of an iteration (forward, backward, hylo,
optimizer) over the update steps and the other steps after ``--warmup`` iterations.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo_scripts.benchmarks import flags, timing
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.models.registry import DecoderLM

SETUPS = ("eager", "compiled", "eager+hylo", "compiled+hylo (after)", "compiled+hylo (before)")


class GraphCounter:
    """A dynamo backend: inductor, counting the graphs it compiles and the graphs run."""

    def __init__(self) -> None:
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        self.compiled += 1
        compiled = cast(Callable[..., Any], compile_fx(gm, example_inputs))

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def build(name: str, vocab: int, context: int) -> nn.Module:
    """The decoder, from seed 0: ``llama`` (4 layers, width 256, 4 heads, MLP 688) or ``decoder`` (DecoderLM)."""
    torch.manual_seed(0)
    if name == "decoder":
        return DecoderLM(vocab=vocab, context=context, layers=4, width=256, heads=4)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=context,
    )
    return _Logits(LlamaForCausalLM(config))


class _Logits(nn.Module):
    """A causal LM's logits as a plain tensor (the compiled graph ends there, as DecoderLM's does)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: Tensor) -> Tensor:
        logits = self.lm(input_ids=x, use_cache=False).logits
        assert isinstance(logits, Tensor)
        return logits


@dataclass
class Row:
    """One set-up's measurements."""

    setup: str
    graphs: int
    compiled: int
    update_ms: float
    other_ms: float


def measure(setup: str, args: argparse.Namespace) -> Row:
    """Run ``setup`` for ``--warmup`` + ``--steps`` iterations; its graph counts and median step times."""
    torch._dynamo.reset()
    device: torch.device = args.device
    model = build(args.model, args.vocab, args.context).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch_size, args.context), generator=gen).to(device)
    y = torch.randint(0, args.vocab, (args.batch_size, args.context), generator=gen).to(device)
    counter = GraphCounter()
    options = {"solver": args.solver, "update_freq": args.update_freq, "damping": 0.03}
    call: Callable[[Tensor], Tensor] = model
    pre = None
    if setup in ("eager+hylo", "compiled+hylo (after)"):
        pre = hylo.HyLoPreconditioner(model, **options)
    if setup.startswith("compiled"):
        call = torch.compile(model, backend=counter)
    if setup == "compiled+hylo (before)":
        F.cross_entropy(call(x).flatten(0, 1), y.flatten()).backward()
        pre = hylo.HyLoPreconditioner(cast(nn.Module, call), **options)  # the compiled wrapper
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    update_ms: list[float] = []
    other_ms: list[float] = []
    graphs = 0
    try:
        for i in range(args.warmup + args.steps):
            capturing = pre is not None and i % args.update_freq == 0
            counter.runs = 0
            start = timing.now(device)
            optimizer.zero_grad()
            F.cross_entropy(call(x).flatten(0, 1), y.flatten()).backward()
            if pre is not None:
                pre.step()
            optimizer.step()
            elapsed = 1e3 * (timing.now(device) - start)
            if not capturing:
                graphs = counter.runs
            if i >= args.warmup:
                (update_ms if capturing else other_ms).append(elapsed)
    finally:
        if pre is not None:
            pre.remove()
    median = statistics.median
    return Row(setup, graphs, counter.compiled, median(update_ms) if update_ms else float("nan"), median(other_ms))


def main(argv: Sequence[str] | None = None) -> None:
    """Print one row per set-up: graphs per step, graphs compiled, median ms of update and other steps."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama", choices=("llama", "decoder"))
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--solver", default="hybrid")
    parser.add_argument("--update-freq", type=int, default=2, help="2: as many update steps as others")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    flags.add_device(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    print(f"device: {describe(args.device)}")
    print(f"{'setup':<24} {'graphs':>6} {'compiled':>8} {'update ms':>10} {'other ms':>9}")
    for setup in args.setups:
        row = measure(setup, args)
        update = "-" if row.update_ms != row.update_ms else f"{row.update_ms:.1f}"
        print(f"{row.setup:<24} {row.graphs:>6} {row.compiled:>8} {update:>10} {row.other_ms:>9.1f}", flush=True)
