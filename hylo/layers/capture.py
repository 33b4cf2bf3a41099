"""Hooks that record a layer's input and output gradient on update steps only."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from hylo.layers.compiled import eager, run_eagerly
from hylo.layers.statistics import Call, CapturedCall

#: Reduces a call's (input, output gradient) in its gradient hook (docs/design.md, "Memory").
Reducer = Callable[[Tensor, Tensor], CapturedCall]


class _GraphToken:
    """Held only by a call's output-gradient hook: it dies with the call's autograd graph."""


def _dead() -> _GraphToken | None:
    return None


@dataclass
class Record:
    """One forward call of a layer: its input until the backward reaches it, then what the update needs.

    With a ``reducer``, the output-gradient hook reduces the input and output gradient at once
    (``call``) and drops the input; without one it keeps both (``grad_output``). A call counts
    once: a second backward through a retained graph leaves a reduced call as it was.
    ``graph`` returns None once the call's autograd graph is freed: if backward has not run
    by then, it never will.
    """

    inputs: Tensor | None
    grad_output: Tensor | None = None
    graph: Callable[[], _GraphToken | None] = field(default=_dead, repr=False)
    #: Made while autograd ran a backward (a checkpointed forward's recomputation).
    in_backward: bool = False
    #: The layer's output shape (None when an attention tap feeds the capture: its rows are the input's).
    out_shape: torch.Size | None = None
    reducer: Reducer | None = field(default=None, repr=False)
    call: CapturedCall | None = None

    @property
    def completed(self) -> bool:
        """Whether the call's backward has run."""
        return self.call is not None or self.grad_output is not None

    @property
    def abandoned(self) -> bool:
        """Whether the call's graph was freed without its backward running."""
        return not self.completed and self.graph() is None

    def complete(self, grad_output: Tensor) -> None:
        """The backward reached the call: reduce it (dropping the input), or keep its output gradient."""
        if self.reducer is None:
            self.grad_output = grad_output
        elif self.inputs is not None:
            self.call = self.reducer(self.inputs, grad_output)
            self.inputs = None


class LayerCapture:
    """Forward hook on one module; on capture steps it also hooks the output tensor.

    The tensor hook is registered inside the forward hook, before any in-place op that
    follows the layer (e.g. ``ReLU(inplace=True)``) modifies the output, so it receives
    the gradient with respect to the layer's own output. Nothing is stored unless
    :attr:`active` is true, the module is training and autograd is recording. ``active`` is a
    plain attribute the planner sets between steps, so that a compiled model's graph on steps
    that do not capture is the graph without hylo (docs/wrappers.md, "torch.compile").

    A call whose graph is freed before its backward ran (e.g. evaluation in train mode with
    autograd on, at a capture step) is dropped at the next call, with one warning per layer;
    calls still awaiting their backward and calls whose backward ran are kept (gradient
    accumulation, a layer applied many times in one forward). While a call's graph is alive,
    its stored input shares memory with the input autograd saved, so pending calls cost nothing
    beyond their graphs.
    """

    def __init__(
        self, name: str, module: nn.Module | None = None, output: Callable[[Any], Tensor | None] | None = None
    ) -> None:
        self.records: list[Record] = []
        self.name = name
        #: Whether this layer captures at the current step (set by :meth:`arm` between steps).
        self.active = False
        #: Reduces each call in its gradient hook; None keeps inputs and output gradients until step().
        self.reducer: Reducer | None = None
        #: Calls of its module at this step that routed it no row (an idle expert; docs/moe.md, "Idle experts").
        self.idle = 0
        self._warned = False
        # None: another hook feeds this capture through open() (an attention module's projections, fused experts);
        # else ``module``'s forward hook, ``output`` giving the tensor of its output that is the layer's s (the math's
        # ``layer_output``)
        self._handle: RemovableHandle | None = None
        if module is not None:
            assert output is not None, "a hooked module's capture needs the math's layer_output"
            hook = functools.partial(self._forward_hook, output)
            self._handle = module.register_forward_hook(hook, with_kwargs=True)

    def arm(self, active: bool) -> None:
        """Capture at the coming step or not; while capturing, compiled code runs eagerly (hylo.layers.compiled)."""
        self.active = active
        run_eagerly(self, active)

    def wants(self) -> bool:
        """Whether this layer captures at the current step (the module's mode and autograd aside)."""
        return self.active

    def _forward_hook(
        self,
        layer_output: Callable[[Any], Tensor | None],
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: Any,
    ) -> None:
        if not (self.active and module.training and torch.is_grad_enabled()):
            return
        output = layer_output(outputs)
        if output is None or not output.requires_grad:
            return
        x = args[0] if args else kwargs["input"]
        eager(self._watch)(x, output)

    def _watch(self, x: Tensor, output: Tensor) -> None:
        watch_gradient(output, [(self.open(x, output.shape), _whole)])

    def open(self, x: Tensor, out_shape: torch.Size | None = None) -> Record:
        """Record one call with input ``x`` (and output shape); :func:`watch_gradient` on its output completes it."""
        self._drop_abandoned()
        record = Record(x.detach(), in_backward=_in_backward(), out_shape=out_shape, reducer=self.reducer)
        self.records.append(record)
        return record

    def _drop_abandoned(self) -> None:
        """Forget calls whose backward can no longer run; warn the first time for this layer."""
        kept: list[Record] = []
        dropped: list[Record] = []
        for record in self.records:
            (dropped if record.abandoned else kept).append(record)
        if not dropped:
            return
        self.records = kept
        if not self._warned and not all(r.in_backward for r in dropped):
            self._warned = True
            warnings.warn(
                f"hylo layer {self.name!r}: a forward call at a capture step was discarded without "
                "backward (its graph was freed); hylo dropped its captured input. Run evaluation under "
                "torch.no_grad() or model.eval() so that hylo does not capture it",
                stacklevel=2,
            )

    def calls(self) -> list[Call]:
        """Each forward call whose backward has run: reduced, or its (input, output gradient)."""
        calls: list[Call] = []
        for record in self.records:
            if record.call is not None:
                calls.append(record.call)
            elif record.grad_output is not None and record.inputs is not None:
                calls.append((record.inputs, record.grad_output))
        return calls

    def pending(self) -> list[Record]:
        """Calls still waiting for their backward (with their inputs)."""
        return [record for record in self.records if not record.completed and record.inputs is not None]

    def drop_completed(self) -> None:
        """Drop the calls whose backward has run, keeping those still awaiting theirs: an earlier window's calls,
        when a GradScaler skipped that window's step (docs/transformers.md, "Mixed precision")."""
        self.records = [record for record in self.records if not record.completed]

    def clear(self) -> None:
        """Drop everything captured."""
        self.records = []
        self.idle = 0

    def remove(self) -> None:
        """Detach the forward hook and drop captured data; compiled code that still calls the hook captures nothing."""
        self.arm(False)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.clear()


class KeptCalls:
    """The captured calls of a step that raised, kept for a retry without a new forward and backward
    (docs/reliability.md, "Transactional steps")."""

    def __init__(self, captures: Sequence[LayerCapture]) -> None:
        self.captures = list(captures)
        #: Each layer's captured calls when a step last raised; None: nothing kept.
        self.held: list[list[Record]] | None = None

    def keep(self) -> None:
        """A step raised: hold each layer's calls for a retry."""
        self.held = [list(capture.records) for capture in self.captures]

    def settle(self) -> None:
        """At the next step: keep the held calls for it if no layer captured a new call since (a retry), else
        drop them, so that they never mix with a new forward's calls."""
        held, self.held = self.held, None
        if held is None:
            return
        retry = all(
            [id(record) for record in capture.records] == [id(record) for record in kept]
            for capture, kept in zip(self.captures, held, strict=True)
        )
        if not retry:
            for capture, kept in zip(self.captures, held, strict=True):
                stale = {id(record) for record in kept}
                capture.records = [record for record in capture.records if id(record) not in stale]


def _whole(grad: Tensor) -> Tensor:
    return grad


def watch_gradient(output: Tensor, records: list[tuple[Record, Callable[[Tensor], Tensor]]]) -> None:
    """Hook ``output`` so that its gradient, through each record's selector, completes the records.

    The hook alone holds the records' graph token: it dies with the output's autograd graph.
    """
    token = _GraphToken()
    for record, _ in records:
        record.graph = weakref.ref(token)

    def grad_hook(grad: Tensor, token: _GraphToken = token) -> None:
        detached = grad.detach()
        for record, select in records:
            record.complete(select(detached))

    output.register_hook(grad_hook)


def backward_pass() -> int | None:
    """The id of the backward pass autograd is running (a new one per ``backward()``), -1 outside one; None when this
    torch does not tell.

    Read from a private torch function; if a torch release drops it, :func:`_in_backward` takes every call for a
    plain forward (the only effect: a checkpointed recomputation may warn once) and the planner checks the loss
    scale at every hook instead of once per backward pass."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return None if task_id is None else int(task_id())


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (e.g. recomputing a checkpointed forward): :func:`backward_pass`."""
    return backward_pass() not in (None, -1)
