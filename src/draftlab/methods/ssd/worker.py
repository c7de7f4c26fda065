"""Where the speculation cache is built: a worker process of its own (SSD's separate hardware), or inline.

Protocol, the same for both: ``build(**request)`` starts building the cache for the chain just proposed and
returns at once; ``lookup(key)`` waits for that build and answers ``(speculation or None, build seconds)``.
Every build is answered by exactly one lookup before the next build.

The process worker has its own copy of the draft (``OutcomeDrafter.portable()``), its own threads and CPUs. It
never outlives its owner: ``close()`` stops it (and kills it if it does not stop), a finalizer does the same
if the owner forgets, and the worker itself exits when its parent dies -- the kernel kills it
(``PR_SET_PDEATHSIG`` on Linux) and, everywhere, reading the closed pipe ends its loop.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable
from functools import partial

from draftlab.decoding.outcome_drafter import OutcomeChain
from draftlab.methods.ssd.cache import OutcomeCache

_STARTUP_S = 300.0  # spawning a Python with torch and copying a draft in
_NO_KEY = object()


class InlineWorker:
    """Builds in the caller's process, at ``lookup`` time (no second core: what SSD costs without one)."""

    def __init__(self, outcome_drafter):
        self.cache = OutcomeCache(outcome_drafter)
        self._request: dict | None = None

    def build(self, **request) -> None:
        self._request = request

    def lookup(self, key) -> tuple[OutcomeChain | None, float]:
        if self._request is None:
            raise RuntimeError("lookup without a build")
        t0 = time.perf_counter()
        self.cache.build(**self._request)
        self._request = None
        return self.cache.lookup(key), time.perf_counter() - t0

    def close(self) -> None:
        self._request = None


def _die_with_parent(parent: int) -> None:
    if hasattr(os, "sched_getaffinity"):  # Linux: the kernel delivers SIGKILL when the parent exits
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(0)


def _outcome_is_elsewhere(conn, arrived: list, keys: set) -> bool:
    """After the glue pass the keys are known: an outcome that has already arrived (kept in ``arrived``) and is
    not among them makes the branches useless; so does a stop."""
    if not arrived and conn.poll():
        arrived.append(conn.recv())
    return bool(arrived) and (arrived[0][0] != "lookup" or arrived[0][1] not in keys)


def _serve(conn, make_outcome_drafter: Callable, threads: int, cpus: list[int] | None, parent: int) -> None:
    """The worker's loop (runs in the child)."""
    _die_with_parent(parent)
    import torch

    torch.set_num_threads(int(threads))
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cpus))
    cache = OutcomeCache(make_outcome_drafter())
    conn.send(("ready",))
    built, early = 0.0, _NO_KEY
    while True:
        if early is not _NO_KEY:  # the lookup arrived during the build
            kind, payload, early = "lookup", early, _NO_KEY
        else:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # the owner is gone
                return
        if kind == "stop":
            return
        if kind == "build":
            arrived: list = []
            t0 = time.perf_counter()
            cache.build(**payload, give_up=partial(_outcome_is_elsewhere, conn, arrived))
            built = time.perf_counter() - t0
            if arrived:
                if arrived[0][0] == "stop":
                    return
                early = arrived[0][1]
        elif kind == "lookup":
            conn.send(("spec", cache.lookup(payload), built))


def _stop(process, conn) -> None:
    try:
        conn.send(("stop", None))
    except (OSError, ValueError):
        pass
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)
    conn.close()


class ProcessWorker:
    """The cache built in a spawned process while the caller verifies (see the module docstring)."""

    def __init__(self, make_outcome_drafter: Callable, *, threads: int = 1, cpus: list[int] | None = None):
        import torch.multiprocessing as mp  # its pickler shares the draft's tensors instead of copying them

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, make_outcome_drafter, threads, cpus, os.getpid()),
                                   daemon=True, name="ssd-worker")
        self.process.start()
        child.close()  # only the child holds its end: the child sees EOF when this process dies
        self._finalizer = weakref.finalize(self, _stop, self.process, self._conn)
        self._receive(_STARTUP_S)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def _receive(self, timeout: float = float("inf")):
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self.process.is_alive():
                raise RuntimeError(f"the SSD worker (pid {self.pid}) died with exit code {self.process.exitcode}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the SSD worker did not answer within {timeout:.0f} s")
        return self._conn.recv()

    def build(self, **request) -> None:
        # Pickled by value: tensors in a request (a feature draft's verified rows) are small and come every round;
        # the default pickler would move each into a shared-memory segment of its own.
        self._conn.send_bytes(pickle.dumps(("build", request), protocol=pickle.HIGHEST_PROTOCOL))

    def lookup(self, key) -> tuple[OutcomeChain | None, float]:
        self._conn.send(("lookup", key))
        _, spec, built = self._receive()
        return spec, built

    def close(self) -> None:
        self._finalizer()  # stops the process once; later calls do nothing
