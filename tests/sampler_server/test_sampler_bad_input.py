"""Bad input to a real sampler: precise status codes with ErrorInfo reasons, nothing loaded from a corrupt or
unusable artifact, good requests undisturbed by bad ones next to them, adapter management RPCs, and the
limits (waiting queue, adapter slots) of a small second sampler."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from badsampleutil import CONTEXT, INVALID, VOCAB, Published, _sampling, publish_good, sample_error
from registryutil import create_adapter, unique_name, upload
from safetensors.torch import save
from samplerutil import (
    Sampler,
    artifact_path,
    greedy,
    loaded,
    params,
    prompt,
    request,
    run,
    score,
    snapshot,
    stats,
    train,
    trained_adapter,
    wait_until,
)
from serverproc import ServerProcess, registry_store
from trainerutil import Trainer, assert_status, model_input, rpc_error

from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2


@pytest.fixture(scope="module")
def good(trainer: Trainer, sampler: Sampler) -> Published:
    return publish_good(trainer, sampler)


def test_unknown_adapter_or_version_is_not_found(sampler: Sampler, good: Published) -> None:
    cases = [
        (unique_name("nobody"), "ADAPTER_NOT_FOUND"),
        (f"{unique_name('nobody')}@3", "ADAPTER_NOT_FOUND"),
        (f"{good.name}@99", "VERSION_NOT_FOUND"),
        (f"{good.name}@no-such-alias", "ALIAS_NOT_FOUND"),
    ]
    for model, reason in cases:
        assert_status(sample_error(sampler, request(model, [1, 2, 3])), grpc.StatusCode.NOT_FOUND, reason)
        error = rpc_error(score, sampler, model, [1, 2, 3])
        assert_status(error, grpc.StatusCode.NOT_FOUND, reason)
        error = rpc_error(sampler.LoadAdapter, sampler_pb2.LoadAdapterRequest(reference=model))
        assert_status(error, grpc.StatusCode.NOT_FOUND, reason)
    assert not any(key.startswith("nobody") for key in loaded(sampler))


BAD_SAMPLES: dict[str, tuple[Callable[[str], sampler_pb2.SampleRequest], str, str]] = {
    # case: (request for a model reference, reason, words the message must contain)
    "empty prompt": (lambda m: request(m, []), "INVALID_PROMPT", "prompt is empty"),
    "token id = vocab": (lambda m: request(m, [1, VOCAB, 2]), "TOKEN_OUT_OF_RANGE", f"token id {VOCAB}"),
    "negative token id": (lambda m: request(m, [1, -1]), "TOKEN_OUT_OF_RANGE", "token id -1"),
    "max_tokens beyond context": (
        lambda m: request(m, [1, 2, 3], params(max_tokens=CONTEXT)),
        "INVALID_SAMPLING_PARAMS",
        "max_tokens",
    ),
    "prompt fills the context": (lambda m: request(m, [5] * CONTEXT), "PROMPT_TOO_LONG", "context"),
    "temperature < 0": (
        lambda m: request(m, [1], _sampling(temperature=-0.5)),
        "INVALID_SAMPLING_PARAMS",
        "temperature",
    ),
    "temperature nan": (
        lambda m: request(m, [1], _sampling(temperature=math.nan)),
        "INVALID_SAMPLING_PARAMS",
        "temperature",
    ),
    "top_p > 1": (lambda m: request(m, [1], _sampling(top_p=1.5)), "INVALID_SAMPLING_PARAMS", "top_p"),
    "top_p < 0": (lambda m: request(m, [1], _sampling(top_p=-0.2)), "INVALID_SAMPLING_PARAMS", "top_p"),
    "top_logprobs > 20": (
        lambda m: request(m, [1], _sampling(top_logprobs=21)),
        "INVALID_SAMPLING_PARAMS",
        "top_logprobs is 21; at most 20",
    ),
    "stop token outside vocab": (
        lambda m: request(m, [1], _sampling(stop_token_ids=[VOCAB + 5])),
        "INVALID_SAMPLING_PARAMS",
        "stop_token_ids",
    ),
    "empty stop string": (
        lambda m: request(m, [1], _sampling(stop_strings=[""])),
        "INVALID_SAMPLING_PARAMS",
        "stop strings",
    ),
    "num_samples > 64": (lambda m: request(m, [1, 2], num_samples=65), "INVALID_SAMPLING_PARAMS", "num_samples"),
    "bad adapter name": (
        lambda m: sampler_pb2.SampleRequest(model="Not A Name!", prompt=model_input([1])),
        "INVALID_ADAPTER_NAME",
        "invalid adapter name",
    ),
    "version 0": (
        lambda m: sampler_pb2.SampleRequest(model="some-adapter@0", prompt=model_input([1])),
        "INVALID_REFERENCE",
        "versions start at 1",
    ),
    "bad alias": (
        lambda m: sampler_pb2.SampleRequest(model="some-adapter@Bad!", prompt=model_input([1])),
        "INVALID_REFERENCE",
        "expected name, name@alias or name@N",
    ),
    # A digit str.isdigit() accepts and int() refuses: it was a crash (INTERNAL), found by the HTTP fuzzer.
    "superscript version": (
        lambda m: sampler_pb2.SampleRequest(model="some-adapter@\u00b2", prompt=model_input([1])),
        "INVALID_REFERENCE",
        "expected name, name@alias or name@N",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLES))
def test_invalid_sample_requests(sampler: Sampler, good: Published, case: str) -> None:
    make, reason, words = BAD_SAMPLES[case]
    for model in ("base", good.ref):
        error = sample_error(sampler, make(model))
        assert_status(error, INVALID, reason)
        assert words in str(error.details()), error.details()


def test_invalid_compute_logprobs_requests(sampler: Sampler, good: Published) -> None:
    def compute(*inputs: list[int]) -> sampler_pb2.ComputeLogprobsResponse:
        response: sampler_pb2.ComputeLogprobsResponse = sampler.ComputeLogprobs(
            sampler_pb2.ComputeLogprobsRequest(model=good.ref, inputs=[model_input(t) for t in inputs])
        )
        return response

    assert_status(rpc_error(compute), INVALID, "INVALID_PROMPT")
    assert_status(rpc_error(compute, [1, 2], []), INVALID, "INVALID_PROMPT")
    error = rpc_error(compute, [1, 2], [3, VOCAB])
    assert_status(error, INVALID, "TOKEN_OUT_OF_RANGE")
    assert "inputs[1]" in str(error.details())
    assert_status(rpc_error(compute, [7] * CONTEXT), INVALID, "PROMPT_TOO_LONG")
    # A one-token input has nothing to score; several inputs are scored independently.
    single, pair = compute([5], [5, 6]).results
    assert list(single.logprobs) == [] and len(pair.logprobs) == 1
    # ...and the engine is fine afterwards.
    assert greedy(sampler, good.ref, good.prompt) == good.tokens


def test_prompt_text_is_tokenized(sampler: Sampler, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(tiny_model).encode("The capital of France is", add_special_tokens=False)
    by_text = run(
        sampler,
        sampler_pb2.SampleRequest(model="base", prompt_text="The capital of France is", sampling_params=params()),
    )
    assert by_text.only.tokens == greedy(sampler, "base", tokens)
    error = sample_error(sampler, sampler_pb2.SampleRequest(model="base", prompt_text=""))
    assert_status(error, INVALID, "INVALID_PROMPT")


def test_prompt_text_is_bounded_in_bytes_before_tokenizing(sampler: Sampler) -> None:
    """--max-prompt-bytes' default: 16 bytes per token of the context; multi-byte characters count as bytes."""
    limit = 16 * CONTEXT

    def text_request(text: str) -> sampler_pb2.SampleRequest:
        return sampler_pb2.SampleRequest(model="base", prompt_text=text, sampling_params=params(max_tokens=2))

    for text in ("a" * (limit + 1), "\u00e9" * (limit // 2 + 1), "a" * (limit + 70_000)):  # the last: not even read
        error = sample_error(sampler, text_request(text))
        assert assert_status(error, INVALID, "PROMPT_TOO_LONG")["field"] == "prompt_text"
        assert f"{limit:,} bytes" in str(error.details())
    # At the limit it is tokenized: too many tokens for the context, which the token check then says.
    error = sample_error(sampler, text_request("ab " * (limit // 3)))
    assert assert_status(error, INVALID, "PROMPT_TOO_LONG")["field"] == "prompt"
    assert run(sampler, text_request("ab " * 100)).only.tokens  # a long text within the context is served


# --- artifacts that must never be served ----------------------------------------------------------------------


def flip_byte(path: Path) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupted_artifact_is_data_loss_and_nothing_is_loaded(
    trainer: Trainer, sampler: Sampler, registry_server: ServerProcess
) -> None:
    name, _ = trained_adapter(trainer, seed=310)
    p = prompt(310)
    served = greedy(sampler, name, p)  # latest = v1, now resident
    train(trainer, name, seed=311, steps=2)
    v2 = snapshot(trainer, name, skip_latest=True)  # no alias moves: the hot-reload follower must not preload it
    flip_byte(artifact_path(registry_store(registry_server), v2) / "adapter_model.safetensors")
    failures = stats(sampler).reload_failures_total
    assert_status(sample_error(sampler, request(f"{name}@2", p)), grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    assert_status(rpc_error(score, sampler, f"{name}@2", p), grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    error = rpc_error(sampler.LoadAdapter, sampler_pb2.LoadAdapterRequest(reference=f"{name}@2", pin=True))
    assert_status(error, grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    assert stats(sampler).reload_failures_total >= failures + 3
    resident = loaded(sampler)
    assert f"{name}@2" not in resident and f"{name}@1" in resident
    assert all(a.version.artifact_sha256 != v2.artifact_sha256 for a in resident.values())
    # The version that loaded keeps being served, unchanged.
    assert greedy(sampler, f"{name}@1", p) == served


def _tensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return bytes(save({k: v.contiguous() for k, v in tensors.items()}))


def _lora_tensors(rank: int, modules: dict[str, tuple[int, int]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for module, (d_in, d_out) in modules.items():
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator) * 0.1
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator) * 0.1
    return out


Q0 = "model.layers.0.self_attn.q_proj"  # tiny qwen2: d_in 64, d_out 64


def _artifact(config: dict[str, object], tensors: bytes | dict[str, torch.Tensor]) -> dict[str, bytes]:
    payload = tensors if isinstance(tensors, bytes) else _tensors_bytes(tensors)
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": payload}


LORA_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


UNUSABLE: dict[str, dict[str, bytes]] = {
    "not safetensors": _artifact(LORA_CONFIG, hashlib.sha256(b"x").digest() * 64),
    "config not json": {
        "adapter_config.json": b"{not json",
        "adapter_model.safetensors": _tensors_bytes(_lora_tensors(4, {Q0: (64, 64)})),
    },
    "config without r": _artifact({"lora_alpha": 8}, _lora_tensors(4, {Q0: (64, 64)})),
    "no config file": {"adapter_model.safetensors": _tensors_bytes(_lora_tensors(4, {Q0: (64, 64)}))},
    "wrong d_in": _artifact(LORA_CONFIG, _lora_tensors(4, {Q0: (32, 64)})),
    "rank differs from config": _artifact(LORA_CONFIG, _lora_tensors(2, {Q0: (64, 64)})),
    "lora_A without lora_B": _artifact(LORA_CONFIG, {f"base_model.model.{Q0}.lora_A.weight": torch.zeros(4, 64)}),
    "unknown module": _artifact(LORA_CONFIG, _lora_tensors(4, {"model.layers.0.self_attn.qkv_proj": (64, 64)})),
    "no lora tensors": _artifact(LORA_CONFIG, {"base_model.model.lm_head.weight": torch.zeros(VOCAB, 64)}),
    "extra full weights": _artifact(
        LORA_CONFIG, {**_lora_tensors(4, {Q0: (64, 64)}), "base_model.model.lm_head.weight": torch.zeros(VOCAB, 64)}
    ),
    "rank above max": _artifact({**LORA_CONFIG, "r": 128}, _lora_tensors(128, {Q0: (64, 64)})),
    "dora": _artifact({**LORA_CONFIG, "use_dora": True}, _lora_tensors(4, {Q0: (64, 64)})),
    "per-module alpha": _artifact({**LORA_CONFIG, "alpha_pattern": {"q_proj": 64}}, _lora_tensors(4, {Q0: (64, 64)})),
}


# Beyond the one magnitude rule (weights.peft.check_lora_magnitudes): refused with ADAPTER_OUT_OF_RANGE.
OUT_OF_RANGE: dict[str, dict[str, bytes]] = {
    "non-finite weights": _artifact(
        LORA_CONFIG,
        {**_lora_tensors(4, {Q0: (64, 64)}), f"base_model.model.{Q0}.lora_B.weight": torch.full((64, 4), math.nan)},
    ),
    "weight beyond 1e4": _artifact(
        LORA_CONFIG,
        {**_lora_tensors(4, {Q0: (64, 64)}), f"base_model.model.{Q0}.lora_A.weight": torch.full((4, 64), 3e38)},
    ),
    "lora_alpha 1e38": _artifact({**LORA_CONFIG, "lora_alpha": 1e38}, _lora_tensors(4, {Q0: (64, 64)})),
}


REASONS = {
    **dict.fromkeys(UNUSABLE, "INCOMPATIBLE_ADAPTER"),
    **dict.fromkeys(OUT_OF_RANGE, "ADAPTER_OUT_OF_RANGE"),
    "other base model": "INCOMPATIBLE_ADAPTER",
}


def publish_files(
    registry: registry_pb2_grpc.RegistryServiceStub, files: dict[str, bytes], base_model_digest: str = ""
) -> registry_pb2.Version:
    name = unique_name("bad")
    create_adapter(registry, name)
    uri = upload(registry, files)
    lineage = registry_pb2.Lineage(base_model_digest=base_model_digest)
    response: registry_pb2.PublishVersionResponse = registry.PublishVersion(
        registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=uri, lineage=lineage)
    )
    return response.version


@pytest.fixture(scope="module")
def unusable(registry: registry_pb2_grpc.RegistryServiceStub) -> dict[str, registry_pb2.Version]:
    versions = {case: publish_files(registry, files) for case, files in {**UNUSABLE, **OUT_OF_RANGE}.items()}
    versions["other base model"] = publish_files(
        registry, _artifact(LORA_CONFIG, _lora_tensors(4, {Q0: (64, 64)})), base_model_digest="sha256:" + "0" * 64
    )
    return versions


@pytest.mark.parametrize("case", list(REASONS))
def test_unusable_artifact_is_rejected_and_nothing_is_loaded(
    sampler: Sampler, good: Published, unusable: dict[str, registry_pb2.Version], case: str
) -> None:
    version = unusable[case]
    ref = f"{version.adapter}@{version.version}"
    error = sample_error(sampler, request(ref, [1, 2, 3]))
    assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, REASONS[case])
    assert ref in str(error.details())
    assert not any(key.startswith(version.adapter) for key in loaded(sampler))
    assert stats(sampler).running_requests == 0
    assert greedy(sampler, good.ref, good.prompt) == good.tokens


def test_a_valid_synthetic_artifact_loads(sampler: Sampler, registry: registry_pb2_grpc.RegistryServiceStub) -> None:
    """The same construction as the unusable cases, done right, is served (so the cases above fail for their one
    defect) and changes the output."""
    version = publish_files(registry, _artifact(LORA_CONFIG, _lora_tensors(4, {Q0: (64, 64)}, seed=1)))
    ref = f"{version.adapter}@{version.version}"
    (with_adapter,) = score(sampler, ref, prompt(5, 16))
    (base,) = score(sampler, "base", prompt(5, 16))
    assert with_adapter != base
    assert loaded(sampler)[ref].rank == 4
    sampler.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(reference=ref))


# --- bad requests next to good ones -----------------------------------------------------------------------------


def test_bad_requests_do_not_disturb_good_ones(
    sampler: Sampler, good: Published, unusable: dict[str, registry_pb2.Version]
) -> None:
    goods = [
        request(good.ref, good.prompt),
        request("base", prompt(1)),
        request(good.ref, prompt(2), params(max_tokens=40)),
    ]
    expected = [run(sampler, r).only.tokens for r in goods]
    bad_version = unusable["wrong d_in"]
    bads = [
        request(good.ref, [1, VOCAB]),
        request(unique_name("nobody"), [1, 2]),
        request(good.ref, [1, 2], num_samples=100),
        request(f"{bad_version.adapter}@{bad_version.version}", [1, 2]),
        request(good.ref, [1], _sampling(top_p=2.0)),
    ]
    mixed = [(True, r) for r in goods * 3] + [(False, r) for r in bads * 2]
    mixed = mixed[::2] + mixed[1::2]

    def one(item: tuple[bool, sampler_pb2.SampleRequest]) -> list[int] | grpc.StatusCode:
        _, req = item
        try:
            return run(sampler, req).only.tokens
        except grpc.RpcError as error:
            return error.code()

    with concurrent.futures.ThreadPoolExecutor(len(mixed)) as pool:
        outcomes = list(pool.map(one, mixed))
    for (ok, req), outcome in zip(mixed, outcomes, strict=True):
        if ok:
            assert outcome == expected[goods.index(req)], req.model
        else:
            assert isinstance(outcome, grpc.StatusCode) and outcome not in (
                grpc.StatusCode.INTERNAL,
                grpc.StatusCode.UNKNOWN,
            ), (req.model, outcome)
    assert wait_until(lambda: stats(sampler).running_requests == 0)
