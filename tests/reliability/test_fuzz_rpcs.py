"""Property-based fuzzing of every RPC of the registry, the trainer and the sampler.

Requests are built from the proto descriptors (so a new field is fuzzed without a code change) with
adversarial values: bad references ('a@', '@1', 'a@-1', '../x'), NaN/inf, extreme integers, huge repeated
fields, invalid UTF-8 in string fields (hand-encoded on the wire: the Python protobuf refuses it), corrupt
wire format, 10 MB strings. Every answer must be OK or a deliberate status with our ErrorInfo (never UNKNOWN,
INTERNAL or a transport error), a rejected call must leave every listing unchanged, and the servers must
stay up. The stack is private to this module, so the shared session servers see none of this.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rpcfuzzchecks import CODES, COUNTS, assert_all_serving, check_case
from rpcfuzzstrategies import (
    ADVERSARIAL_STRINGS,
    BIG,
    DESTRUCTIVE,
    EXAMPLES,
    KNOWN,
    MIN_CASES,
    SERVICES,
    VOCAB,
    Fuzz,
    Known,
    _is_list,
    _length_delimited,
    method_of,
    wire,
)
from serverproc import ServerProcess
from trainerutil import adam, lora, model_input, sft_batch

from opentinker.v1 import registry_pb2, sampler_pb2, trainer_pb2

# --- fixtures and tests -------------------------------------------------------------------------------------


def _unary(channel: grpc.Channel, path: str, request: Message, response_type: type[Message]) -> Message:
    method = channel.unary_unary(
        path, request_serializer=type(request).SerializeToString, response_deserializer=response_type.FromString
    )
    response: Message = method(request, timeout=60)
    return response


@pytest.fixture(scope="module")
def fuzz(start_stack: Callable[..., dict[str, ServerProcess]]) -> Iterator[Fuzz]:
    # --follow-window 0: no background preloads, so listings change only by the calls made here.
    servers = start_stack("fuzz", sampler_args=("--max-slots", "8", "--follow-window", "0"))
    channels = {label: grpc.insecure_channel(server.address) for label, server in servers.items()}
    trainer = channels["trainer"]
    _unary(
        trainer,
        "/opentinker.v1.TrainerService/CreateAdapter",
        trainer_pb2.TrainerServiceCreateAdapterRequest(name=KNOWN, lora_config=lora()),
        trainer_pb2.TrainerServiceCreateAdapterResponse,
    )
    _unary(
        trainer,
        "/opentinker.v1.TrainerService/ForwardBackward",
        trainer_pb2.ForwardBackwardRequest(adapter=KNOWN, datums=sft_batch(1), loss_fn="cross_entropy"),
        trainer_pb2.ForwardBackwardResponse,
    )
    snapshot = _unary(
        trainer,
        "/opentinker.v1.TrainerService/SaveSnapshot",
        trainer_pb2.SaveSnapshotRequest(adapter=KNOWN),
        trainer_pb2.SaveSnapshotResponse,
    )
    saved = _unary(
        trainer,
        "/opentinker.v1.TrainerService/SaveState",
        trainer_pb2.SaveStateRequest(adapter=KNOWN),
        trainer_pb2.SaveStateResponse,
    )
    assert isinstance(snapshot, trainer_pb2.SaveSnapshotResponse) and isinstance(saved, trainer_pb2.SaveStateResponse)
    uri, state_id = snapshot.version.artifact_uri, saved.state_id
    names = [KNOWN, "fuzz-other"]
    refs = [KNOWN, f"{KNOWN}@1", f"{KNOWN}@latest", f"{KNOWN}@stable", "base"]
    known = Known(
        {
            "name": names,
            "adapter": names,
            "adapters": [*names, "fuzz-*"],
            "prefix": ["", "fuzz", KNOWN],
            "reference": refs,
            "model": refs,
            "init_from": refs,
            "alias": ["latest", "stable"],
            "aliases": ["latest", "stable"],
            "artifact_uri": [uri],
            "artifact_sha256": [uri.removeprefix("sha256:")],
            "state_id": [state_id],
            "resume_state": [state_id],
            "after_event_id": ["", "0", snapshot.event_id],
            "loss_fn": ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"],
            "target_modules": ["q_proj"],
            "key": ["weights", "clip_low_threshold", "beta", "loss"],
            "path": ["adapter_config.json"],
            "replica_id": ["fuzz-replica"],
            "address": ["127.0.0.1:9"],
            "base_fingerprint": ["fuzz-base"],
        }
    )
    yield Fuzz(servers, channels, known, templates(uri, state_id))
    for channel in channels.values():
        channel.close()


def templates(uri: str, state_id: str) -> dict[str, Message]:
    """Valid requests of the RPCs whose checks run deep: fuzzing one or two of their fields reaches them."""
    ref = f"{KNOWN}@1"
    sampling = sampler_pb2.SamplingParams(max_tokens=4, temperature=0.5, seed=1, top_k=5, top_p=0.9)
    return {
        "RegistryService/CreateAdapter": registry_pb2.CreateAdapterRequest(name="fuzz-new", lora_config=lora()),
        "RegistryService/PublishVersion": registry_pb2.PublishVersionRequest(
            adapter=KNOWN,
            artifact_uri=uri,
            aliases=["stable"],
            request_id="r1",
            lineage=registry_pb2.Lineage(parent_version=1),
        ),
        "RegistryService/GetVersion": registry_pb2.GetVersionRequest(adapter=KNOWN, version=1),
        "RegistryService/SetAlias": registry_pb2.SetAliasRequest(adapter=KNOWN, alias="stable", version=1),
        "RegistryService/Rollback": registry_pb2.RollbackRequest(adapter=KNOWN, alias="stable"),
        "RegistryService/GetLineage": registry_pb2.GetLineageRequest(reference=ref, max_depth=3),
        "RegistryService/GarbageCollect": registry_pb2.GarbageCollectRequest(keep_last=5, dry_run=True),
        "RegistryService/DownloadArtifact": registry_pb2.DownloadArtifactRequest(artifact_uri=uri),
        # An address no client dials and a fingerprint no base has: a fuzzed replica is never routed to.
        "RegistryService/RegisterReplica": registry_pb2.RegisterReplicaRequest(
            replica=registry_pb2.Replica(
                replica_id="fuzz-replica",
                role=registry_pb2.REPLICA_ROLE_SAMPLER,
                address="127.0.0.1:9",
                base_fingerprint="fuzz-base",
                lease_seconds=0.5,
                resident=[f"{KNOWN}@1"],
            )
        ),
        "RegistryService/Heartbeat": registry_pb2.HeartbeatRequest(
            replica_id="fuzz-replica", state=registry_pb2.REPLICA_STATE_DRAINING
        ),
        "TrainerService/CreateAdapter": trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="fuzz-new", lora_config=lora(), adam_params=adam(), init_from=ref
        ),
        "TrainerService/ForwardBackward": trainer_pb2.ForwardBackwardRequest(
            adapter=KNOWN, datums=sft_batch(7), loss_fn="cross_entropy"
        ),
        "TrainerService/Forward": trainer_pb2.ForwardRequest(adapter=KNOWN, datums=sft_batch(8), loss_fn="ppo"),
        "TrainerService/OptimStep": trainer_pb2.OptimStepRequest(adapter=KNOWN, adam_params=adam()),
        "TrainerService/SaveSnapshot": trainer_pb2.SaveSnapshotRequest(adapter=KNOWN, aliases=["stable"]),
        "TrainerService/SaveState": trainer_pb2.SaveStateRequest(adapter=KNOWN, label="fuzz"),
        "TrainerService/LoadState": trainer_pb2.LoadStateRequest(adapter=KNOWN, state_id=state_id),
        "TrainerService/ResetAdapter": trainer_pb2.ResetAdapterRequest(adapter=KNOWN, reference=ref),
        "SamplerService/Sample": sampler_pb2.SampleRequest(
            model=ref, prompt=model_input([1, 2, 3]), sampling_params=sampling, num_samples=2
        ),
        "SamplerService/ComputeLogprobs": sampler_pb2.ComputeLogprobsRequest(
            model=ref, inputs=[model_input([1, 2, 3, 4])]
        ),
        "SamplerService/LoadAdapter": sampler_pb2.LoadAdapterRequest(reference=ref),
        "SamplerService/UnloadAdapter": sampler_pb2.UnloadAdapterRequest(reference=ref),
    }


def test_every_rpc_is_fuzzed() -> None:
    rpcs = {f"{service.name}/{method.name}" for service in SERVICES.values() for method in service.methods}
    assert rpcs == set(EXAMPLES), f"not fuzzed: {sorted(rpcs - set(EXAMPLES))}; gone: {sorted(set(EXAMPLES) - rpcs)}"


@pytest.mark.parametrize("rpc", sorted(EXAMPLES))
def test_fuzzed_requests_get_deliberate_answers(fuzz: Fuzz, rpc: str) -> None:
    _label, method = method_of(rpc)
    known = fuzz.known.without(KNOWN) if rpc in DESTRUCTIVE else fuzz.known
    requests = wire(method.input_type, known, fuzz.templates.get(rpc))
    stream = st.lists(requests, min_size=1, max_size=5) if method.client_streaming else requests.map(lambda r: [r])

    @settings(
        max_examples=EXAMPLES[rpc],
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(stream)
    def run(messages: list[bytes]) -> None:
        check_case(fuzz, rpc, messages)

    run()
    assert COUNTS[rpc] >= EXAMPLES[rpc] // 2  # hypothesis stops early once a small space is exhausted
    assert_all_serving(fuzz)


@pytest.mark.parametrize("rpc", sorted(EXAMPLES))
def test_huge_fields_get_deliberate_answers(fuzz: Fuzz, rpc: str) -> None:
    """A 10 MB value in the first string field (or an unknown field) and 100k elements in every repeated one."""
    _label, method = method_of(rpc)
    descriptor = method.input_type
    cls = message_factory.GetMessageClass(descriptor)
    strings = [f for f in descriptor.fields if f.type == FieldDescriptor.TYPE_STRING]
    # No string field: an unknown field, which the server must skip.
    big = cls(**{strings[0].name: "a" * BIG}).SerializeToString() if strings else _length_delimited(99, b"a" * BIG)
    repeated = cls()
    rng = random.Random(rpc)
    for field in descriptor.fields:
        if not _is_list(field):
            continue
        target = getattr(repeated, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            item = target.add()
            for _ in range(100_000 - 1):
                target.add().CopyFrom(item)
        elif field.type == FieldDescriptor.TYPE_STRING:
            target.extend(rng.choice(ADVERSARIAL_STRINGS) or "x" for _ in range(100_000))
        elif field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            target.extend([math.nan] * 100_000)
        else:
            target.extend([rng.randrange(VOCAB)] * 100_000)
    for payload in (big, repeated.SerializeToString()):
        requests = [payload] * (2 if method.client_streaming else 1)
        check_case(fuzz, rpc, requests)
    assert_all_serving(fuzz)


def test_fuzz_case_count(fuzz: Fuzz, figure: Callable[[str, object], None]) -> None:
    missing = sorted(set(EXAMPLES) - set(COUNTS))
    if missing:
        pytest.skip(f"count the cases of a whole run only (not run here: {missing[:3]}...)")
    total = sum(COUNTS.values())
    figure("fuzz cases (all RPCs of registry, trainer, sampler)", total)
    answers = Counter[str]()
    for (_rpc, code), count in CODES.items():
        answers[code] += count
    figure("fuzz answers by status", ", ".join(f"{code} {count}" for code, count in answers.most_common()))
    assert total >= MIN_CASES
    assert_all_serving(fuzz)
