"""Prefill-only models against their oracles: MiniLM vs sentence-transformers, cross-encoders and
(XLM-)RoBERTa vs transformers, all through the pooling runner in packed rounds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    RobertaConfig,
    XLMRobertaConfig,
)

from services.worker.config import WorkerConfig
from services.worker.kernels.build import cpu_has_native_bf16
from services.worker.models.prepacked_linear import PrepackedLinear
from services.worker.step_output import PooledStep
from services.worker.worker import Worker
from shared.execute import ExecuteRound, PoolingRequestData, StepOutput
from shared.types import RequestKind

WORDS = (
    "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs,", "while", "spindle", "serves",
    "embeddings", "for", "every", "request.", "Attention", "is", "bidirectional", "inside", "each",
    "sequence;", "packed", "without", "padding", "tokens!", "café", "Zürich", "42", "unbelievably",
)


def _sentences(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths: one word up to ~70 words, so batches mix very short and long sequences."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 5, 12, 30, 70]))) for _ in range(n)]


def _worker(model_dir: Path, backend: str = "sdpa", encoder_matmul: str = "float32") -> Worker:
    """float32 GEMMs unless asked: the oracle tolerances below are float32's (bf16 inputs: their own test)."""
    return Worker(WorkerConfig(model=str(model_dir), attention_backend=backend, num_threads=2,
                               encoder_matmul=encoder_matmul))


def _run(worker: Worker, round_: ExecuteRound) -> list[StepOutput]:
    steps: list[PooledStep] = []
    worker.runner.execute_round(round_, steps.append)
    return [s.to_step_output() for s in steps]


def _pool(worker: Worker, kind: RequestKind, encoded: dict, per_round: int, normalize: bool = False) -> torch.Tensor:
    """Pooled outputs of every encoded input, `per_round` requests per packed round, in input order."""
    requests = [
        PoolingRequestData(f"r{i}", kind, ids, types, normalize)
        for i, (ids, types) in enumerate(zip(encoded["input_ids"], encoded["token_type_ids"], strict=True))
    ]
    pooled: dict[str, list[float]] = {}
    for round_id, start in enumerate(range(0, len(requests), per_round)):
        steps = _run(worker, ExecuteRound(round_id, pooling_requests=requests[start : start + per_round]))
        assert len(steps) == 1 and steps[0].is_last_step and steps[0].request_ids == []
        pooled |= steps[0].pooled
    assert list(pooled) == [r.request_id for r in requests]
    return torch.tensor(list(pooled.values()))


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(encoded sentences, ST encode output, ST output without its Normalize module)."""
    sentences = _sentences(40)
    encoded = AutoTokenizer.from_pretrained(minilm_dir)(sentences)
    st = SentenceTransformer(str(minilm_dir), device="cpu")
    reference = st.encode(sentences, convert_to_tensor=True)
    raw = SentenceTransformer(modules=[st[0], st[1]], device="cpu").encode(sentences, convert_to_tensor=True)
    return encoded, reference, raw


@pytest.mark.parametrize("backend", ["paged", "sdpa", "naive"])
def test_minilm_embeddings_match_sentence_transformers(
    minilm_dir: Path, minilm_reference: tuple[dict, torch.Tensor, torch.Tensor], backend: str
) -> None:
    encoded, reference, raw = minilm_reference
    worker = _worker(minilm_dir, backend)
    ours = _pool(worker, RequestKind.EMBED, encoded, per_round=20)  # two packed rounds
    cosine = torch.nn.functional.cosine_similarity(ours, reference)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(ours, raw, atol=1e-4, rtol=1e-4)  # raw: mean pooling, not normalised
    normalized = _pool(worker, RequestKind.EMBED, encoded, per_round=40, normalize=True)
    torch.testing.assert_close(normalized, reference, atol=2e-5, rtol=0)  # ST's pipeline ends in Normalize


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="without bf16 math a bf16 GEMM is emulated (slow)")
def test_minilm_bf16_matmul_stays_within_cosine_of_sentence_transformers(
    minilm_dir: Path, minilm_reference: tuple[dict, torch.Tensor, torch.Tensor]
) -> None:
    """auto on this CPU: bf16 GEMM inputs, float32 elsewhere; vectors within the embedding oracle."""
    encoded, reference, raw = minilm_reference
    worker = _worker(minilm_dir, "paged", encoder_matmul="auto")
    layers = [m for m in worker.model.modules() if isinstance(m, PrepackedLinear)]
    assert layers and all(m.bf16_inputs for m in layers)
    ours = _pool(worker, RequestKind.EMBED, encoded, per_round=20)
    cosine = torch.nn.functional.cosine_similarity(ours, reference)
    assert cosine.min() >= 0.9999, cosine
    assert not torch.equal(ours, raw), "the bf16 GEMMs ran: float32 would match to the last bits"
    torch.testing.assert_close(ours, raw, atol=2e-2, rtol=2e-2)


def test_cross_encoder_logits_match_transformers(cross_encoder_dir: Path) -> None:
    rng = random.Random(1)
    pairs = [(" ".join(_sentences(1, i)), " ".join(_sentences(1, 100 + i))) for i in range(12)]
    rng.shuffle(pairs)
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder_dir)
    encoded = tokenizer([q for q, _ in pairs], [d for _, d in pairs])
    assert any(1 in types for types in encoded["token_type_ids"])  # the pair template sets segment B
    worker = _worker(cross_encoder_dir)
    ours = _pool(worker, RequestKind.SCORE, encoded, per_round=7)
    hf = AutoModelForSequenceClassification.from_pretrained(cross_encoder_dir, dtype=torch.float32).eval()
    batch = tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = hf(**batch).logits
    assert ours.shape == (12, 1)
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=1e-4)  # raw logits: one per label
    torch.testing.assert_close(torch.sigmoid(ours), torch.sigmoid(logits), atol=1e-4, rtol=0)


def _tiny_roberta(root: Path, config_cls: type[PretrainedConfig], num_labels: int) -> tuple[Path, Path]:
    """Random (XLM-)RoBERTa base model and sequence classifier sharing one tiny config."""
    config = config_cls(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=34,  # 32 usable positions after padding_idx + 1
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=num_labels,
    )
    torch.manual_seed(3)
    dirs = []
    for name, auto in (("base", AutoModel), ("classifier", AutoModelForSequenceClassification)):
        model = auto.from_config(config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "LayerNorm" not in param_name:
                    param.normal_(0.0, 0.2)
        model.save_pretrained(root / name)
        dirs.append(root / name)
    return dirs[0], dirs[1]


@pytest.mark.parametrize("config_cls", [XLMRobertaConfig, RobertaConfig])
def test_roberta_family_matches_transformers(tmp_path: Path, config_cls: type[PretrainedConfig]) -> None:
    base_dir, classifier_dir = _tiny_roberta(tmp_path, config_cls, num_labels=3)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, 120, (n,), generator=gen) for n in (32, 1, 9, 17)]  # 32 = every position
    encoded = {"input_ids": [t.tolist() for t in inputs], "token_type_ids": [[] for _ in inputs]}
    for model_dir, auto, kind in (
        (base_dir, AutoModel, RequestKind.EMBED),
        (classifier_dir, AutoModelForSequenceClassification, RequestKind.SCORE),
    ):
        worker = _worker(model_dir)
        assert worker.info.max_model_len == 32
        ours = _pool(worker, kind, encoded, per_round=4)
        hf = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            outputs = [hf(ids[None]) for ids in inputs]
        # Without sentence-transformers files a bare encoder pools CLS (the <s> token).
        expected = torch.cat(
            [o.last_hidden_state[:, 0] if kind is RequestKind.EMBED else o.logits for o in outputs]
        )
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
