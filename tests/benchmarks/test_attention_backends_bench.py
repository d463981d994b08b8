"""The attention comparison benchmarks: run.py's per-backend spindle jobs, attention_bench's batches and
encoder_attention_bench's table."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import encoder_attention_bench
from benchmarks.attention_bench import BLOCK_SIZE, decode_metadata, prefill_gflop, prefill_metadata
from benchmarks.models import BENCH_MODELS
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


def test_prefill_metadata_is_the_last_chunk_of_one_long_prompt() -> None:
    context, chunk = 4096, 2048
    num_blocks = context // BLOCK_SIZE + 8
    meta = prefill_metadata(context, chunk, num_blocks)
    table = meta.block_tables.numpy()[0]
    assert len(np.unique(table)) == context // BLOCK_SIZE and table.max() < num_blocks
    pos = np.arange(context - chunk, context)  # this pass writes the chunk's own keys at their slots
    assert (meta.slot_mapping.numpy() == table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).all()
    assert (meta.max_query_len, meta.max_seq_len, meta.query_start_loc.tolist()) == (chunk, context, [0, chunk])


def test_prefill_flops_count_each_query_against_the_keys_up_to_its_own() -> None:
    config = SimpleNamespace(head_dim=64, num_heads=16, num_layers=8)  # the fields it reads
    # a 2-token chunk after 3 cached tokens: its queries see 4 and 5 keys
    assert prefill_gflop(config, 5, 2) == pytest.approx(4 * 64 * 16 * (4 + 5) * 8 / 1e9)


def test_run_checks_the_context_of_the_models_it_runs() -> None:
    assert BENCH_MODELS["medium-long"].max_position_embeddings >= 4009 > BENCH_MODELS["medium"].max_position_embeddings
    assert parse_settings(["--models", "medium-long", "--input-len", "4000", "--output-len", "9"]).input_len == 4000
    with pytest.raises(ValueError, match="exceeds 2048"):
        parse_settings(["--models", "medium,medium-long", "--input-len", "4000", "--output-len", "9"])


@pytest.mark.usefixtures("cpu_kernels")
def test_encoder_attention_bench_times_the_kernel_against_the_sdpa_loop(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        encoder_attention_bench.main(["--repeats", "2", "--threads", "1"])  # checks both agree before timing
    finally:
        torch.set_num_threads(threads)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if " tokens | " in line]
    assert [row[0] for row in rows] == [f"| {label}" for label in encoder_attention_bench.batches()]
    assert all(float(row[-1].strip(" |")) > 0 for row in rows)  # loop / kernel
