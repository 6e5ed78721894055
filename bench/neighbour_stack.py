"""The stack bench/noisy_neighbours.py runs on: a registry, a trainer, a sampler and a gateway in front of them, each
in its own process with tokens for team-a, team-b and the servers' own admin principal; what a client process needs
to reach them (gRPC stubs, the gateway's HTTP routes); and the tenants' adapters."""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from stack import stop_servers
from workload import ALPHA, RANK, ModelSpec, linear_shapes, lora_weights, peft_files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' artifact builders

from overflowutil import overflowing_lora_files
from registryutil import upload
from trainerutil import random_tokens

from opentinker.cli.launch import ServerProcess, opentinker_command, start_registry, start_sampler, start_trainer
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc


@dataclass
class Clients:
    """What a client process needs to reach the stack (picklable: team-a's abuse runs in processes of its own, so
    that its Python work does not take the GIL from team-b's timed calls)."""

    registry: str
    trainer: str
    sampler: str
    tokens: dict[str, str]  # principal -> token
    gateway: str = ""  # the gateway's http://host:port
    keys: dict[str, str] | None = None  # tenant -> the gateway API key
    base_model: str = ""  # what an asample through the gateway names

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, timeout=120)

    def post(
        self,
        http: httpx.Client,
        who: str,
        route: str,
        body: bytes | dict[str, object],
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        assert self.keys is not None
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"X-API-Key": self.keys[who], "Content-Type": "application/json", **(headers or {})}
        return http.post(f"/api/v1/{route}", content=content, headers=sent)

    def md(self, who: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.tokens[who]}")]

    def stubs(
        self,
    ) -> tuple[
        registry_pb2_grpc.RegistryServiceStub, trainer_pb2_grpc.TrainerServiceStub, sampler_pb2_grpc.SamplerServiceStub
    ]:
        """Stubs on fresh channels (each caller its own, as separate clients would); they live as long as the
        process."""
        options = [("grpc.max_send_message_length", 64 << 20)]
        channels = [grpc.insecure_channel(a, options=options) for a in (self.registry, self.trainer, self.sampler)]
        return (
            registry_pb2_grpc.RegistryServiceStub(channels[0]),
            trainer_pb2_grpc.TrainerServiceStub(channels[1]),
            sampler_pb2_grpc.SamplerServiceStub(channels[2]),
        )


def asample_body(clients: Clients, seed: int, **extra: object) -> dict[str, object]:
    return {
        "base_model": clients.base_model,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": random_tokens(seed, 24)}]},
        "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": seed},
        **extra,
    }


def result(clients: Clients, http: httpx.Client, who: str, request_id: str) -> httpx.Response:
    """retrieve_future until the result is there."""
    while True:
        reply = clients.post(http, who, "retrieve_future", {"request_id": request_id})
        if reply.status_code != 200 or reply.headers["content-type"].startswith("application/x-protobuf"):
            return reply
        if reply.json().get("type") != "try_again":
            return reply


@dataclass
class Stack:
    registry_server: ServerProcess
    trainer_server: ServerProcess
    sampler_server: ServerProcess
    gateway_server: ServerProcess
    clients: Clients

    def stop(self) -> None:
        stop_servers((self.gateway_server, self.sampler_server, self.trainer_server, self.registry_server))


def start(work: Path, model: Path, sampler_args: tuple[str, ...] = ()) -> Stack:
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in ("team-a", "team-b", "svc")}
    roles = {"team-a": "user", "team-b": "user", "svc": "admin"}
    entries = [{"token": t, "tenant": who, "role": roles[who]} for who, t in tokens.items()]
    tokens_file = work / "tokens.json"
    tokens_file.write_text(json.dumps({"tokens": entries}))
    auth = ("--tokens-file", str(tokens_file))
    registry = start_registry(work / "registry", *auth)
    service = (*auth, "--registry-token", tokens["svc"])
    trainer = start_trainer(work / "trainer", model, registry, *service)
    sampler = start_sampler(work / "sampler", model, registry, *service, "--max-slots", "4", *sampler_args)
    keys = {who: f"tml-{who}-{secrets.token_hex(8)}" for who in ("team-a", "team-b")}
    keys_file = work / "keys.json"
    keys_file.write_text(
        json.dumps({"keys": [{"key": k, "tenant": who, "token": tokens[who]} for who, k in keys.items()]})
    )
    gateway = ServerProcess(
        opentinker_command(
            "gateway",
            "serve",
            "--trainer",
            trainer.address,
            "--sampler",
            sampler.address,
            "--registry",
            registry.address,
            "--keys-file",
            str(keys_file),
            "--port",
            "0",
            *GATEWAY_FLAGS,
        ),
        work / "gateway",
    )
    clients = Clients(
        registry.address, trainer.address, sampler.address, tokens, f"http://{gateway.address}", keys, str(model)
    )
    return Stack(registry, trainer, sampler, gateway, clients)


# The parked-bodies case reaches its bounds within a window: 16 ids ahead, 64 MiB per model, 128 MiB per tenant,
# parked bodies failed after 5 s (the defaults: 256, 256 MiB, 1 GiB, 300 s).
GATEWAY_FLAGS = (
    "--seq-window",
    "16",
    "--max-pending-bytes",
    str(64 << 20),
    "--max-tenant-pending-bytes",
    str(128 << 20),
    "--pending-ttl-seconds",
    "5",
)


def prepare(stack: Clients, model: Path, spec: ModelSpec) -> None:
    """team-b's adapter in the registry (random weights) and on the trainer; team-a's exploding adapter."""
    registry, trainer, _ = stack.stubs()
    policies = {
        "team-b/policy": (peft_files(lora_weights(linear_shapes(spec), seed=5)), RANK, float(ALPHA)),
        "team-a/exploding": (overflowing_lora_files(model), 4, 4096.0),
    }
    for name, (files, rank, alpha) in policies.items():
        md = stack.md(name.split("/")[0])
        lora = common_pb2.LoraConfig(rank=rank, alpha=alpha)
        registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name, lora_config=lora), metadata=md, timeout=60)
        uri = upload(registry, files, metadata=md, timeout=60)
        publish = registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=uri, lora_config=lora)
        registry.PublishVersion(publish, metadata=md, timeout=60)
    for tenant in ("team-a", "team-b"):
        create = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=f"{tenant}/trained", lora_config=common_pb2.LoraConfig(rank=8)
        )
        trainer.CreateAdapter(create, metadata=stack.md(tenant), timeout=120)
