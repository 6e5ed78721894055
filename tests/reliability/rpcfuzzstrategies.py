"""Tables and strategies of the RPC fuzz tests (test_fuzz_rpcs.py): the services and the examples per RPC, the
adversarial values, the things that exist (Known), and requests built from the proto descriptors, serialized
and sometimes mutated below the protobuf API."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from serverproc import ServerProcess
from trainerutil import float_tensor, int_tensor, model_input

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
    "RegistryService/RegisterReplica": 45,
    "RegistryService/Heartbeat": 35,
    "RegistryService/ListReplicas": 15,
    "RegistryService/WatchReplicas": 10,
    "RegistryService/PlaceAdapter": 30,
    "RegistryService/GetPlacement": 20,
    "RegistryService/MovePlacement": 30,
    "RegistryService/RecordPlacementState": 30,
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
    "TrainerService/MoveAdapter": 30,
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
