"""Progress lines for planning steps that take a while.

``with progress.step("ILP on mesh data=8"): ...`` shows what meshplan is doing
on stderr while the step runs, and leaves a line with its time when it took
over a second.  Only when stderr is a terminal; nothing otherwise.

The command line sets the level once (``--quiet``: nothing, ``--verbose``:
every step with its time, also when stderr is not a terminal)::

    progress.configure(progress.QUIET | NORMAL | VERBOSE)

This is user-interface output only: no algorithm reads the level.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import IO, Iterator

QUIET, NORMAL, VERBOSE = 0, 1, 2
SLOW_S = 1.0            # steps at least this long leave a line behind

_level = NORMAL
_stream: IO[str] | None = None     # None: sys.stderr at the time of writing
_active: list[str] = []            # the steps now running, outermost first


# Set by :func:`interruptible`'s SIGINT handler.  A KeyboardInterrupt raised
# while a garbage-collection callback runs (JAX registers one) is lost, with
# an "Exception ignored" traceback; there the handler only sets this flag and
# :func:`check` raises at the next checkpoint.
_interrupted = False


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed (see :func:`interruptible`)."""
    if _interrupted:
        raise KeyboardInterrupt


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: Ctrl-C is remembered as well as raised, so that long planning
    loops (which call :func:`check`) stop even if the first raise was lost."""
    global _interrupted
    import gc
    import signal

    def on_sigint(signum, frame):
        global _interrupted
        _interrupted = True
        in_gc = {getattr(cb, "__code__", None) for cb in gc.callbacks}
        while frame is not None:
            if frame.f_code in in_gc:
                return          # raised there it would be lost (and printed): check() raises it
            frame = frame.f_back
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:          # not the main thread: leave Ctrl-C as it is
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _interrupted = False


def configure(level: int = NORMAL, stream: IO[str] | None = None) -> None:
    """Set the verbosity (QUIET, NORMAL, VERBOSE) and optionally the stream."""
    global _level, _stream
    _level, _stream = int(level), stream


def level() -> int:
    return _level


def _out() -> IO[str]:
    return _stream if _stream is not None else sys.stderr


def _is_tty(out: IO[str]) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):
        return False


def _write(text: str) -> None:
    out = _out()
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):   # a closed or broken stream never fails a plan
        pass


@contextmanager
def step(what: str) -> Iterator[None]:
    """Report the step ``what`` (see the module doc)."""
    check()
    if _level <= QUIET:
        yield
        return
    tty = _is_tty(_out())
    if not tty and _level < VERBOSE:
        yield
        return
    _active.append(what)
    if tty:
        _write(f"\r\x1b[Kmeshplan: {' > '.join(_active)} ...")
    t0 = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - t0
        _active.pop()
        clear = "\r\x1b[K" if tty else ""
        if elapsed >= SLOW_S or _level >= VERBOSE:
            _write(f"{clear}meshplan: {what}: {elapsed:.2f} s\n")
        elif tty:
            _write(clear)
        if tty and _active:
            _write(f"meshplan: {' > '.join(_active)} ...")


def note(message: str) -> None:
    """A line shown only with ``--verbose``."""
    if _level >= VERBOSE:
        tty = _is_tty(_out())
        _write(f"{chr(13) + chr(27) + '[K' if tty else ''}meshplan: {message}\n")
        if tty and _active:
            _write(f"meshplan: {' > '.join(_active)} ...")
