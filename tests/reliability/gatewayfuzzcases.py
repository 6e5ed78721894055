"""Tables and HTTP helpers of the gateway's fuzz tests (test_fuzz_gateway.py): the routes fuzzed and how many
examples each gets, the /v1 templates, the adversarial values, and the state the fuzz fixture hands the tests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import httpx
from serverproc import ServerProcess
from tinker.proto import tinker_public_pb2 as tpb

KEY_A, KEY_B = "tml-fuzz-team-a", "tml-fuzz-team-b"
MiB = 1 << 20
MAX_BODY = 4 * MiB
POST_ROUTES = (
    "client/config",
    "client/dynamic_config",
    "create_session",
    "session_heartbeat",
    "sessions/{session}/finish",
    "retrieve_future",
    "cancel_future",
    "telemetry",
    "create_model",
    "get_info",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_sampling_session",
    "asample",
)
GET_ROUTES = ("healthz", "get_server_capabilities", "samplers/{sampler}")
ONE_CHECKPOINT = "training_runs/{run}/checkpoints/{segment}/{name}"
# The RestClient's routes and their methods (GET and DELETE without a body).
REST_ROUTES = {
    "training_runs": ("GET",),
    "training_runs/{run}": ("GET",),
    "training_runs/{run}/checkpoints": ("GET",),
    "checkpoints": ("GET",),
    ONE_CHECKPOINT: ("GET", "DELETE"),
    f"{ONE_CHECKPOINT}/ttl": ("PUT",),
    f"{ONE_CHECKPOINT}/publish": ("POST", "DELETE"),
    "weights_info": ("POST",),
}
QUERIES = [
    "",
    "?limit=5",
    "?limit=0",
    "?limit=-1",
    "?limit=99999999999999999999",
    "?offset=3&limit=2",
    "?access_scope=accessible",
    "?access_scope=x",
    "?limit=abc",
    "?offset=-4",
]
EXAMPLES = {route: 40 for route in (*POST_ROUTES, *GET_ROUTES, *REST_ROUTES)} | {
    "forward_backward": 80,
    "asample": 70,
    "create_model": 50,
    "healthz": 10,
    "client/dynamic_config": 15,
    "telemetry": 15,
    "get_server_capabilities": 10,
}
# The OpenAI-compatible surface (/v1): its routes and methods; errors in OpenAI's JSON instead of the tinker one.
V1_ROUTES = {
    "models": ("GET",),
    "models/{model}": ("GET",),
    "chat/completions": ("POST",),
    "completions": ("POST",),
    "episodes": ("GET",),
    "episodes/{episode}": ("GET", "DELETE"),
    "episodes/{episode}/reward": ("POST",),
}
V1_EXAMPLES = {route: 30 for route in V1_ROUTES} | {"chat/completions": 60, "completions": 50}
V1_TEMPLATES: dict[str, dict[str, object]] = {
    "chat/completions": {
        "model": "base",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 1.0,
        "seed": 5,
        "stop": ["x"],
        "return_token_ids": True,
        "metadata": {"episode_id": "fuzz-1"},
        "stream": False,
    },
    "completions": {"model": "base", "prompt": [1, 2, 3], "max_tokens": 3, "n": 2, "logprobs": 1, "stream": True},
    "episodes/{episode}/reward": {"reward": 1.0, "turn": 0},
}

HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63, 2**64, 2**70, 10**30, -(2**63) - 1, -(2**70), -1, 0, 1, 64, 65, 10**7]
FLOATS = [1e12, 1e20, 1e39, 1e300, -1e300, 0.5, -0.0, 1e-320, 3.4e38, 2.5]
STRINGS = [
    "",
    " ",
    "\n",
    "a\nb",
    "\x00",
    "\x1b[2J",
    "\u2028",
    "é",
    "\U0001f600",
    "../x",
    "tinker://",
    "tinker://x/weights/y",
    "base",
    "0.38.0",
    "cross_entropy",
    "adamw",
    "snapshot",
    "x" * 5000,
    "%s%n",
    "null",
    "NaN",
]


@dataclass
class Fuzz:
    server: ServerProcess
    http: httpx.Client
    known: dict[str, str]  # session, model, sampler, state, weights, request
    templates: dict[str, object]


@dataclass
class Tally:
    """The cases the fuzz tests of this module sent (by route) and the statuses they got: each test asserts on the
    cases it sent itself; the module's totals go to the run's summary."""

    counts: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)


def _post(http: httpx.Client, route: str, body: object, key: str = KEY_A) -> httpx.Response:
    return http.post(f"/api/v1/{route}", json=body, headers={"X-API-Key": key})


def _result(http: httpx.Client, request_id: str) -> dict[str, object]:
    while True:
        body = _post(http, "retrieve_future", {"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return dict(body)


def _fwdbwd(model_id: str, seq_id: int) -> bytes:
    message = tpb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = bytes(4 * 3)
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype, target.dense = tpb.DTYPE_INT64, bytes(8 * 3)
    target.shape.append(3)
    return bytes(message.SerializeToString())
