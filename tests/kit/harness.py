"""A small multi-process harness for torch.distributed tests: gloo on CPU, or NCCL with one GPU per rank.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (fork by default: no
re-import of torch, so a launch costs well under a second), each of which

1. pins itself to one intra-op thread (``torch.set_num_threads(1)``),
2. joins a gloo process group on 127.0.0.1 and a free port, with a collective timeout,
3. runs ``fn(rank, world_size, *args)`` and sends the (picklable) result back to the parent,
4. meets the other ranks at a final barrier and destroys the process group.

The parent returns the results as a list indexed by rank. It never hangs:

- if a rank raises, the parent raises :class:`WorkerError` carrying that rank's traceback as soon
  as the error arrives (the other ranks get a short grace period to report, then are killed);
- if a rank dies without a result (crash, ``os._exit``), the parent raises :class:`WorkerError`;
- if the ranks have not all finished after ``timeout`` seconds, every child is killed and the
  parent raises :class:`DistributedTimeoutError`, including the Python stacks of the unfinished
  ranks at the moment of the timeout (dumped with :mod:`faulthandler` on SIGUSR1).

A collective that waits for a rank that never arrives fails inside the rank after ``pg_timeout``
seconds (gloo timeout), which is reported like any other worker error.

Set ``HYLO_TEST_START_METHOD=spawn`` to use the spawn start method instead of fork (then ``fn``
and ``args`` must be picklable by reference, i.e. ``fn`` is a module-level function).

``backend="nccl"`` runs rank r on ``cuda:r`` (:func:`rank_device`; spawned, as CUDA cannot be used in a
forked child of a process that has used it): :func:`nccl_problem` says why a machine cannot, and a
test that runs under both backends moves its tensors to ``rank_device(rank)`` and returns them on the CPU.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Seconds a whole ``run_distributed`` call may take before every rank is killed.
DEFAULT_TIMEOUT = 60.0
#: Seconds the other ranks get to report after the first error, before they are killed.
ERROR_GRACE = 2.0
#: Modules imported in the parent before forking, so that every rank inherits them instead of
#: importing them itself: DistributedDataParallel imports torch._dynamo on construction, which
#: costs seconds per process (over 10 s per rank on a loaded 2-core machine).
PRELOAD_MODULES: tuple[str, ...] = ("torch._dynamo",)
#: Bytes of stack dump quoted per rank in a timeout message.
_STACK_CHARS = 6000

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedHarnessError",
    "DistributedTimeoutError",
    "WorkerError",
    "free_port",
    "nccl_problem",
    "rank_device",
    "run_distributed",
]


class DistributedHarnessError(RuntimeError):
    """Base class of the errors ``run_distributed`` raises in the parent."""


class WorkerError(DistributedHarnessError):
    """A rank raised (or died without a result).

    Attributes:
        rank: the rank that failed first.
        exc_type: name of the exception class raised in the worker ("" if it died).
        remote_traceback: the worker's formatted traceback (or a description of how it died).
        phase: "init" (joining the process group), "run" (inside ``fn``), "exit" (after ``fn``
            returned) or "died" (no report at all).
    """

    def __init__(self, message: str, rank: int, exc_type: str, remote_traceback: str, phase: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.phase = phase


class DistributedTimeoutError(DistributedHarnessError, TimeoutError):
    """The ranks did not all finish within the harness timeout; all were killed.

    Attributes:
        unfinished: ranks that had not reported when the timeout expired.
        stacks: rank → Python stack dump taken at the timeout (may be empty).
    """

    def __init__(self, message: str, unfinished: list[int], stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.unfinished = unfinished
        self.stacks = stacks


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read the port back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def nccl_problem(world_size: int = 2) -> str | None:
    """Why ``world_size`` NCCL ranks cannot run here (one GPU each, the device tier on CUDA), or None."""
    from tests.kit.devices import chosen  # the tier's switch

    if chosen().type != "cuda":
        return "NCCL runs with the device tier on CUDA (python -m pytest --device cuda)"
    if torch.cuda.device_count() < world_size:
        return f"NCCL needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPU(s) here"
    return None


def rank_device(rank: int) -> torch.device:
    """The device of rank ``rank`` of the current process group: ``cuda:rank`` under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# ---------------------------------------------------------------------------------------- child
def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    init_method: str,
    pg_timeout: float,
    conn: connection.Connection,
    stack_path: str,
    backend: str,
) -> None:
    """Body of one rank. Reports exactly one message on ``conn``: ("ok", bytes) or ("error", ...)."""
    phase = "init"
    stack_file = None
    sent = False
    try:
        torch.set_num_threads(1)
        stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        device = None
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
            device_id=device,
        )
        phase = "run"
        result = fn(rank, world_size, *args)
        phase = "exit"
        payload = pickle.dumps(("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)))
        conn.send_bytes(payload)
        sent = True
        # Nobody leaves while a peer may still be reading from its sockets.
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        if not sent:
            message = f"{type(exc).__name__}: {exc}"
            conn.send_bytes(pickle.dumps(("error", phase, type(exc).__name__, message, traceback.format_exc())))
            sent = True
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            conn.close()
            if stack_file is not None:
                faulthandler.unregister(signal.SIGUSR1)
                stack_file.close()


# ---------------------------------------------------------------------------------------- parent
class _Launch:
    """One attempt: the children, their pipes and what each has reported."""

    def __init__(
        self,
        ctx: Any,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...],
        pg_timeout: float,
        backend: str,
    ) -> None:
        self.backend = backend
        self.world_size = world_size
        self.tmpdir = tempfile.mkdtemp(prefix="hylo-dist-")
        self.stack_paths = [os.path.join(self.tmpdir, f"rank{r}.stack") for r in range(world_size)]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[Any] = []
        self.conns: dict[int, connection.Connection] = {}
        self.results: dict[int, Any] = {}
        # rank -> (phase, exc_type, message, traceback); insertion order = arrival order
        self.errors: dict[int, tuple[str, str, str, str]] = {}
        try:
            self._start(ctx, fn, args, init_method, pg_timeout)
        except BaseException:
            self.close()
            raise

    def _start(
        self, ctx: Any, fn: Callable[..., Any], args: tuple[Any, ...], init_method: str, pg_timeout: float
    ) -> None:
        world_size = self.world_size
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    args,
                    init_method,
                    pg_timeout,
                    writer,
                    self.stack_paths[rank],
                    self.backend,
                ),
                name=f"hylo-test-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.conns[rank] = reader

    def reported(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors

    def receive(self, rank: int) -> None:
        conn = self.conns.pop(rank)
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc = self.procs[rank]
            proc.join(timeout=1.0)
            self.errors[rank] = ("died", "", f"died without a result ({_exit_text(proc.exitcode)})", "")
            return
        finally:
            conn.close()
        if message[0] == "ok":
            try:
                self.results[rank] = pickle.loads(message[1])
            except Exception as exc:  # noqa: BLE001
                self.errors[rank] = ("exit", type(exc).__name__, f"result could not be unpickled: {exc}", "")
        else:
            _, phase, exc_type, text, tb = message
            self.errors[rank] = (phase, exc_type, text, tb)

    def wait(self, deadline: float) -> bool:
        """Collect reports until all ranks have reported and exited; False on timeout."""
        grace_end: float | None = None
        while True:
            now = time.monotonic()
            if self.errors and grace_end is None:
                grace_end = now + ERROR_GRACE
            if len(self.results) + len(self.errors) == self.world_size:
                break
            if grace_end is not None and now >= grace_end:
                return True  # report the error now; the rest get killed
            if now >= deadline:
                return False
            pending = list(self.conns.values())
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs) if r in self.conns}
            limit = min(deadline, grace_end) if grace_end is not None else deadline
            ready = connection.wait([*pending, *sentinels], timeout=max(0.0, limit - now))
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank in self.conns:  # exited: its message (if any) is in the pipe
                        self.receive(rank)
                else:
                    rank = next((r for r, c in self.conns.items() if c is obj), None)
                    if rank is not None:
                        self.receive(rank)
        # Everybody reported: let them pass the final barrier and exit (briefly, after an error:
        # a rank that succeeded may wait at the barrier for one that failed; it gets killed).
        end = min(deadline, time.monotonic() + ERROR_GRACE) if self.errors else deadline
        for rank, proc in enumerate(self.procs):
            proc.join(timeout=max(0.0, end - time.monotonic()))
            if self.errors:
                continue
            if proc.exitcode is None:
                return False
            if proc.exitcode != 0 and rank not in self.errors:
                self.errors[rank] = (
                    "exit",
                    "",
                    f"returned a result but then exited with {_exit_text(proc.exitcode)}",
                    "",
                )
        return True

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask the unfinished ranks for a Python stack dump (SIGUSR1) and read it back."""
        for rank in ranks:
            proc = self.procs[rank]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 2.0
        out: dict[int, str] = {}
        for rank in ranks:
            # faulthandler writes a dump line by line: read until it is non-empty and stops growing
            text, previous = "", None
            while time.monotonic() < end and not (text.strip() and text == previous):
                time.sleep(0.05)
                previous, text = text, _read(self.stack_paths[rank])
            out[rank] = text
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _preload() -> None:
    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - optional speed-up only
            pass


def _port_clash(error: tuple[str, str, str, str]) -> bool:
    phase, _, text, tb = error
    blob = (text + tb).lower()
    return phase == "init" and ("address already in use" in blob or "eaddrinuse" in blob)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    pg_timeout: float | None = None,
    start_method: str | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    Args:
        fn: the per-rank body; its return value must be picklable (tensors are fine).
        world_size: number of processes (>= 1; a process group is created even for 1).
        *args: passed to ``fn`` after ``rank, world_size`` (inherited under fork, pickled under spawn).
        timeout: seconds for the whole run (start-up included) before all ranks are killed.
        pg_timeout: gloo collective timeout in seconds; default ``0.75 * timeout``.
        start_method: "fork" (default, or ``$HYLO_TEST_START_METHOD``) or "spawn"; always spawn under NCCL or once
            this process has used CUDA.
        backend: "gloo" (CPU) or "nccl" (rank r on ``cuda:r``; see :func:`nccl_problem`).

    Raises:
        WorkerError: a rank raised or died; the message holds that rank's traceback.
        DistributedTimeoutError: the run exceeded ``timeout``; the message holds the stacks of
            the unfinished ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and (problem := nccl_problem(world_size)) is not None:
        raise ValueError(problem)
    # a child forked from a process that has used CUDA can use neither CUDA nor autograd: spawn it
    spawn = backend == "nccl" or torch.cuda.is_initialized()
    method = "spawn" if spawn else start_method or os.environ.get("HYLO_TEST_START_METHOD", "fork")
    if method == "fork":
        _preload()
    ctx = mp.get_context(method)
    pg_timeout = 0.75 * timeout if pg_timeout is None else pg_timeout
    start = time.monotonic()
    deadline = start + timeout
    for attempt in range(3):
        launch = _Launch(ctx, fn, world_size, args, pg_timeout, backend)
        try:
            finished = launch.wait(deadline)
            if not finished:
                unfinished = [r for r in range(world_size) if not launch.reported(r) or launch.procs[r].is_alive()]
                stacks = launch.stacks(unfinished)
                raise DistributedTimeoutError(
                    _timeout_message(fn, world_size, timeout, launch, unfinished, stacks), unfinished, stacks
                )
            if launch.errors:
                first_rank, first = next(iter(launch.errors.items()))
                if attempt < 2 and any(_port_clash(e) for e in launch.errors.values()):
                    continue  # another process took the port between probing and binding: retry
                raise WorkerError(
                    _error_message(fn, world_size, launch, time.monotonic() - start),
                    first_rank,
                    first[1],
                    first[3] or first[2],
                    first[0],
                )
            return [launch.results[r] for r in range(world_size)]
        finally:
            launch.close()
    raise AssertionError("unreachable")


def _error_message(fn: Callable[..., Any], world_size: int, launch: _Launch, elapsed: float) -> str:
    items = list(launch.errors.items())
    rank, (phase, _, text, tb) = items[0]
    where = {"init": " while joining the process group", "run": "", "exit": " after running", "died": ""}[phase]
    head = (
        f"run_distributed({_fn_name(fn)}, world_size={world_size}): rank {rank} failed{where} after "
        f"{elapsed:.1f} s: {text}"
    )
    lines = [head]
    if tb:
        lines += ["", f"--- traceback from rank {rank} ---", tb.rstrip()]
    for other, (_, _, other_text, _) in items[1:]:
        lines.append(f"(rank {other} also failed afterwards: {other_text.splitlines()[0] if other_text else '?'})")
    silent = [r for r in range(world_size) if not launch.reported(r)]
    if silent:
        lines.append(f"(ranks {silent} had not reported and were killed)")
    return "\n".join(lines)


def _timeout_message(
    fn: Callable[..., Any],
    world_size: int,
    timeout: float,
    launch: _Launch,
    unfinished: list[int],
    stacks: dict[int, str],
) -> str:
    done = [r for r in range(world_size) if r not in unfinished]
    head = (
        f"run_distributed({_fn_name(fn)}, world_size={world_size}) timed out after {timeout:g} s: "
        f"ranks {unfinished} had not finished (finished: {done}); all ranks were killed. A rank that never "
        "reaches a collective the others wait in, or a deadlock, looks like this."
    )
    lines = [head]
    for rank, (_, _, text, _) in launch.errors.items():
        lines.append(f"(rank {rank} had failed: {text.splitlines()[0] if text else '?'})")
    for rank in unfinished:
        text = stacks.get(rank, "").strip()
        if text:
            if len(text) > _STACK_CHARS:
                text = "...\n" + text[-_STACK_CHARS:]
            lines += ["", f"--- Python stacks of rank {rank} at the timeout ---", text]
    return "\n".join(lines)
