"""Bodies of POST /v1/chat/completions and /v1/completions, checked into typed records.

Fields OpenAI defines that do not change what is sampled (user, service_tier, store...) are ignored, as OpenAI
ignores unknown ones. One that would change it but is not implemented is refused rather than dropped, so that no
client believes it got what it asked for: a non-empty ``logit_bias``. ``response_format`` and ``tool_choice`` are
read by structured.py (what they force is built into the sampler's grammar). A field of the wrong type, out of
range or refused is a 400 naming it (``param``).

``cache_salt`` (vLLM's; the openai SDK sends it with ``extra_body``): requests with different salts share no
prefix-cache blocks on the sampler, even within one tenant; a non-empty string of at most 256 UTF-8 bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass

from opentinker.gateway.openai.body_fields import Body, boolean, integer, number, obj, string, type_name
from opentinker.gateway.openai.errors import invalid
from opentinker.gateway.openai.structured import ResponseFormat, ToolChoice, response_format, tool_choice

Message = dict[str, object]  # one chat message as the tokenizer's chat template takes it

UINT64 = 1 << 64
INT32_MAX = 2**31 - 1
MAX_STOP = 16  # the sampler's bound on stop strings
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (chat); completions allow 5
MAX_MESSAGES = 4096
MAX_PROMPTS = 64
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_PENALTY = 2.0  # OpenAI's bound on frequency_penalty and presence_penalty (either sign)
MAX_CACHE_SALT_BYTES = 256  # the sampler's bound on cache_salt (UTF-8 bytes)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """What both endpoints sample with. ``max_tokens`` None: the rest of the context."""

    max_tokens: int | None
    temperature: float
    top_p: float
    frequency_penalty: float  # OpenAI's, over each choice's own output so far; 0: off
    presence_penalty: float
    stop: tuple[str, ...]
    n: int
    seed: int | None  # as the sampler takes it: a uint64 (a negative OpenAI seed wraps)
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    cache_salt: str = ""  # the sampler's prefix-cache salt; "": none


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]  # template-ready: text content, tool_calls arguments as objects
    tools: tuple[dict[str, object], ...]  # OpenAI function tools, passed to the chat template as given
    tool_choice: ToolChoice
    response_format: ResponseFormat
    template_kwargs: dict[str, object]  # vLLM's chat_template_kwargs (e.g. enable_thinking)
    options: SamplingOptions
    metadata_episode: str | None  # metadata.episode_id, unchecked (records.episode_id checks it)


Prompt = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompts: tuple[Prompt, ...]  # at least one: a text or token ids each
    options: SamplingOptions
    response_format: ResponseFormat
    metadata_episode: str | None


def _stop(body: Body) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or an array of non-empty strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' holds {len(stops)} strings; at most {MAX_STOP}", "stop")
    return tuple(dict.fromkeys(stops))


def _metadata_episode(body: Body) -> str | None:
    metadata = obj(body, "metadata")
    episode = metadata.get("episode_id")
    if episode is not None and not isinstance(episode, str):
        raise invalid("'metadata.episode_id' must be a string", "metadata.episode_id", "invalid_type")
    return episode


def _top_p(body: Body) -> float:
    # vLLM's rule: top_p 0 would be an empty nucleus. Greedy decoding is temperature 0; a 400 says so instead of
    # quietly sampling something else.
    if body.get("top_p") == 0 and not isinstance(body.get("top_p"), bool):
        raise invalid("'top_p' must be in (0, 1], got 0; for greedy decoding set 'temperature' to 0", "top_p")
    return number(body, "top_p", 1e-9, 1.0, 1.0)


def _logit_bias(body: Body) -> None:
    value = body.get("logit_bias")
    if value is None or value == {}:
        return
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object", "logit_bias", "invalid_type")
    raise invalid("'logit_bias' is not supported (only an empty object is accepted)", "logit_bias", "unsupported_value")


def _cache_salt(body: Body) -> str:
    """vLLM's rule: absent or null is no salt; present, a non-empty string (here also at most the sampler's 256
    UTF-8 bytes, checked before anything is sampled)."""
    salt = string(body, "cache_salt")
    if salt is None:
        return ""
    if not salt:
        raise invalid("'cache_salt' must be a non-empty string if provided", "cache_salt")
    size = len(salt.encode())  # a lone surrogate never gets here: bodies.check_json refused the body
    if size > MAX_CACHE_SALT_BYTES:
        raise invalid(f"'cache_salt' is {size:,} UTF-8 bytes; at most {MAX_CACHE_SALT_BYTES}", "cache_salt")
    return salt


def options(body: Body, max_num_samples: int, *, logprobs: bool, top_logprobs: int) -> SamplingOptions:
    """The sampling fields common to both endpoints (logprobs are read by each: their forms differ)."""
    max_tokens = integer(body, "max_completion_tokens", 1, INT32_MAX)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1, INT32_MAX)
    seed = integer(body, "seed", -(UINT64 // 2), UINT64 - 1)
    n = integer(body, "n", 1, max_num_samples)
    stream = boolean(body, "stream")
    stream_options = obj(body, "stream_options")
    _logit_bias(body)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_top_p(body),
        frequency_penalty=number(body, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY, 0.0),
        presence_penalty=number(body, "presence_penalty", -MAX_PENALTY, MAX_PENALTY, 0.0),
        stop=_stop(body),
        n=1 if n is None else n,
        seed=None if seed is None else seed % UINT64,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=stream,
        include_usage=stream and boolean(stream_options, "include_usage"),
        return_token_ids=boolean(body, "return_token_ids"),
        cache_salt=_cache_salt(body),
    )


# Chat messages


def _text(content: object, where: str) -> str:
    """A message's content as the template's string: a string, or the concatenated text of its text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise invalid(f"'{where}.content[{i}]': only text content parts are supported", f"{where}.content")
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{where}.content[{i}].text' must be a string", f"{where}.content", "invalid_type")
            texts.append(text)
        return "".join(texts)
    raise invalid(f"'{where}.content' must be a string or an array of text parts", f"{where}.content", "invalid_type")


def _tool_call(raw: object, where: str) -> dict[str, object]:
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise invalid(f"'{where}' must be a function tool call object", where, "invalid_type")
    function = obj(raw, "function", where=f"{where}.")
    name = string(function, "name", where=f"{where}.function.", required=True)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:  # templates render arguments with tojson: an object, not a JSON string inside a string
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    elif not isinstance(arguments, dict):
        raise invalid(
            f"'{where}.function.arguments' must be a JSON string", f"{where}.function.arguments", "invalid_type"
        )
    call: dict[str, object] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    call_id = string(raw, "id", where=f"{where}.")
    if call_id is not None:
        call["id"] = call_id
    return call


def message(raw: object, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise invalid(f"'{where}' must be an object, got {type_name(raw)}", "messages", "invalid_type")
    role = raw.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or object role is unhashable: no set lookup
        raise invalid(f"'{where}.role' must be one of {', '.join(sorted(ROLES))}, got {role!r}"[:300], "messages")
    assert isinstance(role, str)
    out: Message = {"role": "system" if role == "developer" else role}
    content = raw.get("content")
    calls = raw.get("tool_calls")
    if role == "assistant" and calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"'{where}.tool_calls' must be an array", f"{where}.tool_calls", "invalid_type")
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    if content is None and role != "assistant":
        raise invalid(
            f"'{where}.content' is required for role {role}", f"{where}.content", "missing_required_parameter"
        )
    out["content"] = "" if content is None else _text(content, where)
    for name in ("name", "reasoning_content"):
        value = string(raw, name, where=f"{where}.")
        if value is not None:
            out[name] = value
    if role == "tool":
        out["tool_call_id"] = string(raw, "tool_call_id", where=f"{where}.", required=True)
    return out


def _tools(body: Body) -> tuple[dict[str, object], ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array", "tools", "invalid_type")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(f"'tools[{i}]' must be {{'type': 'function', 'function': {{...}}}}", "tools", "invalid_type")
        function = obj(tool, "function")
        string(function, "name", where=f"tools[{i}].function.", required=True)
        string(function, "description", where=f"tools[{i}].function.")
        obj(function, "parameters", where=f"tools[{i}].function.")
    return tuple(tools)


def _model(body: Body) -> str:
    model = string(body, "model", required=True)
    assert model is not None
    if not model:
        raise invalid("'model' must not be empty", "model")
    return model


def chat_request(body: Body, max_num_samples: int) -> ChatRequest:
    model = _model(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty array", "messages", "invalid_type")
    if len(raw) > MAX_MESSAGES:
        raise invalid(f"'messages' holds {len(raw)} messages; at most {MAX_MESSAGES}", "messages")
    messages = tuple(message(m, i) for i, m in enumerate(raw))
    want_logprobs = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not want_logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    tools = _tools(body)
    choice, shape = tool_choice(body, tools), response_format(body)
    sampling = options(body, max_num_samples, logprobs=want_logprobs, top_logprobs=top)
    _check_stop(sampling, forced=choice.forced or shape.kind != "text")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        response_format=shape,
        template_kwargs=obj(body, "chat_template_kwargs"),
        options=sampling,
        metadata_episode=_metadata_episode(body),
    )


def _token_ids(values: list[object], where: str) -> tuple[int, ...]:
    if not values or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in values):
        raise invalid(f"'{where}' token ids must be a non-empty array of integers in 0..{INT32_MAX}", "prompt")
    return tuple(t for t in values if isinstance(t, int))


def _prompts(body: Body) -> tuple[Prompt, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, str)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [_token_ids(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        raise invalid(
            "'prompt' must be a string, an array of strings, an array of token ids or an array of such "
            "arrays (non-empty)",
            "prompt",
            "invalid_type",
        )
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS}", "prompt")
    if any(p == "" for p in prompts):
        raise invalid("'prompt' must not be empty", "prompt")
    return tuple(prompts)


def completion_request(body: Body, max_num_samples: int) -> CompletionRequest:
    model = _model(body)
    prompts = _prompts(body)
    if boolean(body, "echo"):
        raise invalid("'echo' is not supported", "echo", "unsupported_parameter")
    if string(body, "suffix"):
        raise invalid("'suffix' is not supported", "suffix", "unsupported_parameter")
    top = integer(body, "logprobs", 0, 5)
    sampling = options(body, max_num_samples, logprobs=top is not None, top_logprobs=top or 0)
    if len(prompts) * sampling.n > max_num_samples:
        raise invalid(f"{len(prompts)} prompts x n={sampling.n} exceeds {max_num_samples} samples per request", "n")
    shape = response_format(body)
    _check_stop(sampling, forced=shape.kind != "text")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        options=sampling,
        response_format=shape,
        metadata_episode=_metadata_episode(body),
    )


def _check_stop(sampling: SamplingOptions, *, forced: bool) -> None:
    """A stop string could cut a forced shape where its grammar may not end (the sampler refuses the pair too)."""
    if forced and sampling.stop:
        raise invalid(
            "'stop' cannot be combined with a forced output ('response_format' json_object / json_schema, or "
            "'tool_choice' required / a named function): a stop string could cut it where it may not end",
            "stop",
        )
