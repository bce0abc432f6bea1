"""glibc malloc settings for processes that run diffusion pipelines on a CPU.

glibc serves a block above its mmap threshold (128 KiB at start, raised to the largest block
freed so far) with a fresh mapping, and hands free memory at the top of its heap back to the
kernel once there is more of it than the trim threshold (twice the mmap threshold). The next
tensor of that size then faults every page in again, zero-filled by the kernel. A denoising
call allocates and frees the same few-MiB activations hundreds of times: a tiny-flux batch of 8
at 256x256 took 30,000-97,000 minor page faults (0.2-0.3 s of system time in a 1.2 s call),
and a lone request about 5,000.

`tune_malloc` fixes the mmap threshold at glibc's ceiling for it (32 MiB on 64-bit) and keeps up
to 128 MiB of free heap, so those blocks are reused in place: the faults go (to tens), for about
15 MB more resident memory in the tiny-flux worker. Blocks past 32 MiB are still mapped and
unmapped, as before, and their cost is small next to the work on them.
"""

from __future__ import annotations

import ctypes
import sys

from genserve import envs

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20


def tune_malloc() -> bool:
    """Apply the settings to this process (call it before the big allocations). True when glibc
    took both; False where it is off (GENSERVE_MALLOC_TUNING=0) or the C library is not
    glibc."""
    if not envs.GENSERVE_MALLOC_TUNING.get() or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other C libraries: leave them be
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    trim_ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return mmap_ok and trim_ok
