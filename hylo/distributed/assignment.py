"""Which rank owns (solves) each layer: greedy longest-processing-time on estimated cost."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """Owner rank of each layer: heaviest layers first, each to the least-loaded rank.

    Deterministic (ties go to the lower layer index and the lower rank), so every rank
    computes the same assignment from the same costs. LPT is within 4/3 of the optimal
    makespan.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(world_size)]
    heapq.heapify(loads)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + float(costs[index]), rank))
    return owners
