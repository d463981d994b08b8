"""`EncoderConfig`: the shape of a BERT-family encoder checkpoint, parsed from its HF config.json.

One parser per family (BERT; RoBERTa and XLM-RoBERTa share one) says where positions start and
which head names the checkpoint uses. Anything the encoder cannot run exactly (relative position
embeddings, another activation, a decoder/cross-attention setup) is rejected with a ValueError
naming the field, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class EncoderConfig:
    """What the encoder implementation needs; HF names translated once.

    `max_position_embeddings` counts the positions a sequence can actually use: RoBERTa-style
    models start their position ids at `padding_idx + 1`, so they lose that many table rows.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    layer_norm_eps: float
    max_position_embeddings: int  # usable positions (table rows minus position_offset)
    position_offset: int  # position id of a sequence's first token (0 BERT, padding_idx + 1 RoBERTa)
    type_vocab_size: int
    num_labels: int  # classifier outputs (sequence classification); 0 for a bare encoder
    checkpoint_prefix: str  # "bert." / "roberta.": how HF names the trunk inside task models


def _num_labels(hf: dict[str, Any]) -> int:
    """HF derives num_labels from id2label (saved) and falls back to 2 (PretrainedConfig default)."""
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def _base(hf: dict[str, Any], architecture: str, position_offset: int, prefix: str) -> EncoderConfig:
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"unsupported hidden_act={act!r}; only 'gelu' (exact erf GELU)")
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"unsupported position_embedding_type={kind!r}; only 'absolute'")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ValueError("is_decoder/add_cross_attention encoders are not supported; only bidirectional encoders")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    table = int(hf.get("max_position_embeddings", 512))
    if table <= position_offset:
        raise ValueError(f"max_position_embeddings={table} leaves no positions after offset {position_offset}")
    return EncoderConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        head_dim=hidden // heads,
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        max_position_embeddings=table - position_offset,
        position_offset=position_offset,
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        num_labels=_num_labels(hf) if architecture.endswith("ForSequenceClassification") else 0,
        checkpoint_prefix=prefix,
    )


def _architecture(hf: dict[str, Any]) -> str:
    return (hf.get("architectures") or [""])[0]


def bert_config(hf: dict[str, Any]) -> EncoderConfig:
    return _base(hf, _architecture(hf), 0, "bert.")


def roberta_config(hf: dict[str, Any]) -> EncoderConfig:
    """RoBERTa and XLM-RoBERTa: positions start after the padding index (HF create_position_ids)."""
    return _base(hf, _architecture(hf), int(hf.get("pad_token_id", 1)) + 1, "roberta.")
