"""hylo on a Hugging Face GPT-2 built from a config (random weights; needs ``pip install transformers``).

GPT-2's projections are ``transformers``' ``Conv1D``, a Linear stored transposed, which hylo
registers by itself (docs/extending.md, "Layers of other packages"; what is preconditioned is
docs/transformers.md, "Hugging Face GPT-2"). This prints the preconditioner's summary and the
time of a training step (forward, backward, ``pre.step()``, AdamW) with and without hylo on
random tokens, ``--steps`` steps after ``--warmup`` steps: the median of all steps; the medians of
hylo's update steps (one in ``update_freq``, step 0 included) and of the steps between them, for both runs
(the same step indices); and from those two medians the cost per step averaged over
``update_freq`` steps, robust to the outliers a shared machine gives a mean. The two runs take
turns step by step, so that both see the same machine load.

    python examples/gpt2.py --layers 4 --width 128 --vocab 1000 --seq 64 --batch 8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import hylo


def gpt2(layers: int, width: int, heads: int, vocab: int, seq: int, seed: int = 0) -> nn.Module:
    """A ``GPT2LMHeadModel`` with dropout off, built from its config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, pre: hylo.HyLoPreconditioner | None, ids: torch.Tensor
) -> float:
    """One training step on ``ids``; its wall-clock seconds."""
    start = time.perf_counter()
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    if pre is not None:
        pre.step()
    optimizer.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print the summary and the step times; return {run: {"median", "between", "update", "amortized": ms}}."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=100)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default %(default)s)")
    parser.add_argument("--solver", default="hybrid", help="hylo's solver (default %(default)s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (4, args.batch, args.seq), generator=generator)
    runs = {}
    for run in ("AdamW", f"AdamW + hylo {args.solver}"):
        model = gpt2(args.layers, args.width, args.heads, args.vocab, args.seq)
        pre = None if run == "AdamW" else hylo.HyLoPreconditioner(model, solver=args.solver)
        if pre is not None:
            print(pre.summary())
        runs[run] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), pre)
    times: dict[str, list[float]] = {run: [] for run in runs}
    for step in range(args.warmup + args.steps):  # the runs take turns, so that both see the same machine load
        for run, (model, optimizer, pre) in runs.items():
            seconds = train_step(model, optimizer, pre, tokens[step % tokens.shape[0]])
            if step >= args.warmup:
                times[run].append(1e3 * seconds)
    freq = hylo.HyLoConfig(solver=args.solver).update_freq
    update = [step % freq == 0 for step in range(args.warmup, args.warmup + args.steps)]
    results = {}
    for run, ms in times.items():
        updates = [t for t, u in zip(ms, update, strict=True) if u]
        between = [t for t, u in zip(ms, update, strict=True) if not u]
        median_update, median_between = statistics.median(updates), statistics.median(between)
        results[run] = {
            "median": statistics.median(ms),
            "between": median_between,
            "update": median_update,
            "amortized": (median_update + (freq - 1) * median_between) / freq,
        }
    for run, r in results.items():
        print(
            f"{run:>22}: median {r['median']:.1f} ms/step over {args.steps} steps; between updates {r['between']:.1f}, "
            f"update steps {r['update']:.1f}, averaged over update_freq={freq}: {r['amortized']:.1f}"
        )
    return results


if __name__ == "__main__":
    main()
