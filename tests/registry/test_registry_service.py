"""RegistryService against a real registry process: adapters, versions, listing, aliases, rollback."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from registryrpcutil import Stub, assert_status, rpc_error
from registryutil import create_adapter, publish, unique_name

from opentinker.v1 import registry_pb2


def test_create_get_and_duplicate(registry: Stub) -> None:
    name = unique_name()
    adapter = create_adapter(registry, name)
    assert adapter.name == name and adapter.lora_config.rank == 8
    assert adapter.lora_config.alpha == 8.0 and list(adapter.lora_config.target_modules) == ["all-linear"]
    assert adapter.version_count == 0 and adapter.created_by == "local"
    got = registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    assert got.name == name
    error = rpc_error(create_adapter, registry, name)
    assert_status(error, grpc.StatusCode.ALREADY_EXISTS, "ADAPTER_EXISTS")


@pytest.mark.parametrize("name", ["", "UPPER", "a b", "-dash", "a/b/c", "base", "x" * 64])
def test_bad_names_are_invalid_argument(registry: Stub, name: str) -> None:
    error = rpc_error(create_adapter, registry, name)
    assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME")


def test_unknown_adapter_not_found(registry: Stub) -> None:
    error = rpc_error(registry.GetAdapter, registry_pb2.GetAdapterRequest(name=unique_name()))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
    error = rpc_error(registry.Resolve, registry_pb2.ResolveRequest(reference=unique_name() + "@3"))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")


def test_versions_contiguous_and_rejections_burn_no_number(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    assert publish(registry, name).version.version == 1
    # Rejected publishes: stale compare-and-set, missing artifact, bad alias. None may use up a number.
    error = rpc_error(lambda: publish(registry, name, expected_latest_version=7))
    assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "VERSION_CONFLICT")
    missing = registry_pb2.PublishVersionRequest(adapter=name, artifact_uri="sha256:" + "ab" * 32)
    assert_status(rpc_error(registry.PublishVersion, missing), grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND")
    error = rpc_error(lambda: publish(registry, name, aliases=("Bad Alias",)))
    assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ALIAS")
    second = publish(registry, name, parent=1, expected_latest_version=1).version
    assert second.version == 2
    assert list(second.aliases) == ["latest"]
    adapter = registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    assert adapter.latest_version == 2 and adapter.version_count == 2 and dict(adapter.aliases) == {"latest": 2}


def test_publish_moves_extra_aliases_and_can_skip_latest(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    publish(registry, name)
    v2 = publish(registry, name, aliases=("stable", "canary"), skip_latest=True).version
    assert sorted(v2.aliases) == ["canary", "stable"]
    adapter = registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    assert dict(adapter.aliases) == {"latest": 1, "stable": 2, "canary": 2}


def test_publish_is_idempotent_by_request_id(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    first = publish(registry, name, seed=1, request_id="req-1")
    again = publish(registry, name, seed=1, request_id="req-1")
    assert again.version.version == first.version.version == 1
    assert again.event_id == first.event_id
    assert registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter.version_count == 1


def test_16_parallel_publishers_get_contiguous_numbers(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        numbers = list(pool.map(lambda i: publish(registry, name, seed=i).version.version, range(48)))
    assert sorted(numbers) == list(range(1, 49))
    assert registry.Resolve(registry_pb2.ResolveRequest(reference=name)).version.version == 48


def test_list_versions_newest_first_paged(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    for _ in range(5):
        publish(registry, name)
    seen: list[int] = []
    token = ""
    while True:
        response = registry.ListVersions(registry_pb2.ListVersionsRequest(adapter=name, page_size=2, page_token=token))
        seen.extend(v.version for v in response.versions)
        token = response.next_page_token
        if not token:
            break
    assert seen == [5, 4, 3, 2, 1]
    bad = registry_pb2.ListVersionsRequest(adapter=name, page_token="!!not-a-token")
    assert_status(rpc_error(registry.ListVersions, bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_TOKEN")


def test_list_adapters_by_prefix_paged(registry: Stub) -> None:
    tenant = unique_name("tenant")
    names = sorted(f"{tenant}/a{i}" for i in range(5))
    for name in names:
        create_adapter(registry, name)
    seen: list[str] = []
    token = ""
    while True:
        request = registry_pb2.ListAdaptersRequest(prefix=tenant + "/", page_size=2, page_token=token)
        response = registry.ListAdapters(request)
        seen.extend(a.name for a in response.adapters)
        token = response.next_page_token
        if not token:
            break
    assert seen == names


def test_resolve_references(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    error = rpc_error(registry.Resolve, registry_pb2.ResolveRequest(reference=name))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ALIAS_NOT_FOUND")
    publish(registry, name)
    publish(registry, name, aliases=("stable",))
    publish(registry, name)

    def resolve(reference: str) -> int:
        response: registry_pb2.ResolveResponse = registry.Resolve(registry_pb2.ResolveRequest(reference=reference))
        assert response.resolved.reference == reference
        assert response.resolved.artifact_sha256 == response.version.artifact_sha256
        number: int = response.version.version
        return number

    assert resolve(name) == 3
    assert resolve(f"{name}@latest") == 3
    assert resolve(f"{name}@stable") == 2
    assert resolve(f"{name}@1") == 1
    assert_status(
        rpc_error(registry.Resolve, registry_pb2.ResolveRequest(reference=f"{name}@9")),
        grpc.StatusCode.NOT_FOUND,
        "VERSION_NOT_FOUND",
    )
    for bad in (f"{name}@", f"{name}@0", f"{name}@Bad", "@1", "base"):
        error = rpc_error(registry.Resolve, registry_pb2.ResolveRequest(reference=bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, bad


def test_set_alias_compare_and_set(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    publish(registry, name)
    publish(registry, name)
    created = registry.SetAlias(
        registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=1, expected_version=0)
    )
    assert (created.previous_version, created.version) == (0, 1)
    stale = registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=2, expected_version=2)
    assert_status(rpc_error(registry.SetAlias, stale), grpc.StatusCode.FAILED_PRECONDITION, "VERSION_CONFLICT")
    missing = registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=99)
    assert_status(rpc_error(registry.SetAlias, missing), grpc.StatusCode.NOT_FOUND, "VERSION_NOT_FOUND")
    assert registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter.aliases["stable"] == 1
    moved = registry.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=2, expected_version=1))
    assert (moved.previous_version, moved.version) == (1, 2)


def test_rollback_steps_back_through_history(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    for _ in range(3):
        publish(registry, name)
    back = registry.Rollback(registry_pb2.RollbackRequest(adapter=name))
    assert (back.alias, back.from_version, back.to_version) == ("latest", 3, 2)
    back = registry.Rollback(registry_pb2.RollbackRequest(adapter=name))
    assert (back.from_version, back.to_version) == (2, 1)
    error = rpc_error(registry.Rollback, registry_pb2.RollbackRequest(adapter=name))
    assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "NO_PREVIOUS_VERSION")
    forward = registry_pb2.RollbackRequest(adapter=name, to_version=3)
    assert_status(rpc_error(registry.Rollback, forward), grpc.StatusCode.FAILED_PRECONDITION, "NOT_OLDER")
    # A new publish moves latest forward again; rollback to an explicit version.
    publish(registry, name)
    explicit = registry.Rollback(registry_pb2.RollbackRequest(adapter=name, to_version=2))
    assert (explicit.from_version, explicit.to_version) == (4, 2)
    assert registry.Resolve(registry_pb2.ResolveRequest(reference=name)).version.version == 2


def test_delete_alias(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    publish(registry, name, aliases=("stable",))
    deleted = registry.DeleteAlias(registry_pb2.DeleteAliasRequest(adapter=name, alias="stable"))
    assert deleted.previous_version == 1
    again = registry_pb2.DeleteAliasRequest(adapter=name, alias="stable")
    assert_status(rpc_error(registry.DeleteAlias, again), grpc.StatusCode.NOT_FOUND, "ALIAS_NOT_FOUND")
    latest = registry_pb2.DeleteAliasRequest(adapter=name, alias="latest")
    assert_status(rpc_error(registry.DeleteAlias, latest), grpc.StatusCode.FAILED_PRECONDITION, "ALIAS_MANAGED")
