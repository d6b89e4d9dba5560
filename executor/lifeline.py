"""An executor that `cbserve serve` started never outlives it.

Two layers, because one alone fails in states an orphan can be in:
- the kernel sends SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG), and
  the executor's handler stops the server gracefully;
- a watch thread waits on the parent itself (a pidfd, else polling its parent
  pid). On the parent's death it sends that SIGTERM in case the kernel's was
  lost (the parent died before the prctl), and after GRACE_S ends the process
  with os._exit whatever the main thread is doing: a Python signal handler
  only runs when the main thread returns to the interpreter, which a blocked
  write to a full log pipe or a stuck gRPC shutdown can delay for ever.

The parent's pid comes from CBSERVE_PARENT_PID, set by the supervisor, never
from os.getppid() at start-up: a parent that died while this process was still
importing would already have been replaced by init there.

Imports nothing heavy: executor/__main__.py runs it before torch loads, so a
router killed during the executor's start-up is noticed too."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import threading
import time

PARENT_ENV = "CBSERVE_PARENT_PID"
# The graceful stop (server.stop(grace=2.0) in executor/server.py) fits in it;
# with the detection this keeps an orphan's exit under 5 s.
GRACE_S = 3.0
POLL_S = 0.5  # only where pidfd_open is missing
ORPHANED_EXIT = 3  # exit status of a stop forced after GRACE_S

_started = False


def hold() -> None:
    """Ties this process's life to CBSERVE_PARENT_PID's; a no-op without it
    (an executor started on its own) and on a second call."""
    global _started
    try:
        parent = int(os.environ.get(PARENT_ENV, "0"))
    except ValueError:
        parent = 0
    if _started or parent <= 0:
        return
    _started = True
    _set_pdeathsig(signal.SIGTERM)
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux / glibc: the watch thread alone
        pass


def _watch(parent: int) -> None:
    _wait_for_exit(parent)
    try:  # the graceful path first: the executor's SIGTERM handler
        os.kill(os.getpid(), signal.SIGTERM)
    except OSError:
        pass
    time.sleep(GRACE_S)
    try:
        os.write(2, f"executor: parent {parent} gone; stopped after {GRACE_S:.0f} s\n".encode())
    except OSError:  # the log pipe's reader died with the parent
        pass
    os._exit(ORPHANED_EXIT)


def _wait_for_exit(parent: int) -> None:
    """Returns once `parent` is no longer this process's parent."""
    fd = None
    try:
        fd = os.pidfd_open(parent)
    except (OSError, AttributeError):  # gone already, or no pidfd (old kernel, not Linux)
        pass
    if fd is not None:
        # Opened, but possibly on a new process that reused a dead parent's pid:
        # only waited on while it is still the parent.
        if os.getppid() == parent:
            select.select([fd], [], [])  # readable once the process has exited
        os.close(fd)
        return
    while os.getppid() == parent:
        time.sleep(POLL_S)
