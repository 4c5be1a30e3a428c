"""Operating-system names for the server's own threads, so per-thread CPU time (``top -H``,
/proc/PID/task/TID/comm, benchmarks/concurrency.py's CPU split) tells the batch step thread and the
request threads from the event loop and the engine's workers. Python 3.11 names its threads only for
itself; Linux shows every thread as the process name unless the thread names itself."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# The step thread of a model's batch scheduler, and the threads that run its requests' generation loops.
STEP_THREAD = "colibri-batch"
REQUEST_THREAD = "colibri-req"

_PR_SET_NAME = 15  # prctl option (linux/prctl.h): name the calling thread
_NAME_MAX = 15  # the kernel keeps 15 bytes of a thread's name

_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # no libc to call: threads keep the process name
        _libc = None


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (cut to 15 bytes) as its OS name; nothing off Linux."""
    if _libc is None:
        return
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_NAME_MAX]), 0, 0, 0)
