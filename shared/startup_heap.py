"""Keep the garbage collector's full passes off the serving path.

Why: a service's start-up (torch, transformers, grpc, the model, the tokenizer) leaves ~300,000
objects that live as long as the process, and CPython's occasional full (generation 2) collection
walks every one of them. Measured (2-core AMD EPYC, gc callbacks in all three services of a served
64-stream run): full passes of 17-122 ms in the worker while it started, and one of 49 ms in the
scheduler mid-run: a pause every stream sees as one late token. `gc.freeze()` moves what is alive
at the end of start-up into a permanent generation that collections skip, so a later full pass
walks only what serving itself created. Nothing is lost: frozen objects are simply never
collected, and they were not garbage.

`SPINDLE_DISABLE_GC_FREEZE=1` skips it (side-by-side runs).
"""

from __future__ import annotations

import gc
import logging
import time

from shared.switches import switch_on

logger = logging.getLogger(__name__)

DISABLE_ENV = "SPINDLE_DISABLE_GC_FREEZE"


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen (0: disabled)."""
    if switch_on(DISABLE_ENV):
        logger.info("start-up heap left to the garbage collector (%s)", DISABLE_ENV)
        return 0
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("start-up heap frozen: %d objects no longer walked by the garbage collector (%.0f ms)",
                frozen, (time.perf_counter() - start) * 1e3)
    return frozen
