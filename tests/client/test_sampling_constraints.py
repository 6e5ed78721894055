"""The SDK's constraints (client/constraints.py) against the session sampler: a pydantic model class as
JsonSchema, on the base and on a trained adapter in one process, a Regex and a Lark Grammar; every sample
validates on random weights; a constrained sample cut by max_tokens says "length"."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from petschema import Pet
from registryutil import unique_name
from serverproc import ServerProcess
from trainerutil import Trainer, create, lora, sft_batch, train_step

from opentinker.client import Grammar, JsonObject, JsonSchema, Regex, SamplingParams, ServiceClient
from opentinker.v1 import trainer_pb2

PROMPT = (17, 3, 250, 99, 41, 7)


@pytest.fixture(scope="module")
def service(sampler_server: ServerProcess) -> Iterator[ServiceClient]:
    with ServiceClient(sampler=sampler_server.address) as client:
        yield client


@pytest.fixture(scope="module")
def tuned(trainer: Trainer) -> str:
    name = unique_name("sdk-constrained")
    create(trainer, name, config=lora(rank=4), seed=5)
    train_step(trainer, name, sft_batch(1))
    trainer.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=name))
    return name


def test_a_pydantic_model_validates_on_the_base_and_an_adapter(service: ServiceClient, tuned: str) -> None:
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=4, constraint=JsonSchema(Pet))
    for reference in ("base", tuned):
        result = service.create_sampling_client(reference).sample(PROMPT, params, num_samples=6)
        assert len(result.sequences) == 6
        for seq in result.sequences:
            assert seq.stop_reason == "stop_token", seq.text
            Pet.model_validate_json(seq.text)  # raises on an invalid object


def test_regex_grammar_json_object_and_a_cut(service: ServiceClient) -> None:
    base = service.create_sampling_client("base")
    regex = base.sample(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=1, constraint=Regex(r"[xyz]{3}!")))
    assert re.fullmatch(r"[xyz]{3}!", regex.sequences[0].text)
    lark = Grammar('start: "answer: " ("yes" | "no")')
    assert base.sample(PROMPT, SamplingParams(max_tokens=30, constraint=lark)).sequences[0].text in (
        "answer: yes",
        "answer: no",
    )
    obj = base.sample(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=2, constraint=JsonObject()))
    (cut,) = obj.sequences
    assert cut.stop_reason == "length" and cut.text.startswith("{") and len(cut.tokens) == 4
    with pytest.raises(TypeError):
        JsonSchema(42)  # type: ignore[arg-type]
