"""`Worker`: loads the model, sizes and allocates the KV cache, and owns the runner.

Everything here happens once at startup; the per-round work is the runner's. Device, dtype and
backend choices are resolved here from `WorkerConfig` and reported in `WorkerInfo`. The model
class's task picks the runner: `ModelRunner` with a paged KV cache for decoders,
`PoolingRunner` with no KV cache (block_size 0, num_kv_blocks 0) for embedding and
cross-encoder models.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from services.worker.attention import AttentionBackend, create_backend, resolve_backend_name
from services.worker.config import WorkerConfig
from services.worker.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for_budget
from services.worker.model_runner import ModelRunner
from services.worker.models import resolve_model
from services.worker.models.bert import EncoderModel
from services.worker.models.config import DecoderConfig
from services.worker.models.llava import LlavaModelConfig
from services.worker.models.loader import load_model, parse_config, read_hf_config
from services.worker.models.prepacked_linear import build_gemms, use_bf16_inputs
from services.worker.pooling import load_pooling_config
from services.worker.pooling_runner import PoolingRunner
from shared.execute import ExecuteRound, NewRequestData, WorkerInfo
from shared.sampling import SamplingOptions
from shared.types import RequestKind

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def runs_on_cpu(name: str) -> bool:
    """Whether a worker told `--device name` computes on the CPU (auto: when CUDA is absent)."""
    return name == "cpu" or (name == "auto" and not torch.cuda.is_available())


def resolve_device(name: str) -> torch.device:
    if runs_on_cpu(name):
        return torch.device("cpu")
    if not torch.cuda.is_available():  # auto finds CUDA (runs_on_cpu): only an explicit cuda gets here
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device("cuda")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _warn_without_native_bf16(dtype: torch.dtype, device: torch.device) -> None:
    """bf16 activations on a CPU without bf16 math run, but their GEMMs crawl: say so, with the alternative."""
    from services.worker.kernels.build import cpu_has_native_bf16

    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        logger.warning("dtype bfloat16 on a CPU without native bf16 math (no avx512_bf16, amx_bf16 or bf16 flag): "
                       "its matrix products are emulated and slow; --dtype float32 --weight-dtype bfloat16 keeps "
                       "the halved weight bytes with float32 arithmetic")


def resolve_weight_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Storage dtype of linear weights: as the activations, or bfloat16 under float32 on a CPU.

    Narrower weights pay only where spindle's CPU kernel widens them in registers; elsewhere
    every call would widen a whole weight, so other combinations are refused at start-up.
    """
    weight_dtype = dtype if name == "auto" else _DTYPES[name]
    if weight_dtype == dtype:
        return dtype
    if not (device.type == "cpu" and dtype == torch.float32 and weight_dtype == torch.bfloat16):
        raise ValueError(
            f"weight_dtype={name!r} with dtype {str(dtype).removeprefix('torch.')} on {device.type}: "
            "only bfloat16 weights under float32 activations on a CPU are supported (or leave it auto)"
        )
    return weight_dtype


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, backend_name: str) -> torch.dtype:
    """Storage dtype of the KV cache: as the activations, or 16-bit under float32 for paged attention.

    Only the CPU paged kernel reads a cache of another dtype well: it widens each block once
    into a buffer every query of the block reuses. The other backends gather the cache into
    the activations' dtype, so they are refused at start-up rather than failing on the first
    request.
    """
    kv_dtype = dtype if name == "auto" else _DTYPES[name]
    if kv_dtype == dtype:
        return dtype
    if not (backend_name == "paged" and dtype == torch.float32 and kv_dtype in (torch.bfloat16, torch.float16)):
        raise ValueError(
            f"kv_cache_dtype={name!r} with dtype {str(dtype).removeprefix('torch.')} and attention backend "
            f"{backend_name!r}: only a bfloat16 or float16 cache under float32 activations with the paged "
            "backend (CPU) is supported (or leave it auto)"
        )
    return kv_dtype


def resolve_encoder_matmul(name: str, task: RequestKind, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The inputs' dtype of a prefill-only model's GEMMs (`WorkerConfig.encoder_matmul`).

    auto is bfloat16 only for embedding models, on a CPU with bf16 math, under float32
    activations: an embedding is read through cosine similarity, which the rounding moves by
    ~3e-5 (all-MiniLM-L6-v2), while a cross-encoder's score is read as a number and ranks, so
    it stays float32 unless asked. Without bf16 math a bf16 GEMM is emulated and slower than
    float32, hence float32 there."""
    if task is RequestKind.GENERATE:
        if name != "auto":
            raise ValueError("encoder_matmul applies to embedding and cross-encoder models; leave it auto "
                             "for decoders (see weight_dtype and dtype)")
        return dtype
    applies = device.type == "cpu" and dtype == torch.float32
    if name != "auto" and not applies:
        raise ValueError(f"encoder_matmul={name} applies under float32 activations on CPU; here the activations "
                         f"are {str(dtype).removeprefix('torch.')} on {device.type} (leave it auto)")
    if name == "float32" or not applies:
        return dtype
    from services.worker.kernels.build import cpu_has_native_bf16

    if name == "bfloat16":
        if not cpu_has_native_bf16():
            logger.warning("encoder_matmul bfloat16 on a CPU without native bf16 math: its GEMMs are emulated "
                           "and slower than float32")
        return torch.bfloat16
    return torch.bfloat16 if task is RequestKind.EMBED and cpu_has_native_bf16() else torch.float32


class Worker:
    """A loaded model (with its KV cache for decoders), ready to execute rounds."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        _warn_without_native_bf16(self.dtype, self.device)
        self.weight_dtype = resolve_weight_dtype(config.weight_dtype, self.dtype, self.device)
        backend_name = resolve_backend_name(config.attention_backend, self.device.type)
        if backend_name == "flash-attn" and self.dtype == torch.float32:
            if config.attention_backend != "auto":
                raise ValueError(
                    "attention_backend='flash-attn' needs dtype bfloat16 or float16, not float32"
                )
            backend_name = "sdpa"  # flash-attn has no float32 kernels
        self.backend = create_backend(backend_name, config.block_size)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, backend_name)
        self.backend_name = backend_name
        self.model_config = parse_config(read_hf_config(config.model))
        self.task = resolve_model(self.model_config.architecture)[0].task
        self.encoder_matmul = resolve_encoder_matmul(config.encoder_matmul, self.task, self.dtype, self.device)
        self.model_id = Path(os.path.abspath(config.model)).name
        self.runner: ModelRunner | PoolingRunner
        if self.task is RequestKind.GENERATE:
            assert isinstance(self.model_config, DecoderConfig | LlavaModelConfig)
            self.info = self._init_generative(self.model_config)
        else:
            self.info = self._init_pooling()
        logger.info(
            "worker ready: model=%s task=%s dtype=%s weight_dtype=%s kv_cache_dtype=%s device=%s backend=%s "
            "num_kv_blocks=%d "
            "(%d tokens) max_model_len=%d threads=%d",
            self.info.model_id,
            self.task.name,
            self.info.dtype,
            str(self.weight_dtype).removeprefix("torch."),
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.info.device,
            backend_name,
            self.info.num_kv_blocks,
            self.info.num_kv_blocks * self.info.block_size,
            self.max_model_len,
            torch.get_num_threads(),
        )

    def _info(
        self, block_size: int, num_kv_blocks: int, eos_token_ids: tuple[int, ...], pooled_size: int = 0
    ) -> WorkerInfo:
        return WorkerInfo(
            model_id=self.model_id,
            task=self.task,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            attention_backend=self.backend_name,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            eos_token_ids=eos_token_ids,
            pooled_size=pooled_size,
        )

    def _init_generative(self, model_config: DecoderConfig | LlavaModelConfig) -> WorkerInfo:
        config = self.config
        self.decoder_config = model_config
        self.max_model_len = self._max_model_len(model_config.max_position_embeddings)
        self.model = load_model(config.model, self.backend, self.dtype, self.device, self.weight_dtype)
        if self.device.type == "cuda":
            num_blocks = self._profile_num_blocks()
        else:
            num_blocks = num_blocks_for_budget(model_config, config.block_size, self.kv_cache_dtype,
                                               config.kv_cache_bytes)
        self.runner = self._make_runner(
            allocate_kv_caches(model_config, num_blocks, config.block_size, self.kv_cache_dtype, self.device,
                               head_major=self.backend.head_major_cache)
        )
        info = self._info(
            block_size=config.block_size,
            num_kv_blocks=num_blocks,
            eos_token_ids=model_config.eos_token_ids,
        )
        if isinstance(model_config, LlavaModelConfig):
            info = dataclasses.replace(
                info,
                mm_tokens_per_item=model_config.tokens_per_image,
                encoder_cache_tokens=self.runner.encoder_cache_tokens,
            )
        return info

    def _init_pooling(self) -> WorkerInfo:
        """Embedding / cross-encoder model: no KV cache, no EOS; max_model_len honours ST's cap."""
        pooling = load_pooling_config(self.config.model, self.task)
        if self.kv_cache_dtype != self.dtype:
            raise ValueError("kv_cache_dtype applies to decoder models (embedding and cross-encoder models keep "
                             "no KV cache); leave it auto")
        if self.weight_dtype != self.dtype:
            raise ValueError("weight_dtype applies to decoder models; leave it auto for embedding and "
                             "cross-encoder models")
        self.max_model_len = self._max_model_len(
            self.model_config.max_position_embeddings, pooling.max_seq_length
        )
        model = load_model(self.config.model, self.backend, self.dtype, self.device)
        assert isinstance(model, EncoderModel)
        self.model = model
        if self.encoder_matmul != self.dtype:
            num_layers = use_bf16_inputs(model)
            logger.info("encoder GEMMs: bfloat16 inputs, float32 accumulation, in %d linear layers "
                        "(--encoder-matmul %s; float32 keeps them float32)", num_layers, self.config.encoder_matmul)
        if self.device.type == "cpu":
            build_gemms(model, self.max_model_len, self.dtype)
        self.runner = PoolingRunner(
            model, self.backend, pooling, max_model_len=self.max_model_len, device=self.device
        )
        logger.info("pooling: %s; outputs of size %d", pooling.method.value, model.pooled_size)
        return self._info(block_size=0, num_kv_blocks=0, eos_token_ids=(), pooled_size=model.pooled_size)

    def _max_model_len(self, limit: int, default: int | None = None) -> int:
        """--max-model-len when given (up to the position table), else `default` capped by the table."""
        if self.config.max_model_len is None:
            return min(limit, default or limit)
        if self.config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} exceeds the model's {limit} positions"
            )
        return self.config.max_model_len

    def _make_runner(
        self, kv_caches: list[torch.Tensor], backend: AttentionBackend | None = None
    ) -> ModelRunner:
        return ModelRunner(
            self.model,
            backend or self.backend,
            kv_caches,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            vocab_size=self.decoder_config.vocab_size,
            eos_token_ids=self.decoder_config.eos_token_ids,
            device=self.device,
            encoder_cache_tokens=self._encoder_cache_tokens(),
            model_dir=self.config.model,
        )

    def _encoder_cache_tokens(self) -> int:
        """Image features the worker can hold: --encoder-cache-bytes over one feature token's size."""
        if not isinstance(self.model_config, LlavaModelConfig):
            return 0
        token_bytes = self.model_config.text.hidden_size * torch.finfo(self.dtype).bits // 8
        return self.config.encoder_cache_bytes // token_bytes

    def _profile_num_blocks(self) -> int:
        """KV blocks that fit after a forward pass at the largest batch (CUDA only).

        budget = total * gpu_memory_fraction - peak memory of the profiling round (weights and
        activations, minus its own small cache) - memory held outside torch.
        """
        cfg, bs = self.config, self.config.block_size
        num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens))
        per_seq = max(1, min(cfg.max_num_batched_tokens // num_seqs, self.max_model_len))
        blocks_per_seq = -(-per_seq // bs)
        num_blocks = num_seqs * blocks_per_seq
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        runner = self._make_runner(
            allocate_kv_caches(self.decoder_config, num_blocks, bs, self.kv_cache_dtype, self.device,
                               head_major=self.backend.head_major_cache)
        )
        sampling = SamplingOptions(temperature=1.0, top_k=50, top_p=0.9)
        profile = ExecuteRound(
            round_id=0,
            new_requests=[
                NewRequestData(
                    f"profile-{i}",
                    [0] * per_seq,
                    per_seq,
                    0,
                    list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                    sampling,
                )
                for i in range(num_seqs)
            ],
            num_scheduled_tokens=[per_seq] * num_seqs,
        )
        runner.execute_round(profile, lambda step: step.wait())
        torch.cuda.synchronize(self.device)
        block_bytes = bytes_per_block(self.decoder_config, bs, self.dtype)
        peak = torch.cuda.max_memory_allocated(self.device) - num_blocks * block_bytes
        del runner
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * cfg.gpu_memory_fraction - peak - outside_torch)
        if isinstance(self.model_config, LlavaModelConfig):
            budget -= cfg.encoder_cache_bytes  # image features live beside the KV cache
        logger.info(
            "profiled peak %.2f GiB of %.2f GiB; KV budget %.2f GiB",
            peak / 2**30,
            total / 2**30,
            budget / 2**30,
        )
        return num_blocks_for_budget(self.decoder_config, bs, self.dtype, budget)
