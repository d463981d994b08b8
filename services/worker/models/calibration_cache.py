"""The linear kernel's calibration, kept on disk per kernel build, so a worker measures once.

`fast_linear.calibrate` times spindle's kernel against torch's GEMM for each weight shape at
every probe row count at start-up (~2-3 s for a 100M-parameter model on 2 cores), and the answer came out differently
from one start to the next where the two are close, so two runs of one benchmark did not run
the same code. The answer depends on the CPU, the kernel build, torch and the thread count:
it is stored beside the build (whose folder is keyed by sources, flags, torch version and CPU
features), under a key holding the shape, the weight and activation dtypes, the bias, the torch threads and the GEMM it
was timed against (oneDNN's on a packed copy, or torch's).
Written atomically (rename), merged with what other workers wrote meanwhile; an unreadable
file is measured over. `SPINDLE_RECALIBRATE=1` measures again and overwrites.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from shared.switches import switch_on

logger = logging.getLogger(__name__)

RECALIBRATE_ENV = "SPINDLE_RECALIBRATE"
FILE_NAME = "linear_calibration.json"
# The kernels' side-by-side switches that change what the probes time: a run with one on gets
# timings of its own, not the ones measured with it off (which chose the row counts for code it
# does not run).
KERNEL_SWITCHES = ("SPINDLE_DISABLE_BF16_PAIRS", "SPINDLE_DISABLE_FEW_ROWS_TILES")


def entry_key(out_features: int, in_features: int, weight_dtype: str, has_bias: bool, num_threads: int,
              onednn: bool = False, activation_dtype: str = "float32", working_set: int | None = None) -> str:
    """One measurement's key; `onednn`: the kernel was timed against oneDNN's GEMM, not torch's;
    `working_set`: the bytes of weight copies the probes cycled through (the model's linear
    weights, capped: the timings differ with it)."""
    bias = "bias" if has_bias else "nobias"
    versus = " vs-onednn" if onednn else ""
    activations = "" if activation_dtype == "float32" else f" x-{activation_dtype}"  # float32's keys as before
    cycled = "" if working_set is None else f" set={working_set >> 20}MiB"
    switches = "".join(f" {name}" for name in KERNEL_SWITCHES if switch_on(name))
    return (f"{out_features}x{in_features} {weight_dtype} {bias} threads={num_threads}{versus}{activations}{cycled}"
            f"{switches}")


Timings = tuple[tuple[float, float], ...]  # per probe row count: (kernel, GEMM) seconds


def load(path: Path) -> dict[str, Timings]:
    """Stored timings by `entry_key`; empty when absent or unreadable, or when a recalibration was asked for."""
    return {} if os.environ.get(RECALIBRATE_ENV) == "1" else _read(path)


def store(path: Path, measured: dict[str, Timings]) -> None:
    """Add `measured` to the file (atomically); a failure to write only costs the next start its time."""
    if not measured:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read(path), **measured}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
            json.dump(merged, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError as exc:
        logger.warning("could not store the linear calibration in %s: %s", path, exc)


def _read(path: Path) -> dict[str, Timings]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the linear calibration cache %s: %s", path, exc)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: timings for k, v in data.items() if isinstance(k, str) and (timings := _timings(v)) is not None}


def _timings(value: object) -> Timings | None:
    """`value` as timings: a list of [kernel, GEMM] pairs of positive seconds (else None: an entry
    of another format, e.g. a row count an older build stored, is measured again)."""
    if not isinstance(value, list):
        return None
    pairs = []
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in pair)):
            return None
        pairs.append((float(pair[0]), float(pair[1])))
    return tuple(pairs)
