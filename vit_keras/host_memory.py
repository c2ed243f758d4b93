"""`keep_freed_host_memory`: glibc's malloc set to keep freed memory for reuse (JAX on CPU).

XLA:CPU allocates each execution's scratch buffer with `malloc`. glibc maps a block that large
afresh with `mmap` and unmaps it on `free`, and a thread with a malloc arena of its own (any arena
but the main one) does the same for blocks beyond its heap: either way every training step
page-faults the whole buffer in again (a ViT-Ti/16 step on 2 CPUs: ~124,000 faults). With one
arena, no `mmap` for large blocks and no trimming of the heap's top, a step reuses earlier steps'
pages. (A finite trim threshold is not enough: a ViT-B/16 training step's scratch memory is over
2 GB, and a 1 GiB threshold gave the heap back after every step, ~520,000 faults and 8-12% of the
step.)

The settings change the whole process, so the library never applies them: a program opts in.
They reach only threads that have not allocated yet, and threads start early (OpenBLAS starts
its pool when NumPy is imported), so the exact way is the environment, from the process's start:

    GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615

(`HOST_MEMORY_TUNABLES`; the largest threshold, so the heap is never trimmed). This module
imports nothing but the standard library, so that a program's first lines can load it by path
and call `keep_freed_host_memory()` before NumPy (the apps do: `apps/_backend.py`).
"""

import ctypes
import sys

HOST_MEMORY_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                        f"glibc.malloc.trim_threshold={2 ** 64 - 1}")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_host_memory(trim_threshold=None):
    """Makes glibc keep freed memory for reuse instead of returning it to the kernel.

    One malloc arena for the threads that have not allocated yet, no `mmap` for large blocks, and
    the free memory at the top of the heap kept (`trim_threshold=None`), or up to `trim_threshold`
    bytes of it. The price is memory the process keeps, up to its peak, rather than returns.

    Call it before any other thread allocates: first thing, before NumPy, JAX or anything that
    starts threads is imported. A call after `import vit_keras` (which imports NumPy) is only
    partly effective: threads that already made arenas of their own keep them, and XLA's threads
    may share them (measured on a ViT-Ti/16 training step: 0 or ~26,000 page faults per step from
    one process to the next, against ~124,000 untuned). The exact equivalent, for every thread
    from the process's start, is the environment variable

        GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615

    (glibc's tunables call the functions `mallopt` does.) Returns whether it was applied (False
    off Linux or on another C library).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl)
        return False
    # mallopt takes an int; glibc stores the threshold as a size_t, so -1 is the largest one.
    threshold = -1 if trim_threshold is None else int(trim_threshold)
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, threshold))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
