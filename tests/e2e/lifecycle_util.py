"""Helpers of the lifecycle tests: a registry with tokens (team-a, team-b users; a service admin for the
trainers), trainers started and stopped on it, and the SDK's seeded SFT data."""

from __future__ import annotations

import json
import secrets
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from serverproc import ServerProcess, opentinker_command, registry_store, start_registry, start_trainer
from trainerutil import random_tokens

from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, ServiceClient, TrainingClient

TENANTS = ("team-a", "team-b")
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.1)  # dropout: a resumed RNG must continue the same masks
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


@dataclass
class Stack:
    workdir: Path
    model: Path
    registry: ServerProcess
    tokens: dict[str, str]  # tenant (and "svc") -> token

    @property
    def store(self) -> Path:
        return registry_store(self.registry)

    def start_trainer(self, label: str, *extra: str) -> ServerProcess:
        return start_trainer(
            self.workdir / label,
            self.model,
            self.registry,
            "--tokens-file",
            str(self.workdir / "tokens.json"),
            "--registry-token",
            self.tokens["svc"],
            *extra,
        )

    @contextmanager
    def client(self, trainer: ServerProcess, who: str) -> Iterator[ServiceClient]:
        with ServiceClient(trainer=trainer.address, registry=self.registry.address, token=self.tokens[who]) as c:
            yield c

    def cli(self, who: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`opentinker ARGS --token <who's>`: exit code, stdout and stderr."""
        command = opentinker_command(*args, "--token", self.tokens[who])
        return subprocess.run(command, capture_output=True, text=True, timeout=120)


def start_stack(workdir: Path, model: Path) -> Stack:
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in (*TENANTS, "svc")}
    (workdir / "tokens.json").write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": token, "tenant": who, "role": "admin" if who == "svc" else "user"}
                    for who, token in tokens.items()
                ]
            }
        )
    )
    registry = start_registry(workdir / "registry", "--tokens-file", str(workdir / "tokens.json"))
    return Stack(workdir, model, registry, tokens)


def fresh(who: str, what: str = "chat") -> str:
    return f"{who}/{what}-{uuid.uuid4().hex[:8]}"


def batch(seed: int, count: int = 2, length: int = 12) -> list[Datum]:
    """A seeded SFT batch (next-token targets, loss on every token)."""
    out = []
    for index in range(count):
        tokens = random_tokens(seed * 100 + index, length)
        out.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)},
            )
        )
    return out


PROBE = batch(999)


def train(training: TrainingClient, first: int, last: int) -> list[tuple[float, float]]:
    """Steps first..last-1 on batch(step): (loss, grad norm) of each."""
    out = []
    for step in range(first, last):
        loss = training.forward_backward(batch(step)).loss
        out.append((loss, training.optim_step().metrics["grad_norm:value"]))
    return out


def probe(training: TrainingClient) -> tuple[tuple[float, ...], ...]:
    return training.forward(PROBE).logprobs


def flat(rows: Sequence[Sequence[float]]) -> list[float]:
    return [v for row in rows for v in row]
