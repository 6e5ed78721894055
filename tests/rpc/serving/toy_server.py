"""A small RegistryService servicer run through the real server scaffolding, to test the scaffolding alone.

Run: python tests/rpc/serving/toy_server.py --ready-file F [--tokens-file T] [--host H] [--insecure-public]
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from opentinker.rpc.serving.auth import current_principal, require_access, require_admin
from opentinker.rpc.serving.errors import InvalidArgument, NotFound
from opentinker.rpc.serving.server import ServerOptions, ServiceBinding, configure_logging, serve_forever
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.names import check_adapter_name


class ToyRegistry(registry_pb2_grpc.RegistryServiceServicer):
    async def GetAdapter(self, request: registry_pb2.GetAdapterRequest, context: Any) -> Any:
        name = check_adapter_name(request.name)
        require_access(name)
        if name != "team-a/known":
            raise NotFound(f"adapter {name!r} not found", reason="ADAPTER_NOT_FOUND", adapter=name)
        principal = current_principal()
        return registry_pb2.GetAdapterResponse(
            adapter=registry_pb2.Adapter(name=name, tenant="team-a", created_by=principal.actor)
        )

    async def DeleteAdapter(self, request: registry_pb2.DeleteAdapterRequest, context: Any) -> Any:
        require_admin("DeleteAdapter")
        return registry_pb2.DeleteAdapterResponse(event_id="0-1")

    async def ListAdapters(self, request: registry_pb2.ListAdaptersRequest, context: Any) -> Any:
        raise RuntimeError("secret internal detail that must not reach clients")

    async def WatchEvents(self, request: registry_pb2.WatchEventsRequest, context: Any) -> AsyncIterator[Any]:
        for i in range(2):
            yield registry_pb2.WatchEventsResponse(event=registry_pb2.Event(event_id=f"0-{i + 1}"))
        raise InvalidArgument("stream ends with a typed error", reason="TOY_STREAM_ERROR")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--tokens-file", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--insecure-public", action="store_true")
    parser.add_argument("--drain-seconds", type=float, default=1.0)
    args = parser.parse_args()
    configure_logging()
    options = ServerOptions(
        host=args.host,
        tokens_file=args.tokens_file,
        insecure_public=args.insecure_public,
        ready_file=args.ready_file,
        drain_seconds=args.drain_seconds,
        grace_seconds=2.0,
    )
    binding = ServiceBinding(
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name,
        lambda server: registry_pb2_grpc.add_RegistryServiceServicer_to_server(ToyRegistry(), server),
    )
    serve_forever("toy", [binding], options)


if __name__ == "__main__":
    main()
