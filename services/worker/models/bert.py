"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) for embeddings and cross-encoder scores.

Tokens arrive packed ([num_tokens, hidden], no padding) and stay packed through every layer:
linear layers, LayerNorm and GELU run on [num_tokens, hidden] rows, and attention is
bidirectional within each sequence with no KV cache (`EncoderAttention`: per-sequence views on
the CPU, so no padded copy exists; the configured backend elsewhere). q/k/v are fused into one
matmul; on the CPU the layers' GEMMs run on oneDNN-prepacked weights (`PrepackedLinear`).
Post-norm layers and exact (erf) GELU, as HF BERT.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from services.worker.attention import AttentionBackend, LayerAttentionSpec
from services.worker.attention.packed_encoder import EncoderAttention
from services.worker.models.base import SpindleModel, WeightTarget
from services.worker.models.encoder_config import EncoderConfig
from services.worker.models.prepacked_linear import PrepackedLinear
from shared.types import RequestKind

# HF module path inside encoder.layer.N -> spindle module inside layers.N
_LAYER_MODULES = {
    "attention.output.dense": "o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up_proj",
    "output.dense": "down_proj",
    "output.LayerNorm": "mlp_norm",
}
_QKV = {"query": 0, "key": 1, "value": 2}
_EMBEDDINGS = {
    "word_embeddings": "word_embeddings",
    "position_embeddings": "position_embeddings",
    "token_type_embeddings": "token_type_embeddings",
    "LayerNorm": "norm",
}
# Classification heads: BERT = pooler (dense + tanh) + classifier; RoBERTa = classifier.dense + out_proj.
_HEAD = {
    "pooler.dense": "classifier.dense",
    "classifier": "classifier.out_proj",
    "classifier.dense": "classifier.dense",
    "classifier.out_proj": "classifier.out_proj",
}
_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_OTHER = re.compile(r"^(.+)\.(weight|bias)$")


class EncoderEmbeddings(nn.Module):
    """word + token type + absolute position embeddings, then LayerNorm (HF order)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings + config.position_offset, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.position_offset = config.position_offset

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        return self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention and MLP, each followed by residual add and LayerNorm (post-norm)."""

    def __init__(self, config: EncoderConfig, attention: EncoderAttention) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.hidden_size = h
        self.qkv_proj = PrepackedLinear(h, 3 * h)
        self.o_proj = PrepackedLinear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.up_proj = PrepackedLinear(h, config.intermediate_size, gelu=True)  # GELU fused into the GEMM
        self.down_proj = PrepackedLinear(config.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=eps)
        heads, d = config.num_heads, config.head_dim
        self.spec = LayerAttentionSpec(heads, heads, d, d**-0.5)
        self.attention = attention

    def forward(self, x: torch.Tensor, meta: Any) -> torch.Tensor:
        # Under bf16 GEMM inputs, results that the next step would round again stay bf16: the qkv
        # projection's into the attention kernel (float32 inside, its output rounded as o_proj
        # would round it), the GELU output into down_proj. The same values, fewer passes.
        s = self.spec
        narrow_qkv = self.qkv_proj.bf16_inputs and self.attention.runs_kernel(meta)
        qkv = self.qkv_proj(x, widen=not narrow_qkv)
        q, k, v = (t.view(-1, s.num_heads, s.head_dim) for t in qkv.split(self.hidden_size, -1))
        attn = self.attention.forward(s, q, k, v, meta).reshape(-1, self.hidden_size)
        x = self.attn_norm(self.o_proj(attn) + x)
        return self.mlp_norm(self.down_proj(self.up_proj(x, widen=False)) + x)


class ClassificationHead(nn.Module):
    """dense + tanh + out_proj on the first token: BERT's pooler + classifier, RoBERTa's head."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_token)))


class EncoderModel(SpindleModel):
    """A bare encoder (HF `BertModel`, `XLMRobertaModel`): pooled hidden states are the embedding.

    Pooling itself (CLS / mean / last token) happens outside the model (`pooling.py`);
    `head` maps pooled vectors [num_reqs, hidden] to the output (identity here).
    """

    task = RequestKind.EMBED

    def __init__(self, config: EncoderConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attention = EncoderAttention(backend)  # the runner builds metadata through it too
        self.embeddings = EncoderEmbeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config, self.attention) for _ in range(config.num_layers))

    @property
    def pooled_size(self) -> int:
        return self.config.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] position inside each sequence, from 0
        token_type_ids: torch.Tensor,  # [num_tokens]
        meta: Any,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size]."""
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, meta)
        return x

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 outputs [num_reqs, pooled_size] from pooled hidden states."""
        return pooled.float()

    def map_weight(self, hf_name: str) -> WeightTarget | None:
        """HF names (with or without the `bert.`/`roberta.` prefix) -> spindle names; q/k/v fused."""
        name = hf_name.removeprefix(self.config.checkpoint_prefix)
        if match := _LAYER.match(name):
            layer, module, kind = match.groups()
            qkv = module.removeprefix("attention.self.")
            if qkv in _QKV:
                return f"layers.{layer}.qkv_proj.{kind}", _QKV[qkv] * self.config.hidden_size
            target = _LAYER_MODULES.get(module)
            return None if target is None else (f"layers.{layer}.{target}.{kind}", None)
        if (match := _OTHER.match(name)) is None:
            return None
        module, kind = match.groups()
        target = _EMBEDDINGS.get(module.removeprefix("embeddings.")) if module.startswith("embeddings.") else None
        target = f"embeddings.{target}" if target else _HEAD.get(module)
        return None if target is None else (f"{target}.{kind}", None)


class EncoderForSequenceClassification(EncoderModel):
    """A cross-encoder (HF `*ForSequenceClassification`): the output is the classifier's logits.

    HF classifies the first token ([CLS] / <s>), so the worker pools CLS for this class.
    """

    task = RequestKind.SCORE

    def __init__(self, config: EncoderConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.classifier = ClassificationHead(config)

    @property
    def pooled_size(self) -> int:
        return self.config.num_labels

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled.to(self.classifier.dense.weight.dtype)).float()
