"""Benchmark workloads as plain data: lists of (prompt token ids, max_tokens), built from a seed.

Prompts are token ids, not text, so every server and the in-process limit see exactly the same
input, and output lengths are exact because requests are sent greedy with `ignore_eos`. The
embedding benchmark's input is text instead (`english_like_sentences`), since tokenizing is part
of the work it measures. Nothing here talks to a server or loads a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Ids 0..3 are <s>, </s>, <unk>, <pad> in shared/tiny_models; random prompts stay clear of them.
FIRST_ORDINARY_TOKEN_ID = 4
DEFAULT_VOCAB_HIGH = 8192  # the benchmark models' vocab size
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: what to send and how many tokens must come back."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Everything that determines a workload; two equal specs give identical requests.

    Attributes:
        kind: a key of WORKLOADS ("random", "sharegpt-like" or "shared-prefix").
        num_requests: how many requests.
        input_len: prompt length (random), median prompt length (sharegpt-like) or the length of
            each request's own suffix after the shared prefix (shared-prefix).
        output_len: max_tokens (random) or median output length (sharegpt-like).
        range_ratio: random only; lengths are drawn uniformly from [len*(1-r), len*(1+r)], 0 = fixed.
        vocab_low: smallest token id used in prompts.
        vocab_high: one past the largest token id used in prompts (the model's vocab size).
        max_model_len: sharegpt-like only; prompt + output is clipped to fit.
        seed: seeds prompts and lengths.
        prefix_len: shared-prefix only; tokens every prompt starts with (a shared system prompt).
    """

    kind: str = "random"
    num_requests: int = 128
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    vocab_low: int = FIRST_ORDINARY_TOKEN_ID
    vocab_high: int = DEFAULT_VOCAB_HIGH
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    seed: int = 0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"kind={self.kind!r} is not one of {sorted(WORKLOADS)}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests} must be at least 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len={self.input_len} and output_len={self.output_len} must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio={self.range_ratio} must be in [0, 1)")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(f"vocab_low={self.vocab_low} must be below vocab_high={self.vocab_high}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be at least 2")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len={self.prefix_len} must not be negative")


def _random_prompts(rng: np.random.Generator, spec: WorkloadSpec, lengths: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(t) for t in rng.integers(spec.vocab_low, spec.vocab_high, size=int(n))) for n in lengths]


def _uniform_lengths(rng: np.random.Generator, center: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, int(center * (1.0 - ratio)))
    high = max(low, int(center * (1.0 + ratio)))
    return rng.integers(low, high + 1, size=n)


def random_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """Uniform random prompt ids; fixed lengths when range_ratio is 0 (the yardstick workload)."""
    rng = np.random.default_rng(spec.seed)
    input_lens = _uniform_lengths(rng, spec.input_len, spec.range_ratio, spec.num_requests)
    output_lens = _uniform_lengths(rng, spec.output_len, spec.range_ratio, spec.num_requests)
    prompts = _random_prompts(rng, spec, input_lens)
    return [BenchRequest(p, int(o)) for p, o in zip(prompts, output_lens, strict=True)]


# Log-normal shape parameters (sigma of log length) roughly matching ShareGPT conversations as
# tokenised by Llama tokenizers: prompts spread wider than answers. Medians come from the spec.
SHAREGPT_PROMPT_SIGMA = 1.1
SHAREGPT_OUTPUT_SIGMA = 0.8


def sharegpt_like_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """Synthetic ShareGPT-like lengths: seeded log-normal prompt/output lengths, random ids, no download.

    input_len and output_len are the medians. Each pair is clipped so prompt + output fits in
    max_model_len, with at least one token on each side.
    """
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    input_lens = np.rint(rng.lognormal(np.log(spec.input_len), SHAREGPT_PROMPT_SIGMA, size=n)).astype(np.int64)
    output_lens = np.rint(rng.lognormal(np.log(spec.output_len), SHAREGPT_OUTPUT_SIGMA, size=n)).astype(np.int64)
    input_lens = np.clip(input_lens, 1, spec.max_model_len - 1)
    output_lens = np.clip(output_lens, 1, spec.max_model_len - input_lens)
    prompts = _random_prompts(rng, spec, input_lens)
    return [BenchRequest(p, int(o)) for p, o in zip(prompts, output_lens, strict=True)]


def shared_prefix_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """One seeded prefix of `prefix_len` ids shared by every prompt, then `input_len` ids of its own.

    The prefix-cache workload: a common system prompt, unique user turns. Suffixes are drawn
    independently per request, so no two prompts share more than the prefix (bar chance).
    """
    rng = np.random.default_rng(spec.seed)
    prefix = tuple(int(t) for t in rng.integers(spec.vocab_low, spec.vocab_high, size=spec.prefix_len))
    suffixes = _random_prompts(rng, spec, np.full(spec.num_requests, spec.input_len))
    return [BenchRequest(prefix + suffix, spec.output_len) for suffix in suffixes]


WORKLOADS: dict[str, Callable[[WorkloadSpec], list[BenchRequest]]] = {
    "random": random_workload,
    "sharegpt-like": sharegpt_like_workload,
    "shared-prefix": shared_prefix_workload,
}


def build_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """The requests `spec` describes."""
    return WORKLOADS[spec.kind](spec)


def completion_payload(request: BenchRequest, model: str) -> dict[str, object]:
    """The streamed /v1/completions body for one request: greedy, exact length, usage at the end.

    `ignore_eos` is vLLM's extra field (spindle accepts it too); servers that do not know it may
    stop early, which the load client reports as a length mismatch rather than hiding it.
    """
    return {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# Frequent English words with a Zipf-like weighting (rank r drawn with weight 1/r), so sentences
# have the short-word-heavy token statistics of real text without shipping or downloading a corpus.
_WORDS_TEXT = (
    "the of and to a in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their has been would will more if no when can so what about up said "
    "out them into time some could other than then its only new two may first also after any like our over "
    "people years well way even made many work part because year where most state system world still between "
    "school number government during without another city house service through children business program "
    "development water market community information history research country problem question national family "
    "report process early public change example energy health support policy against model language students "
    "movement economic interest important experience production treatment structure analysis evidence "
    "relationship environment particular university building computer material network behaviour temperature "
    "distribution performance significant approximately opportunity responsibility international organisation "
    "understanding infrastructure characteristics photosynthesis electromagnetic"
)
_WORDS = tuple(_WORDS_TEXT.split())
_WORD_WEIGHTS = 1.0 / np.arange(1, len(_WORDS) + 1)
_WORD_WEIGHTS /= _WORD_WEIGHTS.sum()


def english_like_sentences(num_sentences: int, min_words: int = 8, max_words: int = 200,
                           seed: int = 0) -> list[str]:
    """`num_sentences` seeded pseudo-English sentences, each of a uniform random word count in [min, max].

    Capitalised, with an occasional comma, ending in a period. Equal arguments give equal lists.
    """
    if num_sentences < 1:
        raise ValueError(f"num_sentences={num_sentences} must be at least 1")
    if not 1 <= min_words <= max_words:
        raise ValueError(f"min_words={min_words} and max_words={max_words} must satisfy 1 <= min <= max")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_words, max_words + 1, size=num_sentences)
    sentences = []
    for n in lengths:
        words = [_WORDS[i] for i in rng.choice(len(_WORDS), size=int(n), p=_WORD_WEIGHTS)]
        commas = rng.random(len(words) - 1) < 0.06  # a comma after about one word in 16
        text = " ".join(w + "," if c else w for w, c in zip(words, [*commas, False], strict=True))
        sentences.append(text[0].upper() + text[1:] + ".")
    return sentences
