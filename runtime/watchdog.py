"""Multi-host runs that fail loudly: when a process dies, the others stop.

In a multi-controller JAX run every process takes part in every collective.
If one process dies (killed, out of memory, a crashed host), a survivor waits
in its next collective: gloo/NCCL either report an unhelpful transport error
("Connection reset by peer") or wait for a very long time, and JAX's own
coordination service aborts the process only after its heartbeat timeout
(100 s by default) with a C++ stack trace.

:func:`initialize` wraps ``jax.distributed.initialize`` and starts a
:class:`PeerWatchdog` in every process.  The watchdog keeps its own
heartbeat per process in the coordination service's key-value store (one
small write per second); when a peer's heartbeat stops for
``heartbeat_timeout_s`` -- or the coordination service itself (process 0)
cannot be reached for that long -- it writes one clear line naming the lost
process to stderr and ends this process with exit status
:data:`PEER_LOST_EXIT_CODE` (75, ``EX_TEMPFAIL``: restart the job from its
last checkpoint)::

    meshplan: lost process 1 of 2 (no heartbeat for 5.0 s: it died, was killed or
    hangs); the multi-host run cannot continue, so process 0 stops too (exit
    status 75) instead of waiting forever in a collective

When process 0 dies, the coordination service dies with it and JAX itself
aborts every other process at once (its client loses the service's socket),
with a log line that says "the leader task was preempted/died"; that is
faster than any heartbeat, and jaxlib offers no Python hook to replace it
(``missed_heartbeat_callback`` cannot be called with a status from Python).

JAX's own heartbeat timeout is set longer (``2 * heartbeat_timeout_s + 5``)
so that this message comes first; JAX's abort remains the fallback.  A
process that finishes normally marks itself done at exit, so peers still
finishing their work do not report it lost.  ``on_lost`` replaces the
default action (print and exit) for programs that want to clean up
themselves; it is called from the watchdog thread.
"""
from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import jax

__all__ = ("initialize", "PeerWatchdog", "PEER_LOST_EXIT_CODE", "lost_message",)

PEER_LOST_EXIT_CODE = 75
_PREFIX = "meshplan/watchdog"


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               heartbeat_timeout_s: float = 10.0, initialization_timeout_s: float = 120.0,
               cpu_collectives: str | None = "gloo", watchdog: bool = True,
               on_lost: Callable[[Sequence[int], str], Any] | None = None,
               **kwargs: Any) -> "PeerWatchdog | None":
    """``jax.distributed.initialize`` with a failure watchdog.

    ``cpu_collectives`` sets ``jax_cpu_collectives_implementation`` (CPU
    meshes spanning processes need ``"gloo"``; ``None`` leaves it alone).
    Other keyword arguments go to ``jax.distributed.initialize``.  Returns
    the started watchdog (``None`` with ``watchdog=False`` or one process).
    """
    if heartbeat_timeout_s <= 0:
        raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s}")
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address, num_processes=num_processes, process_id=process_id,
        initialization_timeout=int(math.ceil(initialization_timeout_s)),
        heartbeat_timeout_seconds=int(math.ceil(2 * heartbeat_timeout_s + 5)), **kwargs)
    if not watchdog or num_processes <= 1:
        return None
    dog = PeerWatchdog(heartbeat_timeout_s, coordinator_address=coordinator_address,
                       on_lost=on_lost)
    dog.start()
    return dog


def _report_and_exit(message: str, on_lost: Callable[..., Any] | None,
                     lost: Sequence[int] = ()) -> None:
    if on_lost is not None:
        on_lost(list(lost), message)
        return
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except Exception:
        os.write(2, (message + "\n").encode())
    os._exit(PEER_LOST_EXIT_CODE)


def lost_message(lost: Sequence[int], me: int, count: int, silent_s: float,
                 coordinator: str | None = None, failed: dict[int, str] | None = None) -> str:
    """The line printed when processes ``lost`` stop responding (``[-1]``:
    the coordination service) or fail (``failed``: process -> its error)."""
    if failed:
        what = "; ".join(f"process {p} failed with {e}" for p, e in sorted(failed.items()))
        return (f"meshplan: {what}; the multi-host run cannot continue, so process {me} of "
                f"{count} stops too (exit status {PEER_LOST_EXIT_CODE}) instead of waiting "
                "forever in a collective")
    if list(lost) == [-1]:
        where = f" at {coordinator}" if coordinator else ""
        silent = "it stopped answering" if math.isnan(silent_s) else \
            f"no answer for {silent_s:.1f} s"
        return (f"meshplan: lost the coordination service (process 0{where}): {silent} "
                f"(process 0 died, was killed or hangs); the multi-host run "
                f"cannot continue, so process {me} stops too (exit status "
                f"{PEER_LOST_EXIT_CODE}) instead of waiting forever in a collective")
    names = ", ".join(str(p) for p in lost)
    s = "es" if len(lost) > 1 else ""
    silent = "its heartbeats stopped" if math.isnan(silent_s) else \
        f"no heartbeat for {silent_s:.1f} s"
    return (f"meshplan: lost process{s} {names} of {count} ({silent}: "
            f"it died, was killed or hangs); the multi-host run cannot continue, so process "
            f"{me} stops too (exit status {PEER_LOST_EXIT_CODE}) instead of waiting forever "
            "in a collective")


class PeerWatchdog:
    """Heartbeats through the coordination service; see the module doc.

    Two daemon threads: one writes this process's heartbeat and reads the
    peers' (it may block while the service is unreachable), the other only
    compares timestamps and so notices even that.
    """

    def __init__(self, timeout_s: float, *, coordinator_address: str | None = None,
                 on_lost: Callable[[Sequence[int], str], Any] | None = None,
                 interval_s: float | None = None) -> None:
        from jax._src import distributed
        self._state = distributed.global_state
        if self._state.client is None:
            raise RuntimeError("PeerWatchdog needs jax.distributed.initialize(...) first")
        self.timeout_s = float(timeout_s)
        self.interval_s = float(interval_s or min(1.0, self.timeout_s / 4))
        self.me = jax.process_index()
        self.count = jax.process_count()
        self.coordinator = coordinator_address
        self.on_lost = on_lost
        now = time.monotonic()
        self._seen = {p: (None, now) for p in range(self.count) if p != self.me}
        self._done: set[int] = set()
        self._failed: dict[int, str] = {}
        self._last_ok = now
        self._stop = threading.Event()
        self._fired = False
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._beat, name="meshplan-heartbeat",
                                          daemon=True),
                         threading.Thread(target=self._judge, name="meshplan-watchdog",
                                          daemon=True)]

    def start(self) -> None:
        atexit.register(self._at_exit)
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop watching (e.g. before a deliberate early exit of this process)."""
        self._stop.set()
        self._mark_done()

    # ---- threads ---------------------------------------------------------
    def _client(self) -> Any:
        return self._state.client

    def _beat(self) -> None:
        counter = 0
        while not self._stop.is_set():
            client = self._client()
            if client is None:          # jax.distributed.shutdown() ran: a clean end
                self._stop.set()
                return
            counter += 1
            try:
                client.key_value_set(f"{_PREFIX}/beat/{self.me}", str(counter),
                                     allow_overwrite=True)
                for p in list(self._seen):
                    value = _try_get(client, f"{_PREFIX}/beat/{p}")
                    if _try_get(client, f"{_PREFIX}/done/{p}") is not None:
                        with self._lock:
                            self._done.add(p)
                    failure = _try_get(client, f"{_PREFIX}/failed/{p}")
                    if failure is not None:
                        with self._lock:
                            self._failed.setdefault(p, failure)
                    with self._lock:
                        if value is not None and value != self._seen[p][0]:
                            self._seen[p] = (value, time.monotonic())
                with self._lock:
                    self._last_ok = time.monotonic()
            except Exception:           # the service is unreachable: the judge decides
                pass
            self._stop.wait(self.interval_s)

    def _judge(self) -> None:
        while not self._stop.wait(self.interval_s / 2):
            if self._client() is None:
                return
            now = time.monotonic()
            with self._lock:
                failed = dict(self._failed)
                silent_service = now - self._last_ok
                lost = sorted(p for p, (_, t) in self._seen.items()
                              if p not in self._done and now - t > self.timeout_s)
                silent = max((now - self._seen[p][1] for p in lost), default=0.0)
            if failed:
                self._fire(sorted(failed), 0.0, failed)
                return
            if silent_service > self.timeout_s and self.me != 0:
                self._fire([-1], silent_service)
                return
            if lost:
                self._fire(lost, silent)
                return

    # ---- reporting -------------------------------------------------------
    def _fire(self, lost: Sequence[int], silent_s: float,
              failed: dict[int, str] | None = None) -> None:
        if self._fired or self._client() is None:
            return
        self._fired = True
        message = lost_message(lost, self.me, self.count, silent_s, self.coordinator, failed)
        _report_and_exit(message, self.on_lost, lost)

    def _mark_done(self) -> None:
        client = self._client()
        if client is None:
            return
        try:
            client.key_value_set(f"{_PREFIX}/done/{self.me}", "1", allow_overwrite=True)
        except Exception:
            pass

    def _at_exit(self) -> None:
        # The judge keeps running (a survivor leaving after a transport error
        # in a collective still reports the lost peer).  An uncaught
        # exception (Python keeps it in sys.last_value) is posted for the
        # peers, which stop at once; a normal end is marked done, so peers
        # still finishing their work do not take this process for lost.
        error = getattr(sys, "last_value", None)
        client = self._client()
        if error is None or client is None:
            self._mark_done()
            return
        text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        try:
            client.key_value_set(f"{_PREFIX}/failed/{self.me}", text, allow_overwrite=True)
        except Exception:
            pass


def _try_get(client: Any, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception:
        return None
