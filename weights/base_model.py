"""The base model every process serves or trains: where its files are, its one fingerprint, the architectures
served, the LoRA-targetable projections and the device it runs on.

A model is named by a local directory or a Hugging Face hub id; a hub id is looked up in the local cache only
(nothing is ever downloaded at run time). Every process fingerprints the *resolved directory's files*, so the
trainer started with `--model acme/tiny` and a sampler started with the cache path of the same snapshot agree.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument

# config.json model_type values whose decoder the trainer and the sampler both implement.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
# Leaf names of the Llama-family projections, by group: the modules a LoRA adapter may target.
ATTN_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
# The unembedding (output projection, hidden -> vocab). A LoRA on it changes the logits only: with tied embeddings
# (tie_word_embeddings) the input embedding stays frozen, as in peft, which adds the delta after lm_head's matmul.
UNEMBED_MODULE = "lm_head"
# "all-linear" is attn + mlp (peft's "all-linear" leaves the output layer out too); lm_head is named on its own.
LORA_TARGETS: frozenset[str] = frozenset((*ATTN_MODULES, *MLP_MODULES, UNEMBED_MODULE))


def resolve_model_dir(name_or_path: str, revision: str | None = None) -> Path:
    """A local model directory as is; otherwise a Hugging Face hub id, looked up in the local cache only, at
    `revision` (a commit hash, branch or tag, as `hf download --revision` takes it; None: the cached main)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if revision:
            raise InvalidArgument(
                f"--revision {revision!r} applies to a hub id; {name_or_path!r} is a local directory",
                reason="INVALID_REVISION",
            )
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(name_or_path, revision=revision, local_files_only=True))
    except HFValidationError as exc:
        raise InvalidArgument(
            f"base model {name_or_path!r} is neither a local directory nor a valid hub model id",
            reason="MODEL_NOT_FOUND",
        ) from exc
    except LocalEntryNotFoundError as exc:
        fetch = f"hf download {name_or_path}" + (f" --revision {revision}" if revision else "")
        raise FailedPrecondition(
            f"base model {name_or_path!r}{at} is not a local directory and not in the Hugging Face cache; "
            f"download it first (`{fetch}`) or pass a local path",
            reason="MODEL_NOT_CACHED",
        ) from exc


def model_digest(model_dir: Path) -> str:
    """sha256 over the weight and config files of a resolved model directory: adapters record it so a
    mismatched base is refused. Files are read through symlinks (a hub cache snapshot links to its blobs)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and (path.suffix in (".safetensors", ".bin") or path.name == "config.json"):
            digest.update(path.name.encode())
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def pick_device(requested: str) -> str:
    """`auto` is CUDA when present; an explicit `cuda` without CUDA is refused, not silently run on the CPU."""
    import torch

    # device_count() asks NVML when it can, which leaves CUDA uninitialized in this process: a sampler forks its
    # engine process after this, and a child forked from a process that initialized CUDA cannot use it.
    # is_available() would initialize it (cudaGetDeviceCount).
    available = torch.cuda.device_count() > 0
    if requested == "auto":
        return "cuda" if available else "cpu"
    if requested == "cuda" and not available:
        raise InvalidArgument("--device cuda requested but CUDA is not available", reason="NO_CUDA")
    return requested


def pick_dtype(requested: str, device: str) -> str:
    """`auto` is bfloat16 on CUDA (the weights' own precision in every checkpoint served) and float32 on the CPU
    (exact: the trainer and the sampler agree to 1e-5, docs/models.md); an explicit dtype is kept."""
    if requested == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return requested
