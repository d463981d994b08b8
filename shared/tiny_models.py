"""Build small random-initialised checkpoints and a tokenizer locally: no downloads.

Used by the tests (the transformers oracle loads the same directory), by `make run` (the
demo model) and by the benchmarks. Everything is derived from a fixed seed, so two builds
of the same spec are identical. Weights are drawn with a large standard deviation so the
greedy token wins by a clear margin and no test is decided by float rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Mixed scripts so byte-level BPE learns multi-byte merges and splits others across tokens.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "spindle serves language models as three services: frontend, scheduler and worker",
    "a paged key value cache holds blocks of sixteen tokens each",
    "café naïve résumé über straße déjà vu",
    "数据 模型 服务 调度 缓存 令牌",
    "emoji 🙂 🚀 🧵 and symbols ∑ ∫ √ ≈ ≠",
    "hello world, hello spindle; how are you today?",
    "0123456789 + - * / = ( ) [ ] { } < > # @ & %",
]

def _training_corpus(vocab_size: int) -> list[str]:
    """The fixed sentences plus seeded random words, enough for BPE to fill `vocab_size`."""
    import random

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(vocab_size * 6)]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return _CORPUS * 4 + lines


SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of a random decoder checkpoint."""

    family: str = "llama"  # llama | mistral | qwen2
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    sliding_window: int | None = None  # mistral only
    init_std: float = 0.2
    seed: int = 0


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE tokenizer on a fixed corpus and save it with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(vocab_size), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size)
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=False,
        initializer_range=spec.init_std,
    )
    configs = {
        "llama": lambda: LlamaConfig(**common, rope_theta=10000.0),
        "mistral": lambda: MistralConfig(**common, sliding_window=spec.sliding_window, rope_theta=10000.0),
        "qwen2": lambda: Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False),
    }
    if spec.family not in configs:
        raise ValueError(f"unknown family {spec.family!r}; expected one of {sorted(configs)}")
    config = configs[spec.family]()
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            if name.endswith("bias"):
                param.normal_(0.0, spec.init_std)
            else:
                param.normal_(0.0, spec.init_std)
    model.generation_config.bos_token_id = 0
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 3
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "spindle_tiny_spec.json").write_text(json.dumps(spec.__dict__ if hasattr(spec, "__dict__") else
                                                           {f: getattr(spec, f) for f in spec.__slots__}))
    return out


BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_wordpiece_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> None:
    """Train an uncased WordPiece tokenizer (BERT style, with pair template) on the fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(_training_corpus(vocab_size), trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                             cls_token="[CLS]", mask_token="[MASK]", model_max_length=512)
    fast.save_pretrained(str(out_dir))


def build_cross_encoder(out_dir: str | Path, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                        num_labels: int = 1) -> Path:
    """A random-initialised `BertForSequenceClassification` (a cross-encoder) with its tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_wordpiece_tokenizer(out)
    config = BertConfig(vocab_size=1024, hidden_size=hidden_size, num_hidden_layers=num_layers,
                        num_attention_heads=4, intermediate_size=hidden_size * 4, max_position_embeddings=512,
                        num_labels=num_labels, pad_token_id=0)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    return out
