"""The attention comparison benchmarks: run.py's per-backend spindle jobs and attention_bench's batches."""

from __future__ import annotations

import numpy as np

from benchmarks.attention_bench import BLOCK_SIZE, decode_metadata
from benchmarks.run import BenchSettings, parse_settings, plan


def test_run_plans_one_spindle_job_per_attention_backend() -> None:
    settings = parse_settings(["--models", "medium", "--concurrency", "1,64", "--configs", "spindle",
                               "--scheduler-steps", "8", "--attention-backends", "sdpa,paged"])
    jobs = plan(settings)
    assert [(j.config, j.concurrency, j.attention_backend) for j in jobs] == [
        ("spindle-steps8-sdpa", 1, "sdpa"), ("spindle-steps8-sdpa", 64, "sdpa"),
        ("spindle-steps8-paged", 1, "paged"), ("spindle-steps8-paged", 64, "paged"),
    ]
    default = plan(BenchSettings(models=("small",), concurrencies=(1,), configs=("spindle",), scheduler_steps=(8,)))
    assert [(j.config, j.attention_backend) for j in default] == [("spindle-steps8", None)]


def test_decode_metadata_gives_each_row_its_own_shuffled_blocks() -> None:
    seq_lens = np.array([2048] + [128] * 63)
    num_blocks = int((-(-seq_lens // BLOCK_SIZE)).sum()) + 8
    meta = decode_metadata(seq_lens, num_blocks)
    tables = meta.block_tables.numpy()
    used = np.concatenate([tables[r, : -(-n // BLOCK_SIZE)] for r, n in enumerate(seq_lens)])
    assert len(np.unique(used)) == len(used) and used.max() < num_blocks
    last = seq_lens - 1  # each row's new token goes to its last position
    expected = tables[np.arange(64), last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    assert (meta.slot_mapping.numpy() == expected).all() and meta.max_query_len == 1
