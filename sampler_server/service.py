"""SamplerService: the gRPC servicer, its handlers put together by job: those that run the model (Sample,
ComputeLogprobs: generation_handlers.py) and those that administer the adapters and report (load, pin, unload,
list, info, stats: adapter_admin.py), over the state they share (servicer_state.py). Requests are converted into
the engine's typed records at this edge (sample_request.py); nothing behind it sees a protobuf message."""

from __future__ import annotations

from opentinker.sampler_server.adapter_admin import AdapterAdminHandlers
from opentinker.sampler_server.generation_handlers import GenerationHandlers
from opentinker.v1 import sampler_pb2_grpc


class SamplerServicer(GenerationHandlers, AdapterAdminHandlers, sampler_pb2_grpc.SamplerServiceServicer):
    """Registered with add_SamplerServiceServicer_to_server (build.py); constructed with ServicerState's
    arguments."""
