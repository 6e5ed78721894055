"""Two tenants on one private registry and sampler: the setup every sampler two-tenant test starts from.

team-a (the abuser) and team-b (the workload that must be unaffected) hold user tokens; `ops` and `svc` (the
sampler's own registry token) are admins. Each test adds its own sampler flags and its own adapters."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from serverproc import ServerProcess, start_registry, start_sampler
from tlsutil import write_tokens

from opentinker.v1 import registry_pb2_grpc, sampler_pb2_grpc

PRINCIPALS = {"team-a": "user", "team-b": "user", "ops": "admin", "svc": "admin"}


@dataclass
class TenantStack:
    registry_server: ServerProcess
    sampler_server: ServerProcess
    tokens: dict[str, str]  # principal -> token
    registry: registry_pb2_grpc.RegistryServiceStub
    sampler: sampler_pb2_grpc.SamplerServiceStub

    def md(self, who: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.tokens[who]}")]


@contextmanager
def tenant_stack(workdir: Path, model: Path, *sampler_args: str) -> Iterator[TenantStack]:
    """A registry and a sampler (with `sampler_args`) in their own processes, each stopped cleanly at the end."""
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in PRINCIPALS}
    tokens_file = write_tokens(workdir / "tokens.json", {tokens[who]: (who, role) for who, role in PRINCIPALS.items()})
    registry_server = start_registry(workdir / "registry", "--tokens-file", str(tokens_file))
    sampler_server = start_sampler(
        workdir / "sampler",
        model,
        registry_server,
        "--tokens-file",
        str(tokens_file),
        "--registry-token",
        tokens["svc"],
        *sampler_args,
    )
    with grpc.insecure_channel(registry_server.address) as reg, grpc.insecure_channel(sampler_server.address) as smp:
        yield TenantStack(
            registry_server,
            sampler_server,
            tokens,
            registry_pb2_grpc.RegistryServiceStub(reg),
            sampler_pb2_grpc.SamplerServiceStub(smp),
        )
    for server in (sampler_server, registry_server):
        assert server.terminate() == 0, server.log()
