"""Progress lines for planning steps that take a while.

A :class:`Progress` reporter is made once at the edge (the CLI from
``--quiet``/``--verbose``, the API with the default level) and travels in the
planning session::

    with reporter.step("ILP on mesh data=8"): ...

shows what meshplan is doing on stderr while the step runs, and leaves a line
with its time when it took over a second.  At the NORMAL level only when
stderr is a terminal; nothing otherwise.  This is user-interface output only:
no algorithm reads the level.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import IO, Iterator

QUIET, NORMAL, VERBOSE = 0, 1, 2
SLOW_S = 1.0            # steps at least this long leave a line behind


class Progress:
    """One reporter: its level, its stream (None: ``sys.stderr`` at the time
    of writing), the steps now running and whether Ctrl-C was pressed."""

    def __init__(self, level: int = NORMAL, stream: IO[str] | None = None) -> None:
        self.level = int(level)
        self.stream = stream
        self._active: list[str] = []     # the steps now running, outermost first
        # Set by :meth:`interruptible`'s SIGINT handler.  A KeyboardInterrupt
        # raised while a garbage-collection callback (JAX registers one), a
        # weakref finalizer or a __del__ runs is lost, with an "Exception
        # ignored" traceback; there the handler only sets this flag and
        # :meth:`check` raises at the next checkpoint.
        self._interrupted = False

    def __repr__(self) -> str:
        return f"Progress(level={self.level})"

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed (see :meth:`interruptible`)."""
        if self._interrupted:
            raise KeyboardInterrupt

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Within: Ctrl-C is remembered as well as raised, so that long planning
        loops (which call :meth:`check`) stop even if the first raise was lost."""
        import gc
        import signal
        import weakref

        def on_sigint(signum, frame):
            self._interrupted = True
            # (a gc callback, a weakref finalizer or a __del__ that the
            # collector runs: raised there it would be lost, and printed)
            lost = {getattr(cb, "__code__", None) for cb in gc.callbacks}
            lost.add(weakref.finalize.__call__.__code__)
            while frame is not None:
                if frame.f_code in lost or frame.f_code.co_name == "__del__":
                    return      # check() raises it at the next checkpoint
                frame = frame.f_back
            raise KeyboardInterrupt

        try:
            previous = signal.signal(signal.SIGINT, on_sigint)
        except ValueError:      # not the main thread: leave Ctrl-C as it is
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
            self._interrupted = False

    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr

    def _write(self, text: str) -> None:
        try:
            out = self._out()
            out.write(text)
            out.flush()
        except (OSError, ValueError):   # a closed or broken stream never fails a plan
            pass

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Report the step ``what`` (see the module doc)."""
        self.check()
        tty = _is_tty(self._out())
        if self.level <= QUIET or (not tty and self.level < VERBOSE):
            yield
            return
        self._active.append(what)
        if tty:
            self._write(f"\r\x1b[Kmeshplan: {' > '.join(self._active)} ...")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            self._active.pop()
            clear = "\r\x1b[K" if tty else ""
            if elapsed >= SLOW_S or self.level >= VERBOSE:
                self._write(f"{clear}meshplan: {what}: {elapsed:.2f} s\n")
            elif tty:
                self._write(clear)
            if tty and self._active:
                self._write(f"meshplan: {' > '.join(self._active)} ...")

    def note(self, message: str) -> None:
        """A line shown only with ``--verbose``."""
        if self.level >= VERBOSE:
            tty = _is_tty(self._out())
            self._write(f"{chr(13) + chr(27) + '[K' if tty else ''}meshplan: {message}\n")
            if tty and self._active:
                self._write(f"meshplan: {' > '.join(self._active)} ...")


def _is_tty(out: IO[str]) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):
        return False
