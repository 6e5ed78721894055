"""Helpers for tests that need registry content: unique names, uploaded artifacts, published versions, valid
LoRA snapshots for the tiny model (what a trainer would publish, without one)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def artifact_files(seed: int = 0, size: int = 2048) -> dict[str, bytes]:
    payload = hashlib.sha256(f"weights-{seed}".encode()).digest() * (size // 32)
    config = json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "seed": seed}).encode()
    return {"adapter_config.json": config, "adapter_model.safetensors": payload}


def upload_requests(files: dict[str, bytes], chunk: int = 1000) -> Iterator[registry_pb2.UploadArtifactRequest]:
    headers = [
        registry_pb2.ArtifactFileHeader(path=p, size_bytes=len(b), sha256=hashlib.sha256(b).hexdigest())
        for p, b in files.items()
    ]
    yield registry_pb2.UploadArtifactRequest(manifest=registry_pb2.ArtifactManifest(files=headers))
    data = b"".join(files.values())
    for i in range(0, len(data), chunk):
        yield registry_pb2.UploadArtifactRequest(chunk=data[i : i + chunk])


def upload(stub: registry_pb2_grpc.RegistryServiceStub, files: dict[str, bytes], **kw: object) -> str:
    response: registry_pb2.UploadArtifactResponse = stub.UploadArtifact(upload_requests(files), **kw)
    return response.artifact_uri


def create_adapter(
    stub: registry_pb2_grpc.RegistryServiceStub, name: str, base_model_digest: str = "", **kw: object
) -> registry_pb2.Adapter:
    """kw: call options (metadata, timeout)."""
    request = registry_pb2.CreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=8), base_model_digest=base_model_digest
    )
    response: registry_pb2.CreateAdapterResponse = stub.CreateAdapter(request, **kw)
    return response.adapter


def publish(
    stub: registry_pb2_grpc.RegistryServiceStub,
    name: str,
    *,
    seed: int | None = None,
    parent: int = 0,
    aliases: tuple[str, ...] = (),
    metadata: list[tuple[str, str]] | None = None,
    lineage: registry_pb2.Lineage | None = None,
    **fields: Any,
) -> registry_pb2.PublishVersionResponse:
    """lineage: more lineage fields (metrics, batches); parent and step are set from `parent`."""
    files = artifact_files(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    uri = upload(stub, files, metadata=metadata)
    extra = lineage
    lineage = registry_pb2.Lineage(parent_version=parent, trainer_step=parent + 1)
    if extra is not None:
        lineage.MergeFrom(extra)
    request = registry_pb2.PublishVersionRequest(
        adapter=name, artifact_uri=uri, lineage=lineage, aliases=list(aliases), **fields
    )
    response: registry_pb2.PublishVersionResponse = stub.PublishVersion(request, metadata=metadata)
    return response


def lora_files(model: Path, seed: int, rank: int = 4, scale: float = 0.5) -> dict[str, bytes]:
    """A valid peft LoRA snapshot (q_proj and v_proj of every layer) for the model in `model`, distinct per
    seed: what a trainer would publish, without needing one."""
    import torch
    from safetensors.torch import save as save_safetensors

    config = json.loads((model / "config.json").read_text())
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = hidden // int(config["num_attention_heads"])
    outs = {"q_proj": hidden, "v_proj": head_dim * int(config["num_key_value_heads"])}
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for module, d_out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator) * scale
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": float(rank),
        "target_modules": sorted(outs),
        "task_type": "CAUSAL_LM",
        "seed": seed,
    }
    return {
        "adapter_config.json": json.dumps(adapter_config, sort_keys=True).encode(),
        "adapter_model.safetensors": save_safetensors(tensors),
    }


def publish_lora(
    stub: registry_pb2_grpc.RegistryServiceStub,
    model: Path,
    name: str,
    seed: int,
    *,
    skip_latest: bool = False,
    request_id: str = "",
    timeout: float = 30,
) -> registry_pb2.Version:
    uri = upload(stub, lora_files(model, seed), timeout=timeout)
    request = registry_pb2.PublishVersionRequest(
        adapter=name,
        artifact_uri=uri,
        skip_latest=skip_latest,
        request_id=request_id,
        lora_config=common_pb2.LoraConfig(rank=4, alpha=4.0, target_modules=["q_proj", "v_proj"]),
    )
    response: registry_pb2.PublishVersionResponse = stub.PublishVersion(request, timeout=timeout)
    return response.version


def flip_bit(path: Path) -> None:
    """Damages a stored file the way a failing disk does: one bit in its middle, size unchanged."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
