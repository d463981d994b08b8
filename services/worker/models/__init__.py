"""Model registry: HF architecture name -> spindle model class and config parser (lazy imports),
and reading a checkpoint's config.json (no torch here).

Every decoder family shares `DecoderForCausalLM`; the entry's parser turns the family's HF
config into the flags that make the difference (qkv bias, q/k norms, sliding windows, RoPE
scaling, Gemma's norms and soft-capping). BERT-family
encoders share `EncoderModel` (embeddings) and `EncoderForSequenceClassification` (scores).
The model class's `task` decides what the worker serves.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# architecture -> ("module:model class", "module:config parser")
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": (
        "services.worker.models.decoder:DecoderForCausalLM",
        "services.worker.models.config:llama_config",
    ),
    "MistralForCausalLM": (
        "services.worker.models.decoder:DecoderForCausalLM",
        "services.worker.models.config:mistral_config",
    ),
    "Qwen2ForCausalLM": (
        "services.worker.models.decoder:DecoderForCausalLM",
        "services.worker.models.config:qwen2_config",
    ),
    "Qwen3ForCausalLM": (
        "services.worker.models.decoder:DecoderForCausalLM",
        "services.worker.models.config:qwen3_config",
    ),
    "Phi3ForCausalLM": (
        "services.worker.models.decoder:DecoderForCausalLM",
        "services.worker.models.config:phi3_config",
    ),
    "Gemma2ForCausalLM": (
        "services.worker.models.decoder:DecoderForCausalLM",
        "services.worker.models.config:gemma2_config",
    ),
    "LlavaForConditionalGeneration": (
        "services.worker.models.llava:LlavaForConditionalGeneration",
        "services.worker.models.llava:llava_config",
    ),
    "BertModel": (
        "services.worker.models.bert:EncoderModel",
        "services.worker.models.encoder_config:bert_config",
    ),
    "BertForSequenceClassification": (
        "services.worker.models.bert:EncoderForSequenceClassification",
        "services.worker.models.encoder_config:bert_config",
    ),
    "RobertaModel": (
        "services.worker.models.bert:EncoderModel",
        "services.worker.models.encoder_config:roberta_config",
    ),
    "RobertaForSequenceClassification": (
        "services.worker.models.bert:EncoderForSequenceClassification",
        "services.worker.models.encoder_config:roberta_config",
    ),
    "XLMRobertaModel": (
        "services.worker.models.bert:EncoderModel",
        "services.worker.models.encoder_config:roberta_config",
    ),
    "XLMRobertaForSequenceClassification": (
        "services.worker.models.bert:EncoderForSequenceClassification",
        "services.worker.models.encoder_config:roberta_config",
    ),
}

# The classes that serve prefill-only requests (embeddings, scores): no decode steps follow.
PREFILL_ONLY_CLASSES = frozenset({
    "services.worker.models.bert:EncoderModel",
    "services.worker.models.bert:EncoderForSequenceClassification",
})

# A sentence-transformers directory runs the bare encoder whatever head config.json names.
SENTENCE_TRANSFORMERS_BASES: dict[str, str] = {
    "BertForMaskedLM": "BertModel",
    "BertForPreTraining": "BertModel",
    "RobertaForMaskedLM": "RobertaModel",
    "XLMRobertaForMaskedLM": "XLMRobertaModel",
}


def _import(path: str) -> Any:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def resolve_model(architecture: str) -> tuple[type, str, Callable[[dict], Any]]:
    """(model class, architecture, HF-config parser) for a registered architecture."""
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    model_path, parser_path = MODEL_REGISTRY[architecture]
    return _import(model_path), architecture, _import(parser_path)


def is_prefill_only(architecture: str) -> bool:
    """Whether an architecture is registered and serves embeddings or scores, told without importing
    torch (the worker decides OpenMP's wait policy from it before torch loads: openmp_wait.py)."""
    entry = MODEL_REGISTRY.get(architecture)
    return entry is not None and entry[0] in PREFILL_ONLY_CLASSES


def read_hf_config(model_dir: str | Path) -> dict:
    """config.json, with generation_config's EOS and the sentence-transformers base architecture.

    A sentence-transformers directory (modules.json) runs its Transformer module as the bare
    encoder, whatever head config.json names (e.g. BertForMaskedLM -> BertModel), as ST does.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
    hf = json.loads(path.read_text())
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file() and "eos_token_id" in (gen_cfg := json.loads(gen.read_text())):
        hf["eos_token_id"] = gen_cfg["eos_token_id"]  # generation config wins, as in HF generate
    architectures = hf.get("architectures") or []
    if (Path(model_dir) / "modules.json").is_file() and architectures:
        hf["architectures"] = [SENTENCE_TRANSFORMERS_BASES.get(architectures[0], architectures[0])]
    return hf
