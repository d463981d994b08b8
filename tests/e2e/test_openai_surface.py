"""The OpenAI surface clients send, through the official `openai` client and the real services:
n > 1 (prompt computed once, shared through the prefix cache), best_of, logit_bias, echo,
suffix, raw logprobs, max_completion_tokens, seed and system_fingerprint, stream_options,
structured output (response_format json_object / json_schema, gRPC regex),
/tokenize and /detokenize, the same over gRPC, and a clear 400 for bad input of each field
while other requests run on untouched.

One server for the module: two workers, 8-step rounds, prefix caching, and a KV pool small
enough that n > 1 under load preempts. One more without prefix caching.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI
from transformers import AutoTokenizer

from shared.pb.spindle.v1 import generation_pb2 as pb
from shared.pb.spindle.v1 import generation_pb2_grpc
from tests.e2e.oracle import _load, greedy_tokens
from tests.e2e.server import StandaloneServices, spindle_services
from tests.e2e.test_scheduler_pressure import BLOCK_BYTES, scheduler_stats

pytestmark = pytest.mark.e2e

NO_EOS = {"ignore_eos": True}  # vLLM-style extra: outputs of a known length


@pytest.fixture(scope="module")
def svc(tiny_models: dict[str, Path]) -> Iterator[StandaloneServices]:
    with spindle_services(tiny_models["llama"], num_workers=2,
                          worker_args=("--kv-cache-bytes", str(24 * BLOCK_BYTES))) as running:
        yield running


@pytest.fixture(scope="module")
def client(svc: StandaloneServices) -> OpenAI:
    return OpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]):  # noqa: ANN201 - a HF tokenizer
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(length)]


def _post(svc: StandaloneServices, path: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(svc.server.http_url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ---- n > 1 ----------------------------------------------------------------------------------


def test_n_greedy_choices_match_transformers_and_compute_the_prompt_once(
        svc: StandaloneServices, client: OpenAI, tokenizer, tiny_models: dict[str, Path]) -> None:  # noqa: ANN001
    prompt = _prompt(1, 53)  # 3 full blocks of 16 and a partial one
    want_ids = greedy_tokens(tiny_models["llama"], prompt, 10)
    want = tokenizer.decode(want_ids, skip_special_tokens=True)
    before = scheduler_stats(svc.scheduler_address)
    result = client.completions.create(model=svc.server.model_name, prompt=prompt, n=4, max_tokens=10,
                                       temperature=0)
    after = scheduler_stats(svc.scheduler_address)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == [want] * 4
    assert result.usage.prompt_tokens == len(prompt)  # counted once
    assert result.usage.completion_tokens == 4 * len(want_ids)
    assert {c.finish_reason for c in result.choices} == {"length" if len(want_ids) == 10 else "stop"}
    # The 3 later samples found the prompt's 3 full blocks in the prefix cache.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 3 * 48


def test_n_streams_every_choice_with_its_index_finish_and_summed_usage(
        svc: StandaloneServices, client: OpenAI) -> None:
    messages = [{"role": "user", "content": "tell me something " * 8}]
    kwargs = dict(model=svc.server.model_name, messages=messages, n=3, max_tokens=12, temperature=1.0, seed=7,
                  extra_body=NO_EOS)
    texts, finishes, roles, usage = ["", "", ""], [None] * 3, set(), None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        assert chunk.system_fingerprint
    assert roles == {0, 1, 2} and finishes == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 36
    assert len(set(texts)) > 1, "seed + index: the choices are different samples"
    whole = client.chat.completions.create(**kwargs)  # the same seed: the same samples
    assert [c.message.content for c in whole.choices] == texts
    assert whole.usage.completion_tokens == 36


def test_seeded_sampling_is_reproducible_and_choice_i_uses_seed_plus_i(svc: StandaloneServices,
                                                                        client: OpenAI) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        result = client.completions.create(model=svc.server.model_name, prompt="once upon a time", n=n,
                                           max_tokens=16, temperature=1.0, seed=seed, extra_body=NO_EOS)
        assert result.system_fingerprint and result.system_fingerprint.startswith("fp_")
        return [c.text for c in result.choices]

    first = sample(42)
    assert sample(42) == first
    assert sample(43) != first
    assert sample(42, n=2) == first + sample(43)


def test_n_under_preemption_on_two_workers_stays_greedy_exact(
        svc: StandaloneServices, tiny_models: dict[str, Path], tokenizer) -> None:  # noqa: ANN001
    jobs = [_prompt(10 + i, 40 + 7 * i) for i in range(6)]
    wants = [tokenizer.decode(greedy_tokens(tiny_models["llama"], p, 40), skip_special_tokens=True) for p in jobs]
    before = scheduler_stats(svc.scheduler_address)

    async def run() -> list[openai.types.Completion]:
        async with AsyncOpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(
                aclient.completions.create(model=svc.server.model_name, prompt=p, n=4, max_tokens=40,
                                           temperature=0) for p in jobs))

    results = asyncio.run(run())
    after = scheduler_stats(svc.scheduler_address)
    for want, result in zip(wants, results, strict=True):
        assert [c.text for c in result.choices] == [want] * 4
    assert after.num_preemptions > before.num_preemptions, "24 blocks per worker cannot hold 24 sequences"


def test_best_of_returns_the_candidate_with_the_highest_logprob_per_token(svc: StandaloneServices,
                                                                          client: OpenAI) -> None:
    kwargs = dict(model=svc.server.model_name, prompt="the best", max_tokens=8, temperature=1.0, seed=5,
                  extra_body=NO_EOS)
    best = client.completions.create(**kwargs, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # logprobs were only for ranking
    assert best.usage.completion_tokens == 24  # every candidate was generated
    candidates = client.completions.create(**kwargs, n=3, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates.choices]
    assert best.choices[0].text == candidates.choices[means.index(max(means))].text


def test_n_without_prefix_caching_computes_each_sample_and_stays_exact(
        tiny_models: dict[str, Path], tokenizer) -> None:  # noqa: ANN001
    prompt = _prompt(2, 40)
    want = tokenizer.decode(greedy_tokens(tiny_models["llama"], prompt, 8), skip_special_tokens=True)
    with spindle_services(tiny_models["llama"], scheduler_args=("--no-enable-prefix-caching",)) as svc:
        client = OpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0)
        result = client.completions.create(model=svc.server.model_name, prompt=prompt, n=3, max_tokens=8,
                                           temperature=0)
        stats = scheduler_stats(svc.scheduler_address)
    assert [c.text for c in result.choices] == [want] * 3
    assert stats.prefix_cache_hits == 0


# ---- the rest of the surface ------------------------------------------------------------------


def test_logit_bias_steers_sampling_and_logprobs_stay_the_models_own(
        svc: StandaloneServices, client: OpenAI, tiny_models: dict[str, Path]) -> None:
    prompt = _prompt(3, 12)
    forced = client.completions.create(model=svc.server.model_name, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={"300": 100}, logprobs=1, extra_body=NO_EOS)
    with torch.no_grad():
        raw = _load(str(tiny_models["llama"]))(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    logprobs = forced.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and len(set(logprobs.tokens)) == 1  # token 300, every time
    # the biased token's reported logprob is the model's raw one, not ~0 after the bias
    assert logprobs.token_logprobs[0] == pytest.approx(raw[300].item(), abs=1e-3)
    greedy_first = int(raw.argmax())
    banned = client.completions.create(model=svc.server.model_name, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(greedy_first): -100}, logprobs=0)
    plain = client.completions.create(model=svc.server.model_name, prompt=prompt, max_tokens=1, temperature=0,
                                      logprobs=0)
    assert banned.choices[0].logprobs.tokens != plain.choices[0].logprobs.tokens


def test_echo_puts_the_prompt_first_whole_and_streamed(svc: StandaloneServices, client: OpenAI) -> None:
    kwargs = dict(model=svc.server.model_name, prompt="hello echo", max_tokens=5, temperature=0)
    plain = client.completions.create(**kwargs)
    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == "hello echo" + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = [c.choices[0].text for c in client.completions.create(**kwargs, echo=True, stream=True) if c.choices]
    assert chunks[0] == "hello echo" and "".join(chunks) == echoed.choices[0].text


def test_max_completion_tokens_and_continuous_usage(svc: StandaloneServices, client: OpenAI) -> None:
    messages = [{"role": "user", "content": "count"}]
    result = client.chat.completions.create(model=svc.server.model_name, messages=messages, max_completion_tokens=3,
                                            temperature=0, extra_body=NO_EOS)
    assert result.usage.completion_tokens == 3 and result.choices[0].finish_reason == "length"
    seen = []
    for chunk in client.chat.completions.create(
            model=svc.server.model_name, messages=messages, max_completion_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=NO_EOS):
        assert chunk.usage is not None
        seen.append(chunk.usage.completion_tokens)
    assert seen == sorted(seen) and seen[-1] == 5


def test_tokenize_and_detokenize_match_the_tokenizer(svc: StandaloneServices, tokenizer) -> None:  # noqa: ANN001
    model = svc.server.model_name
    status, body = _post(svc, "/tokenize", {"model": model, "prompt": "hello café"})
    assert status == 200 and body["tokens"] == tokenizer.encode("hello café")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "hi there"}]
    status, chat = _post(svc, "/tokenize", {"model": model, "messages": messages})
    want = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False).input_ids
    assert status == 200 and chat["tokens"] == want
    status, back = _post(svc, "/detokenize", {"model": model, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(body["tokens"])
    assert _post(svc, "/detokenize", {"model": model, "tokens": [10**6]})[0] == 400
    assert _post(svc, "/tokenize", {"model": model})[0] == 400
    assert _post(svc, "/tokenize", {"model": "nope", "prompt": "x"})[0] == 404


def test_grpc_n_echo_logit_bias_tokenize_and_detokenize(svc: StandaloneServices, tokenizer) -> None:  # noqa: ANN001
    model = svc.server.model_name
    with grpc.insecure_channel(svc.server.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(model=model, text="grpc samples", n=3, echo=True, sampling=pb.SamplingParams(
            max_tokens=4, temperature=1.0, seed=11, ignore_eos=True, logit_bias={7: -100.0}))
        prompts, outputs, completes = {}, {0: [], 1: [], 2: []}, []
        for response in stub.Generate(request):
            if response.HasField("chunk"):
                if response.chunk.is_prompt:
                    prompts[response.chunk.index] = response.chunk.text
                else:
                    outputs[response.chunk.index] += response.chunk.token_ids
            else:
                completes.append(response.complete)
        assert prompts == {0: "grpc samples", 1: "grpc samples", 2: "grpc samples"}
        assert all(len(ids) == 4 and 7 not in ids for ids in outputs.values())
        assert sorted(c.index for c in completes) == [0, 1, 2]
        assert [c.HasField("total_usage") for c in completes] == [False, False, True]
        assert completes[-1].total_usage.completion_tokens == 12 and completes[-1].system_fingerprint
        tokens = stub.Tokenize(pb.TokenizeRequest(model=model, text="round trip", add_special_tokens=False))
        assert list(tokens.token_ids) == tokenizer.encode("round trip", add_special_tokens=False)
        assert tokens.max_model_len > 0
        text = stub.Detokenize(pb.DetokenizeRequest(model=model, token_ids=tokens.token_ids)).text
        assert text == "round trip"
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(model=model, text="x", n=200)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n=200" in info.value.details()


# ---- bad input ------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"n": 0}, "n=0 is out of range"),
    ({"n": 129}, "n=129 is out of range"),
    ({"best_of": 2, "n": 3}, "best_of=2 must be at least n=3"),
    ({"best_of": 3, "stream": True}, "cannot be streamed"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5]=101"),
    ({"logit_bias": {"99999": 1}}, "99999 is not a valid token id"),
    ({"echo": True, "logprobs": 1}, "echo with logprobs is not supported"),
    ({"suffix": "the end"}, "suffix is not supported"),
    ({"seed": -1}, "seed=-1"),
    ({"logprobs": 21}, "logprobs=21"),
    ({"stream_options": {"include_usage": True}}, "stream_options is only allowed when stream is true"),
]
BAD_CHAT = [
    ({"max_tokens": 4, "max_completion_tokens": 5}, "disagree"),
    ({"max_completion_tokens": 0}, "max_tokens=0"),
    ({"n": -1}, "n=-1"),
    ({"logit_bias": {"5": "high"}}, "logit_bias.5 must be a number"),
    ({"top_logprobs": 2}, "requires logprobs"),
]


def test_bad_input_of_each_new_field_is_a_clear_400_and_other_requests_run_on(svc: StandaloneServices) -> None:
    model = svc.server.model_name

    async def run() -> None:
        async with AsyncOpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0) as aclient:
            bystander = asyncio.ensure_future(aclient.completions.create(
                model=model, prompt="keep going", n=2, max_tokens=48, temperature=0, extra_body=NO_EOS))
            await asyncio.sleep(0.05)
            for fields, message in BAD_COMPLETIONS:
                extra = {k: v for k, v in fields.items() if k == "stream_options"}
                body = {k: v for k, v in fields.items() if k != "stream_options"}
                with pytest.raises(openai.BadRequestError) as info:
                    await aclient.completions.create(model=model, prompt="hi", max_tokens=2, **body,
                                                     extra_body=extra)
                assert message in str(info.value), fields
            for fields, message in BAD_CHAT:
                with pytest.raises(openai.BadRequestError) as info:
                    await aclient.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                          **fields)
                assert message in str(info.value), fields
            result = await bystander
            assert [c.finish_reason for c in result.choices] == ["length", "length"]
            assert result.usage.completion_tokens == 96

    asyncio.run(run())


# ---- structured output (response_format, gRPC grammars) -------------------------------------
# On the module's server: 8-step rounds, two workers, a KV pool small enough to preempt. The
# tiny random model at temperature 1 would never write JSON by itself: every valid output is
# the grammar mask's doing.


def _random_schema(rng: random.Random) -> dict:
    """A small strict object schema; strings, numbers and arrays are bounded so outputs end."""
    props: dict[str, dict] = {}
    for i, kind in enumerate(rng.sample(["string", "integer", "boolean", "enum", "array"], rng.randint(3, 4))):
        props[f"f{i}_{kind}"] = {
            "string": lambda: {"type": "string", "maxLength": rng.randint(1, 6)},
            "integer": lambda: {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 999)},
            "boolean": lambda: {"type": "boolean"},
            "enum": lambda: {"enum": rng.sample(["red", "green", "blue", "x", "y z"], rng.randint(1, 3))},
            "array": lambda: {"type": "array", "maxItems": rng.randint(1, 3), "items": rng.choice(
                [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}])},
        }[kind]()
    names = list(props)
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(1, len(names))),
            "additionalProperties": False}


def _json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_object_output_parses(svc: StandaloneServices, client: OpenAI, tokenizer) -> None:  # noqa: ANN001
    model = svc.server.model_name
    # The bias says "end now"; the grammar allows "}" only after "{": output is exactly {}.
    close = {str(tokenizer.convert_tokens_to_ids("}")): 100}
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "json please"}],
                                          response_format={"type": "json_object"}, logit_bias=close, max_tokens=50)
    assert chat.choices[0].message.content == "{}" and chat.choices[0].finish_reason == "stop"
    result = client.completions.create(model=model, prompt="an object:", n=4, max_tokens=300, temperature=1.0,
                                       seed=5, extra_body={"response_format": {"type": "json_object"}})
    for choice in result.choices:
        if choice.finish_reason == "stop":  # else max_tokens cut it: a random model may nest deeply
            assert isinstance(json.loads(choice.text), dict), choice.text
    assert any(choice.finish_reason == "stop" for choice in result.choices)


def test_vllm_structured_outputs_choice_and_regex(svc: StandaloneServices, client: OpenAI) -> None:
    model = svc.server.model_name
    choices = ["yes", "no", "maybe not"]
    result = client.completions.create(model=model, prompt="well?", n=4, max_tokens=20, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in result.choices), result.choices
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a date"}],
                                          max_tokens=40, temperature=1.0,
                                          extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", chat.choices[0].message.content or "")


def test_random_json_schemas_every_output_validates(svc: StandaloneServices) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    model = svc.server.model_name
    rng = random.Random(13)
    schemas = [_random_schema(rng) for _ in range(5)]

    async def one(aclient: AsyncOpenAI, i: int, schema: dict) -> list[tuple[str, str | None]]:
        fmt = _json_schema_format(schema, f"schema_{i}")
        if i % 2:
            chat = await aclient.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"fill schema {i}"}], n=3, temperature=1.0,
                max_tokens=200, response_format=fmt)
            return [(c.message.content or "", c.finish_reason) for c in chat.choices]
        stream = await aclient.completions.create(model=model, prompt=f"schema {i}:", n=3, temperature=1.0,
                                                  max_tokens=200, stream=True, extra_body={"response_format": fmt})
        texts, finishes = ["", "", ""], [None, None, None]
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
                finishes[c.index] = c.finish_reason or finishes[c.index]
        return list(zip(texts, finishes, strict=True))

    async def run() -> list[list[tuple[str, str | None]]]:
        async with AsyncOpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i, s) for i, s in enumerate(schemas)))

    for schema, outputs in zip(schemas, asyncio.run(run()), strict=True):
        for text, finish in outputs:
            assert finish == "stop", (text, schema)
            jsonschema.validate(json.loads(text), schema)


def test_structured_outputs_survive_preemption(svc: StandaloneServices) -> None:
    """Preempted requests are recomputed: the worker replays their tokens through a fresh matcher."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = _random_schema(random.Random(7))
    jobs = [_prompt(30 + i, 40 + 7 * i) for i in range(6)]
    before = scheduler_stats(svc.scheduler_address)

    async def run() -> list[openai.types.Completion]:
        async with AsyncOpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(
                aclient.completions.create(model=svc.server.model_name, prompt=p, n=4, max_tokens=200,
                                           temperature=1.0, extra_body={"response_format": _json_schema_format(schema)})
                for p in jobs))

    results = asyncio.run(run())
    assert scheduler_stats(svc.scheduler_address).num_preemptions > before.num_preemptions
    for choice in (c for result in results for c in result.choices):
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)


def test_a_bad_schema_is_a_400_while_a_structured_request_runs_on(svc: StandaloneServices) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    model = svc.server.model_name
    schema = _random_schema(random.Random(99))
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                             for i in range(700)}}
    bad = [
        (_json_schema_format({"type": "frob"}), "Invalid type"),
        (_json_schema_format(huge), "too large"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
        ({"type": "yaml"}, "response_format.type 'yaml' is not supported"),
    ]

    async def run() -> None:
        async with AsyncOpenAI(base_url=svc.server.http_url + "/v1", api_key="unused", max_retries=0) as aclient:
            bystander = asyncio.ensure_future(aclient.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "go on"}], n=2, temperature=1.0, max_tokens=200,
                response_format=_json_schema_format(schema)))
            await asyncio.sleep(0.05)
            for fmt, message in bad:
                with pytest.raises(openai.BadRequestError) as info:
                    await aclient.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=4, response_format=fmt)
                assert message in str(info.value), fmt
            with pytest.raises(openai.BadRequestError, match="ignore_eos cannot be combined"):
                await aclient.completions.create(model=model, prompt="x", max_tokens=4, extra_body={
                    "response_format": {"type": "json_object"}, "ignore_eos": True})
            result = await bystander
            for choice in result.choices:
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content or ""), schema)

    asyncio.run(run())


def test_grpc_regex_output_fullmatches(svc: StandaloneServices) -> None:
    regex = r"(yes|no): [a-z]{1,5}( [0-9]{1,3}){0,2}"
    with grpc.insecure_channel(svc.server.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(model=svc.server.model_name, text="answer", n=3, sampling=pb.SamplingParams(
            max_tokens=100, temperature=1.0, structured=pb.StructuredOutput(regex=regex)))
        texts, finishes = {0: "", 1: "", 2: ""}, {}
        for response in stub.Generate(request):
            if response.HasField("chunk"):
                texts[response.chunk.index] += response.chunk.text
            else:
                finishes[response.complete.index] = response.complete.finish_reason
        assert all(re.fullmatch(regex, text) for text in texts.values()), texts
        assert set(finishes.values()) == {pb.FINISH_REASON_STOP}
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(model=svc.server.model_name, text="x", sampling=pb.SamplingParams(
                structured=pb.StructuredOutput(regex="(unclosed")))))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid regex" in info.value.details()
