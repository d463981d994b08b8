"""Model registry, HF config parsing and weight loading (logits equal transformers exactly in float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from worker_harness import prefill_logits

from services.worker.attention import create_backend
from services.worker.models import MODEL_REGISTRY
from services.worker.models.config import mistral_config, qwen2_config
from services.worker.models.loader import load_model, parse_config, read_hf_config


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_logits_equal_transformers(tiny_models: dict[str, Path], family: str) -> None:
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))  # > mistral's window 16
    ours = prefill_logits(tiny_models[family], ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    with torch.inference_mode():
        reference = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_tied_word_embeddings_load_from_embed_tokens(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(tmp_path)
    ids = torch.arange(10)
    ours = prefill_logits(tmp_path, ids)
    with torch.inference_mode():
        torch.testing.assert_close(ours, hf(ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_a_clear_error(llama_dir: Path) -> None:
    hf = read_hf_config(llama_dir) | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: Bert"):
        parse_config(hf)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} < set(MODEL_REGISTRY)


@pytest.mark.parametrize(
    "override",
    [
        {"rope_scaling": {"rope_type": "proportional", "factor": 8.0}},
        {"rope_parameters": {"rope_type": "xpos", "rope_theta": 10000.0}},
    ],
)
def test_unknown_rope_scaling_is_rejected(llama_dir: Path, override: dict) -> None:
    with pytest.raises(ValueError, match="unsupported rope scaling '(proportional|xpos)'.*supported: default"):
        parse_config(read_hf_config(llama_dir) | override)


def test_missing_weights_are_an_error(tmp_path: Path, llama_dir: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(read_hf_config(llama_dir)))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path, create_backend("sdpa", 16), torch.float32, torch.device("cpu"))


def test_sliding_window_per_layer_follows_hf_rules(tiny_models: dict[str, Path]) -> None:
    mistral = read_hf_config(tiny_models["mistral"])
    assert mistral_config(mistral).sliding_windows == (16, 16)
    qwen = read_hf_config(tiny_models["qwen2"])
    assert qwen2_config(qwen | {"sliding_window": 8}).sliding_windows == (
        None,
        None,
    )  # use_sliding_window off
    qwen_on = {k: v for k, v in qwen.items() if k != "layer_types"}
    qwen_on |= {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    assert qwen2_config(qwen_on).sliding_windows == (None, 8)


def test_cross_encoder_config_over_a_bare_encoder_checkpoint_lacks_its_classifier(
    tmp_path: Path, minilm_dir: Path
) -> None:
    """MiniLM has a pooler (-> classifier.dense) but no classifier: loading must fail, not randomise."""
    (tmp_path / "model.safetensors").symlink_to(minilm_dir / "model.safetensors")
    hf = read_hf_config(minilm_dir) | {"architectures": ["BertForSequenceClassification"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    missing = r"lacks weights for \['classifier.out_proj.bias', 'classifier.out_proj.weight'\]"
    with pytest.raises(ValueError, match=missing):
        load_model(tmp_path, create_backend("sdpa", 16), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"position_embedding_type": "relative_key"}, "unsupported position_embedding_type='relative_key'"),
        ({"hidden_act": "gelu_new"}, "unsupported hidden_act='gelu_new'"),
        ({"is_decoder": True}, "only bidirectional encoders"),
    ],
)
def test_unsupported_encoder_configs_are_rejected(minilm_dir: Path, override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(read_hf_config(minilm_dir) | override)


def test_weight_dtype_is_bf16_under_float32_on_cpu_only() -> None:
    from services.worker.worker import resolve_weight_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_weight_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_weight_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16  # the same as dtype
    for name, dtype, device in (("bfloat16", torch.float32, cuda), ("float32", torch.bfloat16, cpu)):
        with pytest.raises(ValueError, match="only bfloat16 weights under float32 activations on a CPU"):
            resolve_weight_dtype(name, dtype, device)


@pytest.mark.parametrize(("flags", "native"), [("fpu sse2 avx2 fma f16c", False), ("avx2 avx512f avx512_bf16", True),
                                              ("avx512f amx_tile amx_bf16", True), ("fp asimd bf16 i8mm", True)])
def test_bf16_activations_on_a_cpu_without_bf16_math_warn(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture, flags: str,
                                                          native: bool) -> None:
    """--dtype bfloat16 runs anywhere, but without bf16 dot products its GEMMs crawl: the log says so."""
    from services.worker import worker
    from services.worker.kernels import build

    monkeypatch.setattr(build, "_cpu_features", lambda: flags)
    assert build.cpu_has_native_bf16() is native
    with caplog.at_level("WARNING", logger=worker.__name__):
        worker._warn_without_native_bf16(torch.float32, torch.device("cpu"))
        worker._warn_without_native_bf16(torch.bfloat16, torch.device("cuda"))
        assert not caplog.records
        worker._warn_without_native_bf16(torch.bfloat16, torch.device("cpu"))
    assert (not native) == any("--weight-dtype bfloat16" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("native", [False, True])
def test_encoder_matmul_is_bf16_by_default_only_for_embeddings_on_a_cpu_with_bf16_math(
        monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    from services.worker.kernels import build
    from services.worker.worker import resolve_encoder_matmul
    from shared.types import RequestKind

    monkeypatch.setattr(build, "_cpu_features", lambda: "avx2 avx512_bf16" if native else "avx2 fma")
    cpu, cuda, f32, bf16 = torch.device("cpu"), torch.device("cuda"), torch.float32, torch.bfloat16
    auto_embed = bf16 if native else f32
    assert resolve_encoder_matmul("auto", RequestKind.EMBED, f32, cpu) == auto_embed
    assert resolve_encoder_matmul("auto", RequestKind.SCORE, f32, cpu) == f32  # scores are read as numbers
    assert resolve_encoder_matmul("float32", RequestKind.EMBED, f32, cpu) == f32
    assert resolve_encoder_matmul("bfloat16", RequestKind.SCORE, f32, cpu) == bf16  # asked: anywhere (slow without)
    assert resolve_encoder_matmul("auto", RequestKind.EMBED, bf16, cpu) == bf16  # the activations' dtype already
    assert resolve_encoder_matmul("auto", RequestKind.EMBED, f32, cuda) == f32
    assert resolve_encoder_matmul("auto", RequestKind.GENERATE, f32, cpu) == f32
    for name, task, dtype, device in (("bfloat16", RequestKind.GENERATE, f32, cpu),
                                      ("float32", RequestKind.GENERATE, f32, cpu),
                                      ("bfloat16", RequestKind.EMBED, bf16, cpu),
                                      ("bfloat16", RequestKind.EMBED, f32, cuda)):
        with pytest.raises(ValueError, match="encoder_matmul"):
            resolve_encoder_matmul(name, task, dtype, device)


def test_kv_cache_dtype_is_16_bit_under_float32_with_paged_attention_only() -> None:
    from services.worker.worker import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", torch.float32, "sdpa") == torch.float32
    assert resolve_kv_cache_dtype("float32", torch.float32, "naive") == torch.float32  # the same as dtype
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "paged") == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, "paged") == torch.float16
    for name, dtype, backend in (("bfloat16", torch.float32, "sdpa"), ("float16", torch.float32, "naive"),
                                 ("float32", torch.bfloat16, "paged"), ("bfloat16", torch.float16, "flash-attn")):
        with pytest.raises(ValueError, match="only a bfloat16 or float16 cache under float32 activations"):
            resolve_kv_cache_dtype(name, dtype, backend)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_holds_twice_the_blocks(tiny_models: dict[str, Path], kv_cache_dtype: str) -> None:
    from services.worker.config import WorkerConfig
    from services.worker.worker import Worker

    def worker(name: str) -> Worker:
        return Worker(WorkerConfig(model=str(tiny_models["llama"]), attention_backend="paged", kv_cache_dtype=name,
                                   kv_cache_bytes=8 << 20, num_threads=2))

    wide, narrow = worker("auto"), worker(kv_cache_dtype)
    assert narrow.info.num_kv_blocks == 2 * wide.info.num_kv_blocks
    assert {c.dtype for c in narrow.runner.kv_caches} == {getattr(torch, kv_cache_dtype)}
    assert {c.dtype for c in wide.runner.kv_caches} == {torch.float32}


def test_kv_cache_dtype_is_refused_for_models_without_a_kv_cache(minilm_dir: Path) -> None:
    from services.worker.config import WorkerConfig
    from services.worker.worker import Worker

    with pytest.raises(ValueError, match="kv_cache_dtype applies to decoder models"):
        Worker(WorkerConfig(model=str(minilm_dir), attention_backend="paged", kv_cache_dtype="bfloat16"))


def test_bf16_weights_load_into_linear_layers_only(tiny_models: dict[str, Path]) -> None:
    backend = create_backend("sdpa", 16)
    model = load_model(tiny_models["llama"], backend, torch.float32, torch.device("cpu"), torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    linear = {n for n in dtypes if n.endswith(("proj.weight", "lm_head.weight"))}
    assert linear and all(dtypes[n] == torch.bfloat16 for n in linear)
    assert all(dtypes[n] == torch.float32 for n in set(dtypes) - linear), "norms and embeddings stay float32"
