"""FSDP2: every rank holds every state and rows of every ∇W (docs/distributed.md, "FSDP2"; docs/design.md,
"Placements"): the partial products exchanged in one fused all-reduce and one all-gather, the check's sums in one
all-reduce (:mod:`hylo.pipeline.sharding`)."""

from __future__ import annotations

from hylo.pipeline import sharding
from hylo.pipeline.apply import Checked
from hylo.pipeline.placement.base import Applied, Placement, Ready


class Sharded(Placement):
    """FSDP2: every rank holds every state and rows of every ∇W; everything a layer reduces over its gradient is
    made global by one collective (docs/distributed.md, "FSDP2")."""

    def precondition(self, ready: Ready) -> Applied:
        """Each rank's rows of every result, decided over every rank's rows."""
        held, names, grads = ready.held(), ready.names, ready.grads
        results, successors = sharding.precondition(
            self.stage.comm, list(zip(names, held, grads, strict=True)), ready.watch
        )
        outputs = [results[n] for n in names]
        bounds = [state.bound for state in held]
        comm = self.stage.comm
        written, flags, terms = sharding.agree_results(comm, grads, outputs, ready.layer_norms(), bounds, ready.clip)
        ready.watch.lap("precondition", names)
        return written, Checked(list(ready.indices), flags, terms), successors
