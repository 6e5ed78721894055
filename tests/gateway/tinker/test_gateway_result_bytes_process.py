"""A real gateway process with a small --max-tenant-result-bytes: team-a piles up finished results it never
retrieves and loses its own oldest ones (404 RESULT_DROPPED, not retried, naming the flag) while team-b's results,
finished before the pile-up and retrieved after it, are all there; JSON bodies big enough to be parsed on a worker
thread get the same answers as small ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from gatewayutil import KEY_A, KEY_B, base_url
from serverproc import ServerProcess
from tinker import types

RESULT_BYTES = 20_000  # ~18 small results (each counts its bytes plus 1 KiB)
GATEWAY_FLAGS = ("--max-tenant-result-bytes", str(RESULT_BYTES))
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def http(gateway: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(gateway), timeout=60) as client:
        yield client


def post(http: httpx.Client, route: str, body: object, key: str) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(f"/api/v1/{route}", content=raw, headers={"X-API-Key": key, "Content-Type": "application/json"})


def asample(tiny_model: Path, seed: int, **extra: object) -> dict[str, object]:
    return {
        "base_model": str(tiny_model),
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": seed},
        **extra,
    }


def retrieve(http: httpx.Client, request_id: str, key: str) -> httpx.Response:
    while True:
        reply = post(http, "retrieve_future", {"request_id": request_id}, key)
        if reply.status_code != 200 or reply.headers["content-type"].startswith("application/x-protobuf"):
            return reply
        if reply.json().get("type") != "try_again":
            return reply


def team_b_tokens(gateway: ServerProcess, tiny_model: Path) -> list[list[int]]:
    service = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_B)
    try:
        sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
        result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
        return [list(s.tokens) for s in result.sequences]
    finally:
        service.close("success").result()


def test_a_tenant_piling_up_results_loses_only_its_own_oldest(
    gateway: ServerProcess, http: httpx.Client, tiny_model: Path
) -> None:
    alone = team_b_tokens(gateway, tiny_model)
    team_b = [post(http, "asample", asample(tiny_model, seed), KEY_B).json()["request_id"] for seed in range(3)]
    # team-a: 60 requests that fail at once (an unsupported field): ~1.1 KB of result each, never retrieved.
    team_a = []
    for seed in range(60):
        reply = post(http, "asample", asample(tiny_model, seed, topk_prompt_logprobs=1), KEY_A)
        assert reply.status_code == 200, reply.text
        team_a.append(reply.json()["request_id"])
    newest = retrieve(http, team_a[-1], KEY_A)  # the tasks finish in order: every older one has finished
    assert newest.status_code == 200 and "not supported" in newest.json()["error"], newest.text
    dropped = retrieve(http, team_a[0], KEY_A)
    assert dropped.status_code == 404 and dropped.headers["x-should-retry"] == "false", dropped.text
    assert dropped.json()["error"] == "RESULT_DROPPED" and "--max-tenant-result-bytes" in dropped.json()["detail"]
    kept = [retrieve(http, request_id, KEY_A).status_code for request_id in team_a]
    failure = len("topk_prompt_logprobs is not supported by this server") + 1024  # the bytes each result counts
    assert kept == [404] * (60 - RESULT_BYTES // failure) + [200] * (RESULT_BYTES // failure), kept  # 42, then 18
    for request_id in team_b:  # team-b's results are untouched by team-a's pile-up
        reply = retrieve(http, request_id, KEY_B)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/x-protobuf")
    assert post(http, "retrieve_future", {"request_id": team_a[0]}, KEY_B).json()["error"] == "UNKNOWN_REQUEST"
    assert team_b_tokens(gateway, tiny_model) == alone


def test_json_bodies_parsed_on_a_thread_get_the_answers_of_small_ones(http: httpx.Client, tiny_model: Path) -> None:
    padding = " " * (200 << 10)  # past the 64 KiB parsed inline
    cases = [
        json.dumps(asample(tiny_model, 1, num_samples=10_000_000)),
        json.dumps(asample(tiny_model, 1)).replace('"seed": 1', '"seed": NaN'),
        "[" * 100_000 + "]" * 100_000,
        json.dumps(asample(tiny_model, 1, base_model="m" * 5000)),
    ]
    for text in cases:
        small, big = (
            post(http, "asample", text.encode(), KEY_A),
            post(http, "asample", (text + padding).encode(), KEY_A),
        )
        assert small.status_code == big.status_code == 400, (small.text, big.text)
        # The same answer (each has its own request id).
        assert {**small.json(), "request_id": ""} == {**big.json(), "request_id": ""}
        assert big.headers["x-should-retry"] == "false"
    ok = post(http, "asample", (json.dumps(asample(tiny_model, 2)) + padding).encode(), KEY_B)
    assert ok.status_code == 200, ok.text
    assert retrieve(http, ok.json()["request_id"], KEY_B).status_code == 200
