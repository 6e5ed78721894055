"""Helpers for sampler tests: requests, collected streams, trained snapshots and peft references."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from trainerutil import Trainer, create, lora, model_input, random_tokens, sft_batch, train_step

from opentinker.v1 import registry_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2

Sampler = sampler_pb2_grpc.SamplerServiceStub
TOL = 1e-4


def params(
    *,
    temperature: float = 0.0,
    max_tokens: int = 12,
    seed: int | None = None,
    top_p: float = 0.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> sampler_pb2.SamplingParams:
    """Greedy, 12 tokens unless told otherwise."""
    return sampler_pb2.SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=list(stop_token_ids),
        stop_strings=list(stop_strings),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def request(
    model: str, prompt: Sequence[int], sampling: sampler_pb2.SamplingParams | None = None, **fields: Any
) -> sampler_pb2.SampleRequest:
    return sampler_pb2.SampleRequest(
        model=model, prompt=model_input(prompt), sampling_params=sampling or params(), **fields
    )


@dataclass
class Sample:
    """One sample of a stream, reassembled from its messages."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    stop_reason: int = sampler_pb2.STOP_REASON_UNSPECIFIED
    prompt_logprobs: list[float] = field(default_factory=list)
    messages: int = 0
    top_logprobs: list[sampler_pb2.TopLogprobs] = field(default_factory=list)  # one per token when asked


@dataclass
class Result:
    samples: dict[int, Sample]
    versions: list[tuple[str, int]]  # (adapter, version) named by every message, in order
    finished_at: float = 0.0

    @property
    def only(self) -> Sample:
        assert len(self.samples) == 1, self.samples.keys()
        return self.samples[0]


def collect(messages: Iterable[sampler_pb2.SampleResponse], first: sampler_pb2.SampleResponse | None = None) -> Result:
    result = Result({}, [])
    for index, message in enumerate(_chain(first, messages)):
        sample = result.samples.setdefault(message.sample_index, Sample())
        if sample.messages == 0:
            assert message.prompt_tokens > 0
            sample.prompt_logprobs = list(message.prompt_logprobs)
        else:
            assert not message.prompt_logprobs, f"prompt logprobs on message {index}"
        assert sample.stop_reason == sampler_pb2.STOP_REASON_UNSPECIFIED, "a message after the sample's last one"
        sample.messages += 1
        sample.tokens.extend(message.tokens)
        sample.logprobs.extend(message.logprobs)
        assert len(message.top_logprobs) in (0, len(message.tokens)), "top logprobs not one per token"
        sample.top_logprobs.extend(message.top_logprobs)
        sample.text += message.text
        sample.stop_reason = message.stop_reason
        result.versions.append((message.version.adapter, message.version.version))
    result.finished_at = time.monotonic()
    assert all(s.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED for s in result.samples.values())
    return result


def _chain(
    first: sampler_pb2.SampleResponse | None, rest: Iterable[sampler_pb2.SampleResponse]
) -> Iterable[sampler_pb2.SampleResponse]:
    if first is not None:
        yield first
    yield from rest


def run(sampler: Sampler, req: sampler_pb2.SampleRequest) -> Result:
    return collect(sampler.Sample(req, timeout=60))


def greedy(sampler: Sampler, model: str, prompt: Sequence[int], max_tokens: int = 12) -> list[int]:
    return run(sampler, request(model, prompt, params(max_tokens=max_tokens))).only.tokens


def score(sampler: Sampler, model: str, *inputs: Sequence[int]) -> list[list[float]]:
    response: sampler_pb2.ComputeLogprobsResponse = sampler.ComputeLogprobs(
        sampler_pb2.ComputeLogprobsRequest(model=model, inputs=[model_input(t) for t in inputs]), timeout=60
    )
    return [list(r.logprobs) for r in response.results]


def max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def prompt(seed: int, length: int = 8) -> list[int]:
    return random_tokens(10_000 + seed, length)


def snapshot(trainer: Trainer, name: str, *, skip_latest: bool = False) -> registry_pb2.Version:
    request = trainer_pb2.SaveSnapshotRequest(adapter=name, skip_latest=skip_latest)
    response: trainer_pb2.SaveSnapshotResponse = trainer.SaveSnapshot(request)
    return response.version


def train(trainer: Trainer, name: str, seed: int, steps: int) -> None:
    for step in range(steps):
        train_step(trainer, name, sft_batch(seed=seed * 100 + step, count=2, length=14))


def trained_adapter(
    trainer: Trainer, seed: int, *, rank: int = 4, alpha: float = 16.0, steps: int = 3, lr: float = 5e-2
) -> tuple[str, registry_pb2.Version]:
    """A fresh adapter trained `steps` steps on its own data, published as version 1."""
    name = create(trainer, seed=seed, config=lora(rank=rank, alpha=alpha), lr=lr).name
    train(trainer, name, seed, steps)
    return name, snapshot(trainer, name)


def artifact_path(store: Path, version: registry_pb2.Version) -> Path:
    return store / "sha256" / version.artifact_sha256


def loaded(sampler: Sampler) -> dict[str, sampler_pb2.LoadedAdapter]:
    response: sampler_pb2.ListLoadedResponse = sampler.ListLoaded(sampler_pb2.ListLoadedRequest())
    return {f"{a.version.adapter}@{a.version.version}": a for a in response.adapters}


def stats(sampler: Sampler) -> sampler_pb2.GetStatsResponse:
    response: sampler_pb2.GetStatsResponse = sampler.GetStats(sampler_pb2.GetStatsRequest())
    return response


def wait_until(condition: Callable[[], bool], timeout: float = 5.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class PeftReference:
    """A transformers base model with one peft adapter at a time: the oracle for greedy tokens and logprobs."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = model_dir
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self.eos: int = self.tokenizer.eos_token_id

        def base() -> Any:
            model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            return model.eval()

        self._base = base

    def model(self, artifact: Path | None) -> Any:
        from peft import PeftModel

        if artifact is None:
            return self._base()
        return PeftModel.from_pretrained(self._base(), str(artifact)).eval()

    def greedy(self, model: Any, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """peft's greedy continuation, ending after an end-of-sequence token like the sampler's."""
        with torch.no_grad():
            out = model.generate(
                torch.tensor([list(prompt)]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.eos,
                eos_token_id=self.eos,
            )
        tokens: list[int] = out[0, len(prompt) :].tolist()
        return tokens[: tokens.index(self.eos) + 1] if self.eos in tokens else tokens

    def logprobs(self, model: Any, tokens: Sequence[int]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([list(tokens)])).logits[0].float()  # [L, V]
        targets = torch.tensor(list(tokens[1:]))
        result: list[float] = logits[:-1].log_softmax(-1).gather(1, targets[:, None]).squeeze(1).tolist()
        return result


Outputs = list[dict[int, list[int]]]  # per request of a workload: sample index -> tokens


def seeded_samples(sampler: Sampler, metadata: list[tuple[str, str]]) -> Outputs:
    """team-b's normal traffic in the two-tenant tests: seeded samples (n=2) of its adapter team-b/policy@1 and
    one of the base model, one after another."""
    requests = [
        request("team-b/policy@1", prompt(10 + i), params(temperature=1.0, seed=100 + i, max_tokens=10), num_samples=2)
        for i in range(3)
    ]
    requests.append(request("base", prompt(20), params(temperature=0.8, seed=7, max_tokens=10), num_samples=2))
    outputs: Outputs = []
    for req in requests:
        result = collect(sampler.Sample(req, metadata=metadata, timeout=120))
        outputs.append({i: s.tokens for i, s in result.samples.items()})
    return outputs
