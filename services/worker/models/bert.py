"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) for embeddings and cross-encoder scores.

Tokens arrive packed ([num_tokens, hidden], no padding) and stay packed through every layer:
linear layers, LayerNorm and GELU run on [num_tokens, hidden] rows, and attention is
bidirectional within each sequence with no KV cache (`EncoderAttention`: per-sequence views on
the CPU, so no padded copy exists; the configured backend elsewhere). q/k/v are fused into one
matmul; on the CPU the layers' GEMMs run on oneDNN-prepacked weights (`PrepackedLinear`).
Post-norm layers and exact (erf) GELU, as HF BERT.

On the CPU each residual add + LayerNorm of a float32 residual stream is one kernel pass
(`EncoderNorm`), which under bf16 GEMM inputs also writes the bf16 copy the next GEMM reads, and
the layer hands bf16 results straight on wherever the next step would round them again. Against
the layer of separate torch ops (widen, add, norm, round): all-MiniLM-L6-v2, worker round in
process, old and new in turn, 2-core AMD EPYC Zen 4: one sentence of 3 / 32 / 116 tokens 5.18 /
5.26 / 14.57 -> 4.51 / 4.65 / 13.59 ms (1.15 / 1.13 / 1.07x), 32 sentences of 12-250 tokens
1.02x; vectors within cosine 0.99999 of the separate ops (the variance sums in another order).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionBackend, LayerAttentionSpec
from services.worker.attention.packed_encoder import EncoderAttention, PackedEncoderMetadata
from services.worker.models.base import SpindleModel, WeightTarget
from services.worker.models.encoder_config import EncoderConfig
from services.worker.models.fused import KERNEL_DTYPES, fused_kernels_enabled
from services.worker.models.prepacked_linear import PrepackedLinear, gemm_rows
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


class EncoderNorm(nn.LayerNorm):
    """The LayerNorm after a residual add (post-norm). With spindle's CPU kernels (`fused`) the add,
    the norm and the bf16 copy that the next GEMM reads under bf16 GEMM inputs are one pass
    (`spindle::add_layer_norm`) rather than four ops: widen, add, norm, round."""

    fused = False  # set by EncoderModel.use_fused_kernels

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    narrow: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LayerNorm(x + residual), that rounded to bf16 where `narrow`, else None); x is a GEMM's
        output (bf16 under bf16 GEMM inputs: widened first), residual the layer's input."""
        if self.fused and residual.dtype == torch.float32 == self.weight.dtype and x.dtype in KERNEL_DTYPES:
            out = torch.ops.spindle.add_layer_norm(x, residual, self.weight, self.bias, self.eps, narrow)
            return out[0], out[1] if narrow else None
        y = F.layer_norm(x.to(residual.dtype) + residual, self.normalized_shape, self.weight, self.bias, self.eps)
        return y, y.to(torch.bfloat16) if narrow else None


class EncoderLayer(nn.Module):
    """Self-attention and MLP, each followed by residual add and LayerNorm (post-norm)."""

    def __init__(self, config: EncoderConfig, attention: EncoderAttention) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.hidden_size = h
        self.qkv_proj = PrepackedLinear(h, 3 * h)
        self.o_proj = PrepackedLinear(h, h)
        self.attn_norm = EncoderNorm(h, eps=eps)
        self.up_proj = PrepackedLinear(h, config.intermediate_size, gelu=True)  # GELU fused into the GEMM
        self.down_proj = PrepackedLinear(config.intermediate_size, h)
        self.mlp_norm = EncoderNorm(h, eps=eps)
        heads, d = config.num_heads, config.head_dim
        self.spec = LayerAttentionSpec(heads, heads, d, d**-0.5)
        self.attention = attention

    def forward(self, x: torch.Tensor, x16: torch.Tensor | None,
                meta: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the layer's output, and under bf16 GEMM inputs that output rounded to bf16, else None);
        `x16` is the input so rounded, where the layer before made it.

        Under bf16 GEMM inputs, results that the next step would round again stay bf16: the qkv
        projection's into the attention kernel (float32 inside, its output rounded as o_proj
        would round it), the projections' outputs into the add & norm (widened there), the GELU
        output into down_proj, and each norm's bf16 copy into the next GEMM. The same values,
        fewer passes.
        """
        s = self.spec
        narrow = self.qkv_proj.bf16_inputs
        narrow_qkv = narrow and self.attention.runs_kernel(meta)
        qkv = self.qkv_proj(x if x16 is None else x16, widen=not narrow_qkv)
        q, k, v = qkv.view(-1, 3, s.num_heads, s.head_dim).unbind(1)
        attn = self.attention.forward(s, q, k, v, meta).reshape(-1, self.hidden_size)
        x, x16 = self.attn_norm.add_forward(self.o_proj(attn, widen=False), x, narrow)
        up = self.up_proj(x if x16 is None else x16, widen=False)
        return self.mlp_norm.add_forward(self.down_proj(up, widen=False), x, narrow)


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

    def post_init(self) -> None:
        self.use_fused_kernels(fused_kernels_enabled(self.embeddings.word_embeddings.weight.device))

    def use_fused_kernels(self, enabled: bool) -> None:
        """Route the layers' residual add + LayerNorm through spindle's kernel (CPU, float32 residual)."""
        for module in self.modules():
            if isinstance(module, EncoderNorm):
                module.fused = enabled

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] position inside each sequence, from 0
        token_type_ids: torch.Tensor,  # [num_tokens]
        meta: Any,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size].

        A packed CPU batch runs padded to its GEMMs' row bucket (`gemm_rows`): zero rows (token 0
        at position 0) appended here once, which attention leaves out and zeroes, rather than each
        GEMM padding its input and cutting its output again, 24 copies a pass for MiniLM (0.5 ms
        of a 12 ms one-sentence pass)."""
        num_tokens = input_ids.shape[0]
        padding = gemm_rows(num_tokens) - num_tokens if isinstance(meta, PackedEncoderMetadata) else 0
        if padding:
            inputs = (input_ids, positions, token_type_ids)
            input_ids, positions, token_type_ids = (F.pad(t, (0, padding)) for t in inputs)
        x, x16 = self.embeddings(input_ids, positions, token_type_ids), None
        for layer in self.layers:
            x, x16 = layer(x, x16, meta)
        return x[:num_tokens]

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
