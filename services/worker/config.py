"""`WorkerConfig`: every knob of the worker service, built once in `__main__`.

Frozen and validated here; nothing below `__main__` reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.tls import TlsFiles

DEFAULT_LISTEN = "0.0.0.0:50061"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
ENCODER_MATMULS = ("auto", "float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Worker settings (Helm `worker.*` values map 1:1 onto these).

    Attributes:
        model: local HF model directory (config.json, *.safetensors, tokenizer).
        listen: address the WorkerService listens on.
        device: auto (cuda when available), cpu or cuda.
        dtype: auto (float32 on CPU, bfloat16 on CUDA) or an explicit torch dtype name.
        weight_dtype: how decoder linear weights are stored; auto = dtype. bfloat16 under float32
            activations (CPU) halves the bytes each decode step reads; the arithmetic stays float32.
        kv_cache_dtype: how the KV cache is stored; auto = dtype. bfloat16 or float16 under float32
            activations (CPU paged attention, which widens each block as it reads it) halves the
            cache's bytes: twice the tokens in the same budget, half the bytes attention reads.
        encoder_matmul: the inputs of an embedding or cross-encoder model's GEMMs under float32
            activations on CPU: bfloat16 (rounded at each GEMM, float32 accumulation, everything
            else float32) or float32; auto = bfloat16 for embedding models on a CPU with bf16
            math (vectors within cosine 0.9999 of float32, ~1.4x the tokens/s), else float32.
        attention_backend: auto, paged (CPU), sdpa, naive or flash-attn.
        block_size: tokens per KV-cache block (decoders; prefill-only models have no KV cache).
        kv_cache_bytes: KV-cache budget on CPU (on CUDA it is measured instead).
        gpu_memory_fraction: share of GPU memory the worker may use (weights, activations, KV cache).
        max_num_seqs: most requests in one forward pass (sizes the CUDA profiling run).
        max_num_batched_tokens: most tokens in one forward pass (sizes the CUDA profiling run).
        encoder_cache_bytes: memory for cached image features (vision-language models); the
            worker reports it in feature tokens and the scheduler checks its budget fits.
        max_model_len: longest sequence; None = the model's max_position_embeddings, capped for
            sentence-transformers models by sentence_bert_config.json's max_seq_length.
        num_threads: torch CPU threads; None keeps torch's default.
        metrics_port: port of the Prometheus /metrics endpoint (None: off; 0: a free port).
        step_port: port of the step socket (shared/step_frames.py) on the listen host; 0: a free one,
            -1: none (steps go over Execute). With internal_tls there is none.
        internal_tls: mutual TLS for the WorkerService (clients need a certificate from the CA); None: plaintext.
    """

    model: str
    listen: str = DEFAULT_LISTEN
    device: str = "auto"
    dtype: str = "auto"
    weight_dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    encoder_matmul: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024 * 1024
    gpu_memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    encoder_cache_bytes: int = 256 * 1024 * 1024
    max_model_len: int | None = None
    num_threads: int | None = None
    metrics_port: int | None = None
    fault_fail_round: int = 0
    step_port: int = 0
    internal_tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory (--model / SPINDLE_MODEL)")
        if self.device not in DEVICES:
            raise ValueError(f"{self.device=} must be one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.dtype=} must be one of {DTYPES}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"{self.weight_dtype=} must be one of {WEIGHT_DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{self.kv_cache_dtype=} must be one of {KV_CACHE_DTYPES}")
        if self.encoder_matmul not in ENCODER_MATMULS:
            raise ValueError(f"{self.encoder_matmul=} must be one of {ENCODER_MATMULS}")
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "encoder_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"{self.gpu_memory_fraction=} must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"{self.max_model_len=} must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"{self.num_threads=} must be >= 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"{self.metrics_port=} is not a TCP port")
