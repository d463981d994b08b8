"""Stop strings: never partially emitted, cut before the match, and the scheduler is told to abort."""

from __future__ import annotations

import random

from services.frontend.server import Frontend
from services.frontend.stop_strings import StopStringMatcher
from shared.pb.spindle.v1 import generation_pb2 as pb
from shared.pb.spindle.v1 import generation_pb2_grpc
from tests.frontend.conftest import MODEL_NAME
from tests.frontend.fake_scheduler import FakeScheduler


def _feed_all(stops: list[str], pieces: list[str]) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.matched is not None:
            return out, matcher.matched
    out.append(matcher.flush())
    return out, None


def test_stop_string_spanning_steps_is_held_back_then_cut() -> None:
    out, matched = _feed_all(["STOP"], ["abc S", "T", "O", "P def"])
    assert out == ["abc ", "", "", ""]
    assert matched == "STOP"


def test_partial_match_that_does_not_complete_is_released() -> None:
    out, matched = _feed_all(["STOP"], ["abc ST", "OX", " end"])
    assert matched is None
    assert out == ["abc ", "STOX", " end", ""]


def test_held_tail_is_flushed_at_the_end() -> None:
    out, matched = _feed_all(["STOP"], ["abc STO"])
    assert (out, matched) == (["abc ", "STO"], None)


def test_first_completed_stop_string_wins() -> None:
    assert _feed_all(["world", "lo w"], ["hello world"]) == (["hel"], "lo w")
    assert _feed_all(["abcd", "bc"], ["abcd"]) == (["a"], "bc")
    assert _feed_all(["bc", "abc"], ["abcd"]) == ([""], "abc")


def test_random_splits_match_the_one_shot_answer() -> None:
    rng = random.Random(0)
    alphabet = "ab数🙂"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, matched = _feed_all(stops, pieces)
        # One-shot answer: cut before the stop string that completes first (longer on a tie),
        # whatever the split.
        hits = [(text.find(stop) + len(stop), text.find(stop), stop) for stop in stops if stop in text]
        if hits:
            _, at, stop = min(hits)
            assert ("".join(out), matched) == (text[:at], stop), (text, stops, pieces)
        else:
            assert ("".join(out), matched) == (text, None)
        # Every emitted piece is final: the emitted text is always a prefix of the answer.
        assert text.startswith("".join(out))


async def _generate(stub: generation_pb2_grpc.GenerationServiceStub, text: str,
                    **sampling: object) -> tuple[str, list[int], pb.GenerateComplete, list[str]]:
    request = pb.GenerateRequest(model=MODEL_NAME, text=text, sampling=pb.SamplingParams(**sampling))
    texts, ids, complete = [], [], None
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            texts.append(response.chunk.text)
            ids.extend(response.chunk.token_ids)
        else:
            complete = response.complete
    assert complete is not None
    return "".join(texts), ids, complete, texts


async def test_stop_string_ends_generation_and_aborts_in_scheduler(
        stub: generation_pb2_grpc.GenerationServiceStub, fake: FakeScheduler) -> None:
    # The fake echoes the prompt (without BOS) forever: "hello world, hello world, ..."
    text, ids, complete, pieces = await _generate(stub, "hello world, ", max_tokens=100, stop=["world,"])
    assert text == "hello "
    assert complete.finish_reason == pb.FINISH_REASON_STOP
    assert complete.matched_stop == "world,"
    assert complete.usage.completion_tokens == len(ids) < 100
    assert not any("w" in p for p in pieces)  # no part of the stop string ever left
    assert await fake.wait_for_abort() == [fake.added[0].request_id]
    assert not fake.running


async def test_stop_string_spanning_several_tokens_and_steps(
        stub: generation_pb2_grpc.GenerationServiceStub, fake: FakeScheduler) -> None:
    fake.tokens_per_step = 2
    prompt = "数据 模型 服务 调度 缓存 令牌"
    text, _, complete, _ = await _generate(stub, prompt, max_tokens=60, stop=["服务 调"])
    assert text == "数据 模型 "
    assert complete.matched_stop == "服务 调"


async def test_stop_token_id_ends_generation_without_its_text(
        stub: generation_pb2_grpc.GenerationServiceStub, frontend: Frontend) -> None:
    ids = frontend.tokenizer.hf.encode("hello world", add_special_tokens=False)
    stop_id = ids[-1]
    text, out_ids, complete, _ = await _generate(stub, "hello world", max_tokens=50, stop_token_ids=[stop_id])
    assert out_ids == ids
    assert text == frontend.tokenizer.decode(ids[:-1])
    assert complete.finish_reason == pb.FINISH_REASON_STOP
    assert complete.matched_stop == frontend.tokenizer.decode([stop_id])


async def test_no_match_releases_the_held_back_tail_at_the_end(
        stub: generation_pb2_grpc.GenerationServiceStub, frontend: Frontend) -> None:
    # "hello wor" ends with a prefix of "rld!" that never completes: it must still be returned.
    num_tokens = len(frontend.tokenizer.hf.encode("hello wor", add_special_tokens=False))
    text, _, complete, pieces = await _generate(stub, "hello wor", max_tokens=num_tokens, stop=["rld!", "hello!"])
    assert len(pieces) == num_tokens
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert complete.matched_stop == ""
    assert text == "hello wor"


def test_stop_string_is_not_matched_before_min_tokens() -> None:
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("xa", can_match=False) == "xa"
    assert matcher.feed("b a", can_match=True) == "b "
    assert matcher.feed("b", can_match=True) == ""
    assert matcher.matched == "ab"


async def test_min_tokens_lets_an_early_stop_string_through(
        stub: generation_pb2_grpc.GenerationServiceStub, frontend: Frontend) -> None:
    num_tokens = len(frontend.tokenizer.hf.encode("hello world, ", add_special_tokens=False))
    text, _, complete, _ = await _generate(stub, "hello world, ", max_tokens=60, stop=["world,"],
                                           min_tokens=num_tokens + 1)
    assert text == "hello world, hello "
    assert complete.matched_stop == "world,"
