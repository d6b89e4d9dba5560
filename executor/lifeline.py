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

An orphan also removes CBSERVE_RUN_DIR, the private directory serve made for
its sockets and removes at its own exit (what serve put there, then the
directory): a killed serve cannot, and its executors are the last of it
alive. Every way out does it once the parent is
gone: the watch thread when it sees that, the SIGTERM that ends an executor
still starting (before the graceful handler is installed, a handler that
removes it and dies of the signal as before), and the graceful stop's exit
(orphaned_exit).

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
RUN_DIR_ENV = "CBSERVE_RUN_DIR"
# The graceful stop (server.stop(grace=2.0) in executor/server.py) fits in it;
# with the detection this keeps an orphan's exit under 5 s.
GRACE_S = 3.0
POLL_S = 0.5  # only where pidfd_open is missing
# How long a stopping executor whose parent still shows alive waits for it to
# show its death (_parent_dying): a parent that stops it on purpose costs this.
EXIT_WAIT_S = 0.05
ORPHANED_EXIT = 3  # exit status of a stop forced after GRACE_S

_started = False
_parent = 0


def hold() -> None:
    """Ties this process's life to CBSERVE_PARENT_PID's; a no-op without it
    (an executor started on its own) and on a second call."""
    global _started, _parent
    try:
        parent = int(os.environ.get(PARENT_ENV, "0"))
    except ValueError:
        parent = 0
    if _started or parent <= 0:
        return
    _started = True
    _parent = parent
    try:  # replaced by the graceful handler once the executor serves (executor/server.py)
        signal.signal(signal.SIGTERM, _term_while_starting)
    except ValueError:  # not the main thread (in-process use): the default action stays
        pass
    _set_pdeathsig(signal.SIGTERM)
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux / glibc: the watch thread alone
        pass


def orphaned_exit() -> None:
    """Called as the process ends: an orphan removes serve's directory."""
    if _parent > 0 and _parent_dying(EXIT_WAIT_S):
        _remove_run_dir()


def _parent_dying(wait_s: float) -> bool:
    """Whether the parent is gone or exiting, waiting up to `wait_s` for it
    to show. The kernel sends the death signal as the thread that started
    this process exits; the other threads of a killed serve can outlive it
    by a moment, and while they do this process is still their child
    (getppid() unchanged) and serve's main thread a zombie."""
    end = time.monotonic() + wait_s
    while True:
        if os.getppid() != _parent:
            return True
        try:
            with open(f"/proc/{_parent}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in (b"Z", b"X"):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)


def _remove_run_dir() -> None:
    """Removes what serve puts in its directory (router/supervisor.py: the
    executors' sockets and configs), then the directory if that empties it:
    never more than serve would have removed."""
    path = os.environ.get(RUN_DIR_ENV)
    if not path:
        return
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if name.startswith("executor") and name.endswith((".sock", ".yaml")):
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:  # something else in it, or gone already
        pass


def _term_while_starting(signum: int, _frame) -> None:
    """SIGTERM before the executor serves: what the default action did (the
    process dies of the signal), after an orphan's clean-up."""
    orphaned_exit()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _watch(parent: int) -> None:
    _wait_for_exit(parent)
    _remove_run_dir()
    try:  # the graceful path first: the executor's SIGTERM handler
        os.kill(os.getpid(), signal.SIGTERM)
    except OSError:
        pass
    time.sleep(GRACE_S)
    try:
        os.write(2, f"executor: parent {parent} gone; stopped after {GRACE_S:.0f} s\n".encode())
    except OSError:  # the log pipe's reader died with the parent
        pass
    _remove_run_dir()  # again: an executor that went on to bind its socket made the directory again
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
