"""Helpers shared by the RegistryService tests: the stub type and status-code checks."""

from __future__ import annotations

import grpc
import pytest

from opentinker.rpc.serving.errors import error_info
from opentinker.v1 import registry_pb2_grpc

Stub = registry_pb2_grpc.RegistryServiceStub


def rpc_error(fn: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        fn(*args)  # type: ignore[operator]
    return caught.value


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, reason: str) -> None:
    assert isinstance(error, grpc.Call)
    assert error.code() == code, error.details()
    info = error_info(error)
    assert info is not None and info.reason == reason, (info, error.details())
