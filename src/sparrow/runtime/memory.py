"""The process's malloc: keep what is freed, so that each prefill does not fault its activations' pages in again.

A prefill's activations are tens of MiB a tensor. glibc's malloc gives freed memory back to the system: it trims the
top of its main heap once more than twice its mmap threshold is free there, and drops a thread arena's heap once it
empties, so a prefill that runs after another touched fresh pages again, each a minor fault. Measured on a 1.5B
target (AMD EPYC Zen 5, 2 cores, bfloat16, 32 chat prompts of 5710 tokens prefilled in three groups, from a worker
thread as the server's scheduler runs them; two processes a side, alternating): 1.9-2.0 million minor faults and
~3 s of system time a prefill, 21.5-21.6 s; with `keep_freed_memory`: 0 faults and 19.3-19.5 s in one process,
0.76-0.99 million and 19.9-21.1 s in the other; peak memory 4.7-5.2 GiB either way.

`keep_freed_memory` sets glibc's `mallopt`: one arena for every thread (a thread arena's heap is unmapped when it
empties), no trimming (`M_TRIM_THRESHOLD` at its maximum) and a fixed mmap threshold at glibc's largest, 32 MiB
(bigger blocks stay mmap'd and go back to the system at free, as before). The process keeps the heap it reached
(the server's steady state anyway). The command line calls it at start (every `sparrow` command); a program using
the library may call it itself. Elsewhere (not Linux, or not glibc) it does nothing. `SPARROW_KEEP_FREED_MEMORY=0`
turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: bigger blocks stay mmap'd (and go back to the system at free)
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, 2**31 - 1))
ENV = "SPARROW_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (see the module doc); whether it applied."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)


__all__ = ["keep_freed_memory"]
