"""Entry point of the worker service: flags (SPINDLE_* env defaults) -> WorkerConfig -> serve.

`python -m services.worker --model DIR` or `spindle worker ...`. The gRPC server starts first
(health NOT_SERVING), the model loads off the event loop, then health turns SERVING (service.py).
This module imports no torch, so what the OpenMP runtime reads as torch loads can still be
chosen from the model (openmp_wait.py; tests/worker/test_openmp_wait.py checks it).
"""

from __future__ import annotations

import argparse
import os
import sys

from services.cpu_affinity import add_cpu_cores_argument
from services.cpu_quota import cgroup_cpu_limit, threads_for_quota
from services.worker.config import DEFAULT_LISTEN, ENCODER_MATMULS, KV_CACHE_DTYPES, WEIGHT_DTYPES, WorkerConfig
from services.worker.openmp_wait import configure_openmp_wait
from shared.service_flags import (
    add_internal_tls_arguments,
    add_observability_arguments,
    internal_tls_from_args,
    metrics_port_from_args,
)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPINDLE_{name}", default)


def _optional_int(value: str) -> int | None:
    return int(value) if value else None


def quota_threads() -> int | None:
    """Torch threads for a process told none: capped by its container's CPU quota, else torch's own count."""
    return threads_for_quota(len(os.sched_getaffinity(0)), cgroup_cpu_limit())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=_env("MODEL", ""), help="HF model directory [SPINDLE_MODEL]")
    parser.add_argument(
        "--listen",
        default=_env("WORKER_LISTEN", DEFAULT_LISTEN),
        help="host:port of the WorkerService [SPINDLE_WORKER_LISTEN]",
    )
    parser.add_argument(
        "--device", default=_env("DEVICE", "auto"), choices=("auto", "cpu", "cuda"), help="[SPINDLE_DEVICE]"
    )
    parser.add_argument(
        "--dtype",
        default=_env("DTYPE", "auto"),
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: float32 on CPU, bfloat16 on CUDA [SPINDLE_DTYPE]",
    )
    parser.add_argument(
        "--weight-dtype",
        default=_env("WEIGHT_DTYPE", "auto"),
        choices=WEIGHT_DTYPES,
        help="how linear weights are stored; auto: as --dtype. bfloat16 with float32 activations (CPU) "
        "halves the bytes a decode step reads [SPINDLE_WEIGHT_DTYPE]",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=_env("KV_CACHE_DTYPE", "auto"),
        choices=KV_CACHE_DTYPES,
        help="how the KV cache is stored; auto: as --dtype. bfloat16 or float16 with float32 activations "
        "(CPU, paged attention) holds twice the tokens and halves what attention reads [SPINDLE_KV_CACHE_DTYPE]",
    )
    parser.add_argument(
        "--encoder-matmul",
        default=_env("ENCODER_MATMUL", "auto"),
        choices=ENCODER_MATMULS,
        help="inputs of an embedding or cross-encoder model's GEMMs under float32 activations (CPU): bfloat16 "
        "(float32 accumulation) or float32; auto: bfloat16 for embedding models on a CPU with bf16 math "
        "[SPINDLE_ENCODER_MATMUL]",
    )
    parser.add_argument(
        "--attention-backend",
        default=_env("ATTENTION_BACKEND", "auto"),
        help="auto (CPU: paged when its C++ kernels load, else sdpa; CUDA: flash-attn when installed, "
        "else sdpa), paged, sdpa, naive or flash-attn [SPINDLE_ATTENTION_BACKEND]",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=int(_env("BLOCK_SIZE", "16")),
        help="tokens per KV block [SPINDLE_BLOCK_SIZE]",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=int(_env("KV_CACHE_BYTES", str(512 * 1024 * 1024))),
        help="KV cache budget on CPU [SPINDLE_KV_CACHE_BYTES]",
    )
    parser.add_argument(
        "--encoder-cache-bytes",
        type=int,
        default=int(_env("ENCODER_CACHE_BYTES", str(256 * 1024 * 1024))),
        help="memory for cached image features of vision-language models; must hold the scheduler's "
        "encoder budget [SPINDLE_ENCODER_CACHE_BYTES]",
    )
    parser.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=float(_env("GPU_MEMORY_FRACTION", "0.9")),
        help="share of GPU memory to use [SPINDLE_GPU_MEMORY_FRACTION]",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=int(_env("MAX_NUM_SEQS", "256")),
        help="most requests per forward pass [SPINDLE_MAX_NUM_SEQS]",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(_env("MAX_NUM_BATCHED_TOKENS", "2048")),
        help="most tokens per forward pass [SPINDLE_MAX_NUM_BATCHED_TOKENS]",
    )
    parser.add_argument(
        "--max-model-len",
        type=_optional_int,
        default=_optional_int(_env("MAX_MODEL_LEN", "")),
        help="longest sequence (default: the model's max_position_embeddings, or a sentence-transformers "
        "model's max_seq_length) [SPINDLE_MAX_MODEL_LEN]",
    )
    parser.add_argument(
        "--num-threads",
        type=_optional_int,
        default=_optional_int(_env("NUM_THREADS", "")),
        help="torch CPU threads (default: one per core it may use, no more than its container's CPU limit) "
        "[SPINDLE_NUM_THREADS]",
    )
    parser.add_argument("--step-port", type=int, default=int(_env("STEP_PORT", "0")),
                        help="TCP port of the step socket, which streams each step's tokens to the scheduler "
                             "without gRPC; 0: a free one, -1: none (not offered with --internal-tls) "
                             "[SPINDLE_STEP_PORT]")
    parser.add_argument("--fault-fail-round", type=int, default=int(_env("FAULT_FAIL_ROUND", "0")),
                        help="fault injection for tests: the n-th round this process runs raises; 0: never "
                             "[SPINDLE_FAULT_FAIL_ROUND]")
    add_observability_arguments(parser)
    add_cpu_cores_argument(parser)
    add_internal_tls_arguments(parser)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        model=args.model,
        listen=args.listen,
        device=args.device,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        encoder_matmul=args.encoder_matmul,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        encoder_cache_bytes=args.encoder_cache_bytes,
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        # Pinned: one torch thread per core it may use, unless told otherwise; in a container
        # with a CPU limit, no more than the limit allows (cpu_quota.py says why).
        num_threads=args.num_threads or (len(args.cpu_cores) or None) or quota_threads(),
        metrics_port=metrics_port_from_args(args),
        fault_fail_round=args.fault_fail_round,
        step_port=args.step_port,
        internal_tls=internal_tls_from_args(args),
    )


async def serve(config: WorkerConfig) -> None:
    """Serve until SIGTERM/SIGINT (service.py), OpenMP's wait policy set first (openmp_wait.py)."""
    configure_openmp_wait(config.model)
    cores = os.sched_getaffinity(0)
    from services.worker import service  # imports torch, which reads the policy as it loads
    # Where OMP_PROC_BIND is set (services/cpu_affinity.py), libgomp bound this thread to its
    # first place as torch loaded; the event loop gets the worker's cores back, and on a CPU
    # worker `service.serve` then puts it on the compute thread's core (`pin_event_loop`).
    os.sched_setaffinity(0, cores)
    await service.serve(config)


if __name__ == "__main__":
    from services.cli import run_service

    run_service("worker", sys.modules[__name__])
