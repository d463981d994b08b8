"""The embedding sentences and the shared-prefix workload: seeded, within bounds, prefix really shared."""

from __future__ import annotations

import pytest

from benchmarks.workload import WorkloadSpec, build_workload, english_like_sentences


def test_sentences_are_seeded_and_within_word_bounds() -> None:
    a = english_like_sentences(50, min_words=8, max_words=20, seed=1)
    assert a == english_like_sentences(50, min_words=8, max_words=20, seed=1)
    assert a != english_like_sentences(50, min_words=8, max_words=20, seed=2)
    counts = [len(s.split()) for s in a]
    assert min(counts) >= 8 and max(counts) <= 20
    assert len(set(counts)) > 5  # mixed lengths, not one fixed length
    assert all(s[0].isupper() and s.endswith(".") for s in a)


def test_sentence_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="num_sentences"):
        english_like_sentences(0)
    with pytest.raises(ValueError, match="min_words"):
        english_like_sentences(3, min_words=10, max_words=9)


def test_shared_prefix_workload_shares_exactly_the_prefix() -> None:
    spec = WorkloadSpec(kind="shared-prefix", num_requests=6, prefix_len=40, input_len=12, output_len=5,
                        vocab_low=4, vocab_high=1000, seed=7)
    requests = build_workload(spec)
    assert requests == build_workload(spec)
    prefix = requests[0].prompt_token_ids[:40]
    assert all(r.prompt_len == 52 and r.max_tokens == 5 for r in requests)
    assert all(r.prompt_token_ids[:40] == prefix for r in requests)
    assert len({r.prompt_token_ids[40:] for r in requests}) == 6
    assert all(4 <= t < 1000 for r in requests for t in r.prompt_token_ids)
    other_seed = build_workload(WorkloadSpec(kind="shared-prefix", num_requests=1, prefix_len=40, input_len=12,
                                             vocab_high=1000, seed=8))
    assert other_seed[0].prompt_token_ids[:40] != prefix


def test_shared_prefix_without_prefix_and_negative_prefix() -> None:
    requests = build_workload(WorkloadSpec(kind="shared-prefix", num_requests=2, input_len=3, vocab_high=50))
    assert [r.prompt_len for r in requests] == [3, 3]
    with pytest.raises(ValueError, match="prefix_len"):
        WorkloadSpec(kind="shared-prefix", prefix_len=-1)
