"""glibc malloc settings for the worker: a step's large temporaries reuse freed memory.

Why: the worker asks torch for 2 MB transparent huge pages under large tensors (package
docstring), and glibc serves an allocation above its mmap threshold (128 KB, rising to the size
of what was last freed) with a fresh mapping that `free` hands back to the kernel. Such a
tensor made every step (the LM head's 64-row logits, 2 MB at vocab 8192; a prefill chunk's
activations, megabytes a layer) then faults in and zeroes new huge pages each time: an
8192 x 16 linear at 64 rows took 753 us with huge pages against 168 without (2-core AMD EPYC
Zen 4). Fixing the threshold at glibc's ceiling (32 MB) serves those from the heap, and a high
trim threshold keeps what they free for the next step: 178 us, huge pages kept. Engine, bf16
small model, 64 streams, two interleaved runs of each (decode / with the prompts' round,
tok/s): huge pages as before 9,958-10,310 / 6,752-7,410; without huge pages 8,471-10,163 /
6,992-7,615; huge pages with these settings 10,420-10,671 / 7,663-8,568. Served, interleaved
pairs: the fp32 medium model at 64 streams 357 / 388 -> 374 / 401 out tok/s; the bf16 small one
unchanged (4,677 against 4,701 on average over 4 pairs). Tensors above 32 MB
(the KV cache, weights: allocated once) still get mappings of their own.

The memory kept is what a step's temporaries peaked at; it is reused, not leaked. glibc only:
elsewhere nothing is set. `SPINDLE_DISABLE_MALLOC_THRESHOLDS=1` leaves glibc's defaults
(side-by-side runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util

from shared.switches import switch_on

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 512 << 20  # free memory at the heap's top kept before it is returned
DISABLE_ENV = "SPINDLE_DISABLE_MALLOC_THRESHOLDS"


def keep_large_temporaries_in_the_heap() -> bool:
    """Set the two thresholds; True where glibc accepted both (False: disabled, or not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None or switch_on(DISABLE_ENV):
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mmap_set = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and mmap_set
