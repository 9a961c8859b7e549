"""Closing at the interpreter's exit what a program left open.

Why: a wrapper with servers or reading ahead keeps daemon threads, and some of them wait inside
torch.distributed calls (a store's queue, a gloo receive or send).  A program that ends without
``close()`` leaves them waiting.  When a peer then exits, its connections close and such a thread
wakes during the interpreter's finalization; Python ends it with ``pthread_exit``, whose
unwinding through torch's C++ frames calls ``std::terminate``.  The process aborts (SIGABRT),
and torchrun reports the rank failed although every update was made.  On a 2-rank job with
shards on both ranks, 5 of 6 runs ended so.

:func:`close_at_exit` registers an object whose ``close()`` stops those threads; the handler,
registered with :mod:`atexit` once, closes every one still open before finalization starts,
so a forgotten ``close()`` ends the job as ``close()`` would.  ``close()`` calls
:func:`closed`, so a closed object is never closed twice.  Weak references: an object the
program dropped is not kept alive for this.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

__all__ = ["close_at_exit", "closed"]

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_registered = False


def close_at_exit(obj: Closable) -> None:
    """Close ``obj`` at the interpreter's exit unless :func:`closed` was called for it."""
    global _registered
    # registered with the first wrapper, not at import: atexit runs the last registered
    # first, so this runs before any handler registered while the process group was set up
    if not _registered:
        atexit.register(_close_open)
        _registered = True
    _open.add(obj)


def closed(obj: Closable) -> None:
    """``obj`` is closed (or closing): nothing to do for it at exit."""
    _open.discard(obj)


def _close_open() -> None:
    for obj in list(_open):
        log.info("%s was not closed: closing it at exit", type(obj).__name__)
        try:
            obj.close()
        except Exception as exc:  # the other objects still get closed
            log.warning("closing %s at exit failed: %s: %s", type(obj).__name__,
                        type(exc).__name__, exc)  # fmt: skip
    # a thread that outlived its close() (its join timed out) may still wake during
    # finalization and abort the process: name it, so such an abort says whose it was
    left = [t.name for t in threading.enumerate() if t.name.startswith("gradfleet")]
    if left:
        log.warning("daemon threads still running at exit: %s", ", ".join(sorted(left)))
