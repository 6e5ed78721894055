"""The admin CLI's --json output is the wire's JSON form: the SDK records it prints, re-encoded, equal
protobuf's JSON of the registry's own replies (what the commands printed when they called the stubs)."""

from __future__ import annotations

from contextlib import closing
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from registryutil import publish, unique_name
from serverproc import ServerProcess

from opentinker.cli import registry_json as out
from opentinker.client import RegistryClient
from opentinker.v1 import registry_pb2, registry_pb2_grpc

Stub = registry_pb2_grpc.RegistryServiceStub


def wire(message: Message) -> dict[str, Any]:
    # Every field, zeros included (a script reading version_count of a new adapter must find 0).
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def test_records_print_as_the_wire_replies(registry_server: ServerProcess, registry: Stub) -> None:
    name = unique_name("json")
    with RegistryClient(registry_server.address) as client:
        created = client.create_adapter(
            name,
            rank=8,
            alpha=0.1,
            dropout=0.05,
            target_modules=["q_proj"],
            labels={"team": "rl"},
            description="d",
            base_model_digest="abc",
        )
        raw_adapter = registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
        assert out.created_json(created) == wire(
            registry_pb2.CreateAdapterResponse(adapter=raw_adapter, event_id=created.event_id)
        )
        for parent in range(3):
            publish(registry, name, parent=parent, aliases=("stable",) if parent == 1 else ())

        listed = registry.ListAdapters(registry_pb2.ListAdaptersRequest(prefix=name)).adapters
        assert [out.adapter_json(a) for a in client.list_adapters(name)] == [wire(a) for a in listed]
        versions = registry.ListVersions(registry_pb2.ListVersionsRequest(adapter=name)).versions
        assert [out.version_json(v) for v in client.list_versions(name)] == [wire(v) for v in versions]
        chain = registry.GetLineage(registry_pb2.GetLineageRequest(reference=name)).chain
        assert [out.version_json(v) for v in client.get_lineage(name)] == [wire(v) for v in chain]

        request = registry_pb2.WatchEventsRequest(after_event_id="0", adapters=[name])
        raw_events = registry.WatchEvents(request)
        with closing(client.watch_events("0", [name])) as events:
            for _ in range(4):  # created, then three published
                assert out.watch_json(next(events)) == wire(next(raw_events))
        raw_events.cancel()
        snapshot = registry_pb2.WatchEventsRequest(after_event_id="0", adapters=[name], send_snapshot=True)
        raw_snapshot = registry.WatchEvents(snapshot)
        with closing(client.watch_events("0", [name], send_snapshot=True)) as events:
            assert out.watch_json(next(events)) == wire(next(raw_snapshot))
        raw_snapshot.cancel()

        dry = registry_pb2.GarbageCollectRequest(keep_last=1, adapter=name, dry_run=True)
        assert out.gc_json(client.garbage_collect(1, name, dry_run=True)) == wire(registry.GarbageCollect(dry))

        moved = client.set_alias(name, "canary", 2)
        assert out.alias_set_json(moved) == {"previous_version": "0", "version": "2", "event_id": moved.event_id}
        back = client.rollback(name)
        assert out.rollback_json(back) == {
            "alias": "latest",
            "from_version": "3",
            "to_version": "2",
            "event_id": back.event_id,
        }
        removed = client.delete_alias_move(name, "canary")
        assert out.alias_rm_json(removed) == {"previous_version": "2", "event_id": removed.event_id}


def test_versions_limit_reads_only_the_newest(registry_server: ServerProcess, registry: Stub) -> None:
    name = unique_name("json")
    with RegistryClient(registry_server.address) as client:
        client.create_adapter(name, rank=8)
        for parent in range(3):
            publish(registry, name, parent=parent)
        assert [v.number for v in client.list_versions(name, limit=2)] == [3, 2]
        assert [v.number for v in client.list_versions(name, limit=5)] == [3, 2, 1]
