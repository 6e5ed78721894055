"""Tool calling end to end through /v1: an adapter trained by SFT here (the Renderer with tools) to call
get_weather for one prompt and to answer after the tool's result; then an agent loop on the OpenAI Agents SDK
(its chat-completions model class) and one on the plain openai SDK (streamed and not) call the tool, send the
result back and get the final answer. Greedy decoding: deterministic."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import agents
import openai
import pytest
from agents.models.chatcmpl_converter import Converter
from gatewayutil import KEY_A, base_url
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openaiutil import async_openai_client, openai_client
from serverproc import ServerProcess

from opentinker.client import AdamParams, EpisodeClient, LoraConfig, Renderer, ServiceClient
from opentinker.client.episodes import EPISODE_HEADER

ADAPTER = "gw-a/tool-agent"
QUESTION = "What is the weather in Paris?"
WEATHER = "sunny, 21 C"
ANSWER = "It is sunny in Paris."
calls_made: list[str] = []


@agents.function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls_made.append(city)
    return WEATHER


# The tools exactly as the Agents SDK sends them, so that both loops' prompts are the trained one.
TOOLS: list[ChatCompletionToolParam] = [Converter.tool_to_openai(get_weather)]


def _conversation() -> list[dict[str, object]]:
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": WEATHER},
        {"role": "assistant", "content": ANSWER},
    ]


@pytest.fixture(scope="module")
def trained(
    trainer_server: ServerProcess, sampler_server: ServerProcess, registry_server: ServerProcess, tiny_model: Path
) -> int:
    """The adapter trained on the two assistant turns (the tool call, the answer); its snapshot's version."""
    renderer = Renderer.from_pretrained(tiny_model)
    tools = [dict(tool) for tool in TOOLS]
    datum = renderer.sft_datum(_conversation(), "all_assistant", tools=tools)
    with ServiceClient(trainer_server.address, sampler_server.address, registry_server.address) as service:
        training = service.create_training_client(ADAPTER, LoraConfig(rank=16), seed=3)
        losses = []
        for _ in range(100):
            result = training.forward_backward([datum], "cross_entropy")
            losses.append(result.metrics["loss:sum"] / result.metrics["weights:sum"])
            training.optim_step(AdamParams(learning_rate=2e-2))
        print("tool SFT loss:sum / weights:sum:", " ".join(f"{x:.3f}" for x in losses[::5]), f"{losses[-1]:.4f}")
        return training.save_snapshot().number


@pytest.fixture(scope="module")
def client(gateway: ServerProcess, trained: int) -> Iterator[openai.OpenAI]:
    with openai_client(gateway, KEY_A) as client:
        yield client


def test_plain_openai_loop(client: openai.OpenAI, trained: int) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=ADAPTER, messages=messages, tools=TOOLS, temperature=0, max_tokens=64)
    assert first.model == f"{ADAPTER}@{trained}"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages.append(choice.message.model_dump(exclude_none=True))  # type: ignore[arg-type]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER})
    second = client.chat.completions.create(model=ADAPTER, messages=messages, tools=TOOLS, temperature=0, max_tokens=64)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ANSWER and not second.choices[0].message.tool_calls


def test_streamed_tool_call(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=ADAPTER,
            messages=[{"role": "user", "content": QUESTION}],
            tools=TOOLS,
            temperature=0,
            max_tokens=64,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == ""  # the call's text was held back, not streamed as content
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function is not None
    assert deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments or "") == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_leaves_text(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=ADAPTER,
        messages=[{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=64,
    )
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert "<tool_call>" in (answer.choices[0].message.content or "")


def test_agents_sdk_loop(gateway: ServerProcess, trained: int) -> None:
    agents.set_tracing_disabled(True)

    async def run() -> agents.RunResult:
        async with async_openai_client(gateway, KEY_A) as plain:
            client = plain.with_options(default_headers={EPISODE_HEADER: "weather-run-1"})  # every turn captured
            model = agents.OpenAIChatCompletionsModel(model=ADAPTER, openai_client=client)
            agent = agents.Agent(
                name="weather",
                model=model,
                tools=[get_weather],
                model_settings=agents.ModelSettings(temperature=0, max_tokens=64),
            )
            return await agents.Runner.run(agent, QUESTION, max_turns=4)

    calls_made.clear()
    result = asyncio.run(run())
    assert calls_made == ["Paris"]
    assert result.final_output == ANSWER
    assert len(result.raw_responses) == 2  # the turn that called the tool, the turn that answered
    # The whole agent run is one captured episode: both turns, on the exact version, and the second turn's prompt
    # (the Agents SDK re-sent the history with the tool's result) extends the first turn's prompt + completion.
    episode = EpisodeClient(base_url(gateway), KEY_A).get("weather-run-1")
    assert [turn.model for turn in episode.turns] == [f"{ADAPTER}@{trained}"] * 2
    assert [turn.finish_reason for turn in episode.turns] == ["tool_calls", "stop"]
    first, second = episode.turns
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.token_ids)] == (
        first.prompt_token_ids + first.token_ids
    )
    assert episode.mismatches == 0 and len(episode.segments) == 1
