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
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverproc import ServerProcess
from trainerutil import adam, float_tensor, int_tensor, lora, model_input, sft_batch

from opentinker.rpc.serving.errors import ERROR_DOMAIN, error_info
from opentinker.v1 import common_pb2, registry_pb2, sampler_pb2, trainer_pb2

SERVICES: dict[str, ServiceDescriptor] = {
    "registry": registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
    "trainer": trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
    "sampler": sampler_pb2.DESCRIPTOR.services_by_name["SamplerService"],
}
# Random examples per RPC. Every RPC of the three services must be listed (test_every_rpc_is_fuzzed).
EXAMPLES: dict[str, int] = {
    "RegistryService/CreateAdapter": 55,
    "RegistryService/GetAdapter": 35,
    "RegistryService/ListAdapters": 35,
    "RegistryService/DeleteAdapter": 35,
    "RegistryService/PublishVersion": 55,
    "RegistryService/GetVersion": 35,
    "RegistryService/ListVersions": 35,
    "RegistryService/Resolve": 40,
    "RegistryService/SetAlias": 40,
    "RegistryService/DeleteAlias": 35,
    "RegistryService/SetServingAlias": 35,
    "RegistryService/Rollback": 40,
    "RegistryService/GetLineage": 35,
    "RegistryService/WatchEvents": 10,
    "RegistryService/GarbageCollect": 30,
    "RegistryService/UploadArtifact": 55,
    "RegistryService/DownloadArtifact": 35,
    "RegistryService/DeleteVersion": 30,
    "TrainerService/GetTrainerInfo": 15,
    "TrainerService/CreateAdapter": 55,
    "TrainerService/GetAdapter": 30,
    "TrainerService/ListAdapters": 20,
    "TrainerService/DeleteAdapter": 30,
    "TrainerService/ForwardBackward": 70,
    "TrainerService/Forward": 55,
    "TrainerService/OptimStep": 40,
    "TrainerService/SaveSnapshot": 35,
    "TrainerService/SaveState": 30,
    "TrainerService/LoadState": 35,
    "TrainerService/ResetAdapter": 35,
    "TrainerService/DeleteState": 30,
    "SamplerService/GetSamplerInfo": 15,
    "SamplerService/Sample": 70,
    "SamplerService/ComputeLogprobs": 50,
    "SamplerService/LoadAdapter": 40,
    "SamplerService/UnloadAdapter": 35,
    "SamplerService/ListLoaded": 15,
    "SamplerService/GetStats": 15,
}
# Fuzzing never deletes the adapters the other examples aim at (deleting them is a valid call).
DESTRUCTIVE = {
    "RegistryService/DeleteAdapter",
    "TrainerService/DeleteAdapter",
    "RegistryService/DeleteVersion",
    "TrainerService/DeleteState",
}
DELIBERATE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.OUT_OF_RANGE,
}
MIN_CASES = 1200
KNOWN = "fuzz-known"
VOCAB = 512
BIG = 10 * 1024 * 1024

ADVERSARIAL_STRINGS = [
    "",
    " ",
    "a@",
    "@1",
    "a@-1",
    "a@0",
    "a@1.5",
    "a@\u00b2",
    "a@@1",
    "a@latest@1",
    "../x",
    "../../etc/passwd",
    "/etc/passwd",
    "a/../b",
    "a/b/c",
    "./x",
    "x/",
    "/x",
    "a//b",
    "A",
    "a b",
    "a\x00b",
    "\u202e",
    "é",
    "\U0001f600",
    "a" * 64,
    "a" * 65,
    "x" * 300,
    "base",
    "base@1",
    "*",
    "a/*",
    "0",
    "0-0",
    "-1",
    "1-",
    "99999999999999999999-0",
    "18446744073709551616",
    "sha256:",
    "sha256:../x",
    "sha256:" + "0" * 64,
    "sha256:" + "g" * 64,
    "sha256:" + "a" * 63,
    "0" * 64,
    "cross_entropy",
    "ppo",
    "no_such_loss",
    "latest",
    "stable",
    "q_proj",
    "all-linear",
    "NaN",
    "%s%n",
]
INVALID_UTF8 = [b"\xff", b"\xfe\xfe", b"a\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80"]
FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 1e-45, 3.4e38, 1e300, -1e300, 0.5, 1.0, 2.0]
COUNTS: Counter[str] = Counter()
CODES: Counter[tuple[str, str]] = Counter()


@dataclass
class Known:
    """Things that exist, so that fuzzed requests also get past the first checks: by field name, else all."""

    by_field: dict[str, list[str]]

    def strings(self, field: str) -> list[str]:
        return self.by_field.get(field) or sorted({s for values in self.by_field.values() for s in values})

    def without(self, name: str) -> Known:
        return Known({f: [s for s in values if not s.startswith(name)] for f, values in self.by_field.items()})


@dataclass
class Fuzz:
    servers: dict[str, ServerProcess]
    channels: dict[str, grpc.Channel]
    known: Known
    templates: dict[str, Message]
    last_state: tuple[bytes, ...] = ()


def method_of(rpc: str) -> tuple[str, MethodDescriptor]:
    service_name, method = rpc.split("/")
    for label, service in SERVICES.items():
        if service.name == service_name:
            return label, service.methods_by_name[method]
    raise KeyError(rpc)


# --- strategies from descriptors ---------------------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
}


def _scalar(field: FieldDescriptor, known: Known) -> st.SearchStrategy[object]:
    # Map keys and values are fields named "key" and "value": they draw from every known string.
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        # Known values weigh double: most fields valid, so that the checks further in are reached too.
        valid = st.sampled_from(known.strings(field.name))
        return st.one_of(
            valid,
            valid,
            st.sampled_from(ADVERSARIAL_STRINGS),
            st.text(max_size=24),
            st.from_regex(r"[a-z0-9][a-z0-9._-]{0,8}(/[a-z0-9]{1,4})?(@([a-z]{1,6}|[0-9]{1,3}))?", fullmatch=True),
        )
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        width: Literal[32, 64] = 32 if kind == FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(st.sampled_from(FLOATS), st.floats(width=width))
    if kind == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return st.integers(-1, len(field.enum_type.values) + 1)  # proto3 enums are open: unknown values parse
    low, high = _INT_RANGES[kind]
    edges = sorted({low, high, 0, 1, max(low, -1), high // 2 + 1})
    # Mostly small (valid token ids, versions, counts) so that requests get deep; sometimes an extreme.
    return st.one_of(st.integers(max(low, 0), min(high, VOCAB - 1)), st.sampled_from(edges))


def _is_list(field: FieldDescriptor) -> bool:
    """A repeated field that is not a map."""
    is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
    return field.is_repeated and not is_map


def _value(field: FieldDescriptor, known: Known, depth: int) -> st.SearchStrategy[object]:
    entry = field.message_type
    if entry is not None:
        if entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            return st.dictionaries(_scalar(key, known), _value(value, known, depth + 1), max_size=3)
        return message_of(entry, known, depth + 1)
    return _scalar(field, known)


@st.composite
def datum(draw: st.DrawFn) -> common_pb2.Datum:
    """A datum of consistent shape (so the batch checks pass) whose values may still be wrong (NaN weights)."""
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    floats = st.lists(st.one_of(st.floats(-2, 2), st.sampled_from(FLOATS)), min_size=len(tokens), max_size=len(tokens))
    inputs = {"target_tokens": int_tensor(draw(st.permutations(tokens)))}
    for key in draw(st.sets(st.sampled_from(["weights", "logprobs", "advantages"]))):
        inputs[key] = float_tensor(draw(floats))
    return common_pb2.Datum(model_input=model_input(tokens), loss_fn_inputs=inputs)


def message_of(descriptor: Descriptor, known: Known, depth: int = 0) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    if descriptor.full_name == "opentinker.v1.Datum" and depth < 2:
        return st.one_of(datum(), datum(), message_of(descriptor, known, 2))
    optional = {field.name: _field(field, known, depth) for field in descriptor.fields}
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls(), values))


def _field(field: FieldDescriptor, known: Known, depth: int) -> st.SearchStrategy[object]:
    value = _value(field, known, depth)
    if not _is_list(field):
        return value
    # Huge repeated fields: a small list repeated 2000 times (cheap to draw), at the top level only.
    times = st.sampled_from([1, 1, 1, 2000]) if depth == 0 else st.just(1)
    return st.tuples(st.lists(value, max_size=4), times).map(lambda pair: pair[0] * pair[1])


@st.composite
def mutant(draw: st.DrawFn, template: Message, known: Known) -> Message:
    """A valid request with zero to two of its fields replaced by fuzzed values."""
    message = type(template)()
    message.CopyFrom(template)
    candidates = [f for f in template.DESCRIPTOR.fields if isinstance(f, FieldDescriptor)]
    fields = draw(st.lists(st.sampled_from(candidates), max_size=2, unique_by=lambda f: f.name))
    for field in fields:
        message.ClearField(field.name)
        _build(message, {field.name: draw(_field(field, known, 0))})
    return message


def _build(message: Message, values: dict[str, object]) -> Message:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name)
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, Message):
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif isinstance(value, list):
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif isinstance(value, Message):
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@st.composite
def wire(draw: st.DrawFn, descriptor: Descriptor, known: Known, template: Message | None) -> bytes:
    """A serialized request (random, or a valid template with fields fuzzed), sometimes mutated below the
    protobuf API: invalid UTF-8 in a string field (a later copy of a field wins when parsing), trailing
    garbage, truncation or an unknown field."""
    random_message = message_of(descriptor, known)
    source = random_message if template is None else st.one_of(random_message, mutant(template, known))
    data = draw(source).SerializeToString()
    strings = [f.number for f in descriptor.fields if f.type == FieldDescriptor.TYPE_STRING]
    mutation = draw(st.sampled_from(["none"] * 8 + ["utf8", "utf8", "garbage", "truncate", "unknown"]))
    if mutation == "utf8" and strings:
        data += _length_delimited(draw(st.sampled_from(strings)), draw(st.sampled_from(INVALID_UTF8)))
    elif mutation == "garbage" or (mutation == "utf8" and not strings):
        data += draw(st.binary(min_size=1, max_size=16))
    elif mutation == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mutation == "unknown":
        data += _length_delimited(draw(st.sampled_from([99, 536870911])), draw(st.binary(max_size=32)))
    return data


# --- calling and checking -----------------------------------------------------------------------------------


def raw(data: bytes) -> bytes:
    """The (de)serializer of fuzzed calls: bytes go on the wire as they are."""
    return data


def call(fuzz: Fuzz, rpc: str, requests: list[bytes]) -> grpc.StatusCode:
    """Sends one fuzzed call (raw bytes) and returns its status; streams are read to their end."""
    label, method = method_of(rpc)
    channel = fuzz.channels[label]
    path = f"/{method.containing_service.full_name}/{method.name}"
    timeout = 0.3 if rpc == "RegistryService/WatchEvents" else 60.0  # a valid watch never ends
    try:
        if method.client_streaming:
            channel.stream_unary(path, raw, raw)(iter(requests), timeout=timeout)
        elif method.server_streaming:
            for _ in channel.unary_stream(path, raw, raw)(requests[0], timeout=timeout):
                pass
        else:
            channel.unary_unary(path, raw, raw)(requests[0], timeout=timeout)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and rpc == "RegistryService/WatchEvents":
            return grpc.StatusCode.OK  # the watch was accepted and stayed open
        assert code in DELIBERATE, f"{rpc}: {code.name}: {error.details()}"
        info = error_info(error)
        assert info is not None and info.domain == ERROR_DOMAIN, f"{rpc}: {code.name} without ErrorInfo: {error}"
        assert "Traceback" not in (error.details() or "")
        return code
    return grpc.StatusCode.OK


def state(fuzz: Fuzz, *, settle: bool = False) -> tuple[bytes, ...]:
    """Every listing a rejected call must leave as it was. settle: after an accepted sampler call, whose
    sequences release their slot references and count their tokens on the engine thread just after the
    stream ends, wait until the sampler is idle and two reads agree."""
    deadline = time.monotonic() + 5
    current = _read_state(fuzz)
    while settle and time.monotonic() < deadline:
        time.sleep(0.02)
        current, previous = _read_state(fuzz), current
        if current == previous and current[-1] == IDLE:
            break
    return current[:-1]


IDLE = b"0"  # the last item of a raw state: sequences running or waiting, plus slot references held


def _read_state(fuzz: Fuzz) -> tuple[bytes, ...]:
    channels = fuzz.channels
    adapters = channels["registry"].unary_unary(
        "/opentinker.v1.RegistryService/ListAdapters",
        request_serializer=registry_pb2.ListAdaptersRequest.SerializeToString,
        response_deserializer=registry_pb2.ListAdaptersResponse.FromString,
    )(registry_pb2.ListAdaptersRequest(page_size=1000), timeout=30)
    training = channels["trainer"].unary_unary(
        "/opentinker.v1.TrainerService/ListAdapters",
        request_serializer=trainer_pb2.TrainerServiceListAdaptersRequest.SerializeToString,
        response_deserializer=trainer_pb2.TrainerServiceListAdaptersResponse.FromString,
    )(trainer_pb2.TrainerServiceListAdaptersRequest(), timeout=30)
    loaded = channels["sampler"].unary_unary(
        "/opentinker.v1.SamplerService/ListLoaded",
        request_serializer=sampler_pb2.ListLoadedRequest.SerializeToString,
        response_deserializer=sampler_pb2.ListLoadedResponse.FromString,
    )(sampler_pb2.ListLoadedRequest(), timeout=30)
    references = sum(a.active_requests for a in loaded.adapters)
    for adapter in loaded.adapters:
        adapter.ClearField("active_requests")  # released at the engine's next step after a stream ends
    stats = channels["sampler"].unary_unary(
        "/opentinker.v1.SamplerService/GetStats",
        request_serializer=sampler_pb2.GetStatsRequest.SerializeToString,
        response_deserializer=sampler_pb2.GetStatsResponse.FromString,
    )(sampler_pb2.GetStatsRequest(), timeout=30)
    counters = sampler_pb2.GetStatsResponse(tokens_generated=stats.tokens_generated, slots_used=stats.slots_used)
    busy = str(references + stats.running_requests + stats.waiting_requests).encode()
    return (*(m.SerializeToString(deterministic=True) for m in (adapters, training, loaded, counters)), busy)


def check_case(fuzz: Fuzz, rpc: str, requests: list[bytes]) -> None:
    # Nothing else changes state here: the state after the previous case is the state before this one.
    before = fuzz.last_state or state(fuzz)
    code = call(fuzz, rpc, requests)
    COUNTS[rpc] += 1
    CODES[rpc, code.name] += 1
    fuzz.last_state = state(fuzz, settle=code == grpc.StatusCode.OK and rpc.startswith("SamplerService/"))
    if code != grpc.StatusCode.OK:
        assert fuzz.last_state == before, f"{rpc} was refused with {code.name} but changed state"


def assert_all_serving(fuzz: Fuzz) -> None:
    for label, server in fuzz.servers.items():
        assert server.process.poll() is None, f"{label} died:\n{server.log()[-3000:]}"
        response = health_pb2_grpc.HealthStub(fuzz.channels[label]).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, label


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
