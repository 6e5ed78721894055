"""Structured outputs through /v1 with the unmodified openai and openai-agents SDKs, on the tiny model's RANDOM
weights (and a trained adapter): whatever the weights, every answer has the forced shape, because the sampler masks
each step's logits with the grammar the gateway built (gateway/openai/structured.py).

response_format json_schema (``chat.completions.parse`` x50, streamed, /v1/completions), json_object, an Agent's
``output_type``, ``tool_choice`` "required" and a named function (arguments valid for the tool's schema), a cut by
max_tokens said as "length", a schema the compiler refuses as a 400, and the constraint kept in the episode."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from typing import Any, Literal

import agents
import openai
import pytest
from gatewayutil import KEY_A, base_url
from openai.types.chat import ChatCompletionToolParam
from openaiutil import async_openai_client, openai_client, train_adapter
from petschema import Pet
from pydantic import BaseModel, ConfigDict, Field
from serverproc import ServerProcess

from opentinker.client import EpisodeClient, ServiceClient
from opentinker.client.episodes import EPISODE_HEADER

ADAPTER = "gw-a/structured"
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a pet as JSON."}]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=10)
    unit: Literal["C", "F"]
    days: int = Field(ge=1, le=7)


class Seat(enum.Enum):
    AISLE = "aisle"
    WINDOW = "window"


class Booking(BaseModel):
    """Its schema refers to Seat through $defs: the reference must survive being nested inside the call's schema."""

    model_config = ConfigDict(extra="forbid")
    seat: Seat
    count: int = Field(ge=1, le=4)


WEATHER_PARAMETERS = Weather.model_json_schema()
BOOK_PARAMETERS = Booking.model_json_schema()
assert "$defs" in BOOK_PARAMETERS
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "book_seat", "parameters": BOOK_PARAMETERS}},
]
ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": Weather, "book_seat": Booking}


@pytest.fixture(scope="module")
def adapter(service: ServiceClient) -> str:
    return f"{ADAPTER}@{train_adapter(service, ADAPTER, seed=9)}"


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(gateway, KEY_A) as client:
        yield client


def _parse_many(gateway: ServerProcess, models: list[str]) -> list[openai.types.chat.ParsedChatCompletion[Pet]]:
    """One ``chat.completions.parse`` per model entry, 10 in flight at a time (the sampler batches them)."""

    async def run() -> list[openai.types.chat.ParsedChatCompletion[Pet]]:
        async with async_openai_client(gateway, KEY_A) as client:
            gate = asyncio.Semaphore(10)

            async def one(i: int, model: str) -> openai.types.chat.ParsedChatCompletion[Pet]:
                async with gate:
                    answer: openai.types.chat.ParsedChatCompletion[Pet] = await client.chat.completions.parse(
                        model=model, messages=MESSAGES, response_format=Pet, temperature=1.0, seed=i, max_tokens=200
                    )
                    return answer

            return await asyncio.gather(*(one(i, model) for i, model in enumerate(models)))

    return asyncio.run(run())


def test_fifty_parsed_answers_all_validate_on_random_weights(gateway: ServerProcess, adapter: str) -> None:
    answers = _parse_many(gateway, ["base"] * 40 + [adapter] * 10)
    assert len(answers) == 50
    for answer in answers:
        (choice,) = answer.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Pet)  # parse() ran Pet.model_validate_json on the content
        Pet.model_validate_json(choice.message.content or "")
    assert {a.model for a in answers[40:]} == {adapter}
    assert len({a.choices[0].message.content for a in answers}) > 40  # sampled at temperature 1, not one answer


def test_streamed_and_completions_answers_follow_the_schema(client: openai.OpenAI) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True},
    }
    chunks = list(
        client.chat.completions.create(
            model="base",
            messages=MESSAGES,
            response_format=response_format,
            temperature=1.0,
            seed=3,
            max_tokens=200,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Pet.model_validate_json(text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    completion = client.completions.create(
        model="base",
        prompt="A pet:",
        temperature=1.0,
        seed=4,
        max_tokens=200,
        n=3,
        extra_body={"response_format": response_format},
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        Pet.model_validate_json(choice.text)
    anything = client.chat.completions.create(
        model="base",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=5,
        max_tokens=200,
    )
    if anything.choices[0].finish_reason == "stop":  # a free object may be long; cut ones are checked below
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)


def test_a_cut_by_max_tokens_says_length_never_a_silent_invalid_object(client: openai.OpenAI) -> None:
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="base", messages=MESSAGES, response_format=Pet, max_tokens=5)
    schema: Any = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}
    cut = client.chat.completions.create(model="base", messages=MESSAGES, response_format=schema, max_tokens=3)
    # Six required fields do not fit in 3 tokens: whatever the draws, the cut is said. The text is a prefix of the
    # object, whose first key is the schema's first field (the order of `properties` is the output's).
    text = cut.choices[0].message.content or ""
    assert cut.choices[0].finish_reason == "length" and text and '{"name": '.startswith(text[:9]), text


def test_an_agents_output_type_is_a_validated_instance(gateway: ServerProcess) -> None:
    agents.set_tracing_disabled(True)

    async def run() -> list[object]:
        async with async_openai_client(gateway, KEY_A) as client:
            model = agents.OpenAIChatCompletionsModel(model="base", openai_client=client)
            outputs = []
            for seed in range(3):
                agent = agents.Agent(
                    name="pets",
                    model=model,
                    output_type=Pet,
                    model_settings=agents.ModelSettings(temperature=1.0, max_tokens=200, extra_body={"seed": seed}),
                )
                outputs.append((await agents.Runner.run(agent, "Describe a pet.")).final_output)
            return outputs

    outputs = asyncio.run(run())
    assert len(outputs) == 3 and all(isinstance(pet, Pet) for pet in outputs)


def _calls(answer: openai.types.chat.ChatCompletion) -> list[tuple[str, dict[str, Any]]]:
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls", choice.message.content
    out = []
    for call in choice.message.tool_calls or []:
        assert call.type == "function"
        arguments = json.loads(call.function.arguments)
        ARGUMENTS[call.function.name].model_validate(arguments)  # raises when the arguments break the schema
        out.append((call.function.name, arguments))
    return out


def test_tool_choice_required_always_calls_with_valid_arguments(client: openai.OpenAI, adapter: str) -> None:
    names: list[str] = []
    for seed in range(10):
        answer = client.chat.completions.create(
            model=adapter if seed % 2 else "base",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            parallel_tool_calls=seed < 5,
        )
        calls = _calls(answer)
        assert 1 <= len(calls) <= (4 if seed < 5 else 1)
        names.extend(name for name, _ in calls)
    assert set(names) == {"get_weather", "book_seat"}  # both tools are reachable, at random


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in range(6):
        name = ("get_weather", "book_seat")[seed % 2]
        answer = client.chat.completions.create(
            model="base",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        assert [called for called, _ in _calls(answer)] == [name]
    chunks = list(
        client.chat.completions.create(
            model="base",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "book_seat"}},
            temperature=1.0,
            seed=11,
            max_tokens=300,
            stream=True,
        )
    )
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function is not None and deltas[0].function.name == "book_seat"
    Booking.model_validate_json(deltas[0].function.arguments or "")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_auto_with_a_response_format_answers_either_a_call_or_the_object(client: openai.OpenAI) -> None:
    kinds = set()
    for seed in range(8):
        answer = client.chat.completions.create(
            model="base",
            messages=MESSAGES,
            tools=TOOLS,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}},
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        choice = answer.choices[0]
        if choice.message.tool_calls:
            _calls(answer)
            kinds.add("call")
        else:
            assert choice.finish_reason == "stop"
            Pet.model_validate_json(choice.message.content or "")
            kinds.add("object")
    assert kinds  # each answer was one of the two shapes (which ones a random model picks is its business)


def test_a_schema_the_compiler_refuses_is_a_400_and_nothing_is_sampled(
    client: openai.OpenAI, service: ServiceClient
) -> None:
    sampler = service.create_sampling_client("base")
    before = sampler.stats().tokens_generated
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}
                ],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
    ]
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="base", messages=MESSAGES, max_tokens=8, **fields)
        assert caught.value.param == param, caught.value
        assert caught.value.code == "invalid_constraint" and "does not compile" in caught.value.message
    assert sampler.stats().tokens_generated == before


def test_the_episode_records_the_constraint_with_the_completion(gateway: ServerProcess, client: openai.OpenAI) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}
    tagged = client.with_options(default_headers={EPISODE_HEADER: "structured-1"})
    tagged.chat.completions.create(model="base", messages=MESSAGES, response_format=schema, max_tokens=200)  # type: ignore[call-overload]
    tagged.chat.completions.create(model="base", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300)
    tagged.chat.completions.create(model="base", messages=MESSAGES, max_tokens=4)
    turns = EpisodeClient(base_url(gateway), KEY_A).get("structured-1").turns
    first, second, free = (turn.constraint for turn in turns)
    assert first is not None and (first.kind, first.origin) == ("json_schema", "response_format")
    assert json.loads(first.source) == Pet.model_json_schema()
    assert second is not None and (second.kind, second.origin) == ("lark", "tool_choice")
    assert "<tool_call>" in second.source and "get_weather" in second.source
    assert free is None
