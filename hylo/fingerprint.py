"""What every rank must share before their steps can meet: the registration and the options (docs/reliability.md,
"Agreement across ranks").

Ranks whose registered layers, cadence or options differ issue different collectives, of different
sizes, and a backend then aborts or waits out its timeout. :func:`fields` describes one rank's
preconditioner as named strings; :func:`agree` compares them over ranks in one small all-reduce
of fixed size (a 62-bit digest per field, reduced by MIN of the digests and of their negations)
and, only where they differ, gathers the fields themselves to raise on every rank a
``ValueError`` naming each field that differs and the ranks that hold each value.
:class:`Fingerprint` is the preconditioner's side: when the ranks compare, and what.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hylo.config import HyLoConfig, options
from hylo.distributed import Communicator
from hylo.payload import CONTROL, Payload
from hylo.pipeline.guard import Guard
from hylo.pipeline.planner import Planner
from hylo.pipeline.step import StepValues
from hylo.state import RegisteredLayer
from hylo.version import __version__

#: Options each rank may set for itself: where its own files go, and the seed of its own draws.
RANK_LOCAL = frozenset({"profile_dir", "profile_append", "seed"})
LAYERS = "registered layers"
_KEY = (CONTROL, "fingerprint")


def _value(value: Any, resolved: Mapping[str, Any], name: str, step: int) -> str:
    """An option's value as the ranks compare it: a schedule's value at ``step`` (as the step evaluated it:
    a user's callable is never called again here), else the presence of a callable."""
    if not callable(value):
        return repr(value)
    if name in resolved:
        return f"{resolved[name]!r} (its callable's value at step {step})"
    return "a callable"


def fields(
    layers: Sequence[RegisteredLayer],
    config: HyLoConfig,
    step: int,
    resolved: Mapping[str, Any],
    placement: str,
    version: str,
) -> dict[str, str]:
    """One rank's fingerprint: hylo's version, every registered layer, the placement (its name, which says FSDP2
    sharding; docs/design.md, "Placements") and every option
    but :data:`RANK_LOCAL`, by name (the same names, in the same order, on every rank); ``resolved``:
    the schedules' values at ``step``, by option name."""
    described = {
        "hylo version": version,
        LAYERS: json.dumps(
            [
                [layer.name, layer.math.module_type, layer.math.d_a, layer.math.d_g, str(layer.math.dtype)]
                for layer in layers
            ]
        ),
        "placement": placement,
    }
    for spec in options():
        if spec.name not in RANK_LOCAL:
            described[spec.name] = _value(config.value(spec.name), resolved, spec.name, step)
    return described


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def agree(comm: Communicator, described: dict[str, str], device: torch.device, step: int) -> None:
    """Check that every rank's ``described`` (:func:`fields`) is the same: one all-reduce of 2·F int64 for F
    fields; where they differ, one all-gather of the fields and a ``ValueError`` on every rank naming them."""
    if comm.world_size == 1:
        return
    digests = torch.tensor([_digest(text) for text in described.values()], dtype=torch.int64, device=device)
    reduced = comm.all_reduce(Payload({_KEY: torch.cat([digests, -digests])}), "min").wait()[_KEY]
    n = len(described)
    if torch.equal(reduced[:n], -reduced[n:]):
        return
    # each rank's fields as ASCII JSON ended by a 0 byte (which JSON never holds), gathered in rank order
    encoded = torch.tensor([*json.dumps(described).encode("ascii"), 0], dtype=torch.uint8, device=device)
    gathered = bytes(comm.all_gather_rows(Payload({_KEY: encoded})).wait()[_KEY].cpu().tolist())
    ranks = [json.loads(part) for part in gathered.split(b"\0")[:-1]]
    raise ValueError(_message(ranks, step))


def _message(ranks: list[dict[str, str]], step: int) -> str:
    """Every field that differs between ``ranks`` (one fingerprint per rank), with the ranks holding each value."""
    differences = []
    for name in ranks[0]:
        values = [described.get(name) for described in ranks]
        if len(set(values)) == 1:
            continue
        if name == LAYERS:
            differences.append(_layer_difference([json.loads(v or "[]") for v in values]))
            continue
        holders: dict[str | None, list[int]] = {}
        for rank, value in enumerate(values):
            holders.setdefault(value, []).append(rank)
        differences.append(f"{name}: " + "; ".join(f"{value} on ranks {r}" for value, r in holders.items()))
    where = 'docs/reliability.md, "Agreement across ranks"'
    listed = " | ".join(differences)
    return f"step {step}: the ranks' HyLoPreconditioners differ — {listed}. Every rank must register the same layers with the same options ({where})"


def _layer_difference(per_rank: list[list[list[object]]]) -> str:
    """Which layers only some ranks registered, or registered with another type, shape or dtype."""
    everywhere = [{str(layer[0]): layer for layer in layers} for layers in per_rank]
    names = list(dict.fromkeys(name for layers in everywhere for name in layers))
    parts = []
    for name in names:
        having = [rank for rank, layers in enumerate(everywhere) if name in layers]
        if len(having) < len(per_rank):
            parts.append(f"{name!r} registered on ranks {having} only")
        elif len({json.dumps(layers[name]) for layers in everywhere}) > 1:
            shapes = "; ".join(f"rank {rank}: {layers[name][1:]}" for rank, layers in enumerate(everywhere))
            parts.append(f"{name!r} differs ({shapes})")
    if not parts:
        parts.append("the same layers in another order")
    return f"{LAYERS}: " + ", ".join(parts)


class Fingerprint:
    """When the ranks compare their fingerprints: at the first step, before any other collective (the ranks'
    collectives may not match), and again at a step where some rank's options changed (:meth:`~hylo.pipeline.guard.Guard.agree`
    says so)."""

    def __init__(self, comm: Communicator, layers: Sequence[RegisteredLayer], guard: Guard, planner: Planner) -> None:
        self.comm, self.layers, self.guard, self.planner = comm, list(layers), guard, planner
        #: The config the ranks last compared; None: not yet (the first step does).
        self.compared: HyLoConfig | None = None

    def compare(self, config: HyLoConfig, step: int, values: StepValues) -> None:
        """Check that every rank registered the same layers with the same options (one small all-reduce;
        nothing with one rank). ``values``: the step's schedules, as evaluated (callables are called once)."""
        if self.comm.world_size > 1:
            resolved = dataclasses.asdict(values) | {"update_freq": self.planner.update_freq(config)}
            described = fields(self.layers, config, step, resolved, type(self.guard.placement).__name__, __version__)
            agree(self.comm, described, self.guard.device, step)
        self.compared = config
