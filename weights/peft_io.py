"""Peft LoRA folders in and out of the registry: check a folder trained elsewhere before it becomes a version,
and write a version back out as a plain peft folder.

A folder is importable when it passes the format rules every process applies (`opentinker.weights.peft`) and,
when the base model is at hand, its shapes agree with the base model's own weights. Everything is checked
before anything is sent, so a refused import changes nothing in the registry.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError, safe_open

from opentinker.v1 import common_pb2
from opentinker.weights.base_model import UNEMBED_MODULE, model_digest
from opentinker.weights.peft import (
    CONFIG_FILE,
    FULL_UNEMBED_KEY,
    PEFT_FILES,
    WEIGHTS_FILE,
    LoraMagnitudeError,
    PeftFormatError,
    check_lora_magnitudes,
    lora_modules,
    read_peft_config,
)


class PeftFolderError(ValueError):
    """A folder that is not an importable peft LoRA adapter; the message says which file and why."""


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    directory: Path
    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    modules: dict[str, tuple[int, int]]  # module path (without the peft prefix) -> (d_in, d_out)
    base_model_name_or_path: str
    weights_sha256: str
    base_model_digest: str = ""  # set when the base model was available to check against
    base_model_checked: str = ""  # the directory the shapes were checked against
    notes: list[str] = field(default_factory=list)
    dropped: tuple[str, ...] = ()  # tensors of the folder left out of the import (write_import_files)

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.rsplit(".", 1)[-1] for m in self.modules})

    def lora_config(self) -> common_pb2.LoraConfig:
        # rsLoRA scales by alpha / sqrt(r); the registry's config (alpha / r) is descriptive only, the artifact's
        # adapter_config.json is what the sampler and trainer read.
        return common_pb2.LoraConfig(
            rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=self.target_modules
        )


def _fail(directory: Path, why: str) -> PeftFolderError:
    return PeftFolderError(f"{directory}: {why}")


def _base_shapes(base_model: Path) -> dict[str, tuple[int, int]]:
    """Linear weight path (without '.weight') -> (d_in, d_out), from the safetensors headers only (lm_head from the
    embedding when the checkpoint ties them and stores no lm_head); a base model no server can serve (another
    family, longrope, ...) is refused first, as the servers refuse it."""
    from opentinker.rpc.serving.errors import ServiceError
    from opentinker.weights.model_config import load_config

    try:
        load_config(base_model)
    except ServiceError as exc:
        raise PeftFolderError(f"base model {base_model}: {exc.message}") from None
    shapes: dict[str, tuple[int, int]] = {}
    files = sorted(base_model.glob("*.safetensors"))
    if not files:
        raise PeftFolderError(f"base model {base_model}: no *.safetensors weights to check the adapter against")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 -- safe_open handles are not iterable
                if key.endswith(".weight"):
                    shape = handle.get_slice(key).get_shape()
                    if len(shape) == 2:
                        shapes[key.removesuffix(".weight")] = (int(shape[1]), int(shape[0]))
    if UNEMBED_MODULE not in shapes and "model.embed_tokens" in shapes:  # tied: the embedding is the output layer
        shapes[UNEMBED_MODULE] = shapes["model.embed_tokens"]
    return shapes


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtype names; LoRA weights are floats


def _refuse_symlinks(directory: Path) -> None:
    """The peft files must be regular files inside the folder: a symlink could pull bytes from anywhere."""
    for name in PEFT_FILES:
        if (directory / name).is_symlink():
            raise _fail(directory, f"{name} is a symlink (copy the file itself into the folder)")


def _read_weights(directory: Path, scaling: float) -> dict[str, list[int]]:
    """Tensor name -> shape of the weights file; refuses an unreadable file, non-float dtypes, and weights or a
    scaling beyond the one magnitude rule (`check_lora_magnitudes`: finite, |w| <= 1e4, scaling <= 1024)."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        hint = (
            " (adapter_model.bin found: re-save it with safe_serialization=True)"
            if (directory / "adapter_model.bin").exists()
            else ""
        )
        raise _fail(directory, f"missing {WEIGHTS_FILE}{hint}")
    shapes: dict[str, list[int]] = {}
    try:
        check_lora_magnitudes({}, scaling)
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 -- safe_open handles are not iterable
                piece = handle.get_slice(key)
                if piece.get_dtype() not in FLOAT_DTYPES:
                    raise _fail(
                        directory,
                        f"{WEIGHTS_FILE}: {key} has dtype {piece.get_dtype()} "
                        f"(LoRA weights must be one of {', '.join(FLOAT_DTYPES)})",
                    )
                shapes[key] = list(piece.get_shape())
                check_lora_magnitudes({key: handle.get_tensor(key)}, scaling)
    except LoraMagnitudeError as exc:
        raise _fail(directory, f"{WEIGHTS_FILE}: {exc}") from None
    except (SafetensorError, OSError) as exc:
        raise _fail(directory, f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None
    return shapes


def _unembed_file(base_model: Path) -> tuple[Path, str] | None:
    """The base checkpoint's file and tensor name of its output layer: lm_head.weight, or the embedding when tied."""
    for name in (f"{UNEMBED_MODULE}.weight", "model.embed_tokens.weight"):
        for path in sorted(base_model.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                if name in handle.keys():  # noqa: SIM118 -- safe_open handles are not iterable
                    return path, name
    return None


def _is_base_unembed(directory: Path, base_model: Path) -> bool:
    """Whether the adapter's full lm_head copy holds exactly the base model's output layer (compared in float32, a
    block of rows at a time: a vocabulary-wide matrix can be gigabytes)."""
    found = _unembed_file(base_model)
    if found is None:
        return False
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as mine, safe_open(str(found[0]), "pt") as base:
        copy, original = mine.get_slice(FULL_UNEMBED_KEY), base.get_slice(found[1])
        rows = copy.get_shape()[0]
        if copy.get_shape() != original.get_shape():
            return False
        for start in range(0, rows, 4096):
            if not copy[start : start + 4096].float().equal(original[start : start + 4096].float()):
                return False
    return True


def inspect_peft_folder(directory: Path, base_model: Path | None = None) -> PeftAdapter:
    """The adapter in `directory`, checked; against `base_model` (a local HF folder) when given, else against
    the config's base_model_name_or_path when that is a local folder. PeftFolderError otherwise."""
    if not directory.is_dir():
        raise PeftFolderError(f"{directory}: not a directory")
    _refuse_symlinks(directory)
    try:
        config = read_peft_config(directory / CONFIG_FILE)
    except PeftFormatError as exc:
        raise _fail(directory, str(exc)) from None
    shapes = _read_weights(directory, config.scaling)
    named_base = config.base_model_name_or_path
    notes: list[str] = []
    if base_model is None and named_base and Path(named_base).is_dir():
        base_model = Path(named_base)
        notes.append(f"checked against base_model_name_or_path {named_base}")
    base_shapes = _base_shapes(base_model) if base_model is not None else None  # a base no server serves: refused
    # peft saves the whole base lm_head next to a LoRA on it (save_embedding_layers="auto"): a copy equal to the
    # base model's changes nothing and is left out of the import; one that differs is a trained or resized output
    # layer (full weights, which no process serves); without a base model to compare, lora_modules refuses it.
    dropped: tuple[str, ...] = ()
    if FULL_UNEMBED_KEY in shapes and base_model is not None:
        if not _is_base_unembed(directory, base_model):
            raise _fail(
                directory,
                f"{WEIGHTS_FILE}: {FULL_UNEMBED_KEY} differs from base model {base_model}'s "
                "lm_head: a trained or resized output layer is full weights, which none serves",
            )
        del shapes[FULL_UNEMBED_KEY]
        dropped = (FULL_UNEMBED_KEY,)
        notes.append(f"left out {FULL_UNEMBED_KEY}: peft's copy of the base model's lm_head (equal to it)")
    try:
        modules = lora_modules(shapes, config)
    except PeftFormatError as exc:
        raise _fail(directory, str(exc)) from None
    digest = checked = ""
    if base_model is not None and base_shapes is not None:
        for module, (d_in, d_out) in sorted(modules.items()):
            if module not in base_shapes:
                raise _fail(directory, f"targets {module!r}, which base model {base_model} does not have")
            if base_shapes[module] != (d_in, d_out):
                raise _fail(
                    directory,
                    f"{module} maps {d_in} -> {d_out} features but base model {base_model} "
                    f"has {base_shapes[module][0]} -> {base_shapes[module][1]}",
                )
        digest, checked = model_digest(base_model), str(base_model)
    else:
        notes.append("base model not checked (pass --base-model DIR)")
    sha = hashlib.sha256()
    with (directory / WEIGHTS_FILE).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return PeftAdapter(
        directory=directory,
        rank=config.rank,
        alpha=config.alpha,
        dropout=config.dropout,
        use_rslora=config.use_rslora,
        modules=modules,
        base_model_name_or_path=named_base,
        weights_sha256=sha.hexdigest(),
        base_model_digest=digest,
        base_model_checked=checked,
        notes=notes,
        dropped=dropped,
    )


def write_import_files(adapter: PeftAdapter, out_dir: Path) -> None:
    """The peft files an import publishes, into `out_dir`: copied byte for byte, or the weights rewritten without
    the tensors the inspection left out (`dropped`), so the artifact is exactly what the sampler and trainer read."""
    shutil.copyfile(adapter.directory / CONFIG_FILE, out_dir / CONFIG_FILE)
    if not adapter.dropped:
        shutil.copyfile(adapter.directory / WEIGHTS_FILE, out_dir / WEIGHTS_FILE)
        return
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter.directory / WEIGHTS_FILE))
    with safe_open(str(adapter.directory / WEIGHTS_FILE), framework="pt") as handle:
        metadata = handle.metadata()
    save_file({k: v for k, v in tensors.items() if k not in adapter.dropped}, str(out_dir / WEIGHTS_FILE), metadata)


def check_export_target(out_dir: Path) -> None:
    """An export writes only into a new or empty real directory: never through a symlink (dangling or not)."""
    if out_dir.is_symlink():
        raise PeftFolderError(f"{out_dir}: is a symlink; export into a new or empty directory")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PeftFolderError(f"{out_dir}: exists and is not an empty directory")


def write_peft_folder(artifact: Path, out_dir: Path, *, base_model_name_or_path: str | None = None) -> list[Path]:
    """Copies a stored artifact's peft files to `out_dir` (new or empty); optionally renames the base model in
    adapter_config.json (the weights file is copied byte for byte). Returns the files written."""
    check_export_target(out_dir)
    missing = [name for name in PEFT_FILES if not (artifact / name).is_file()]
    if missing:
        raise PeftFolderError(f"this version's artifact is not a peft folder (no {', '.join(missing)})")
    out_dir.mkdir(parents=True, exist_ok=True)
    check_export_target(out_dir)  # nothing slipped in between
    written = []
    for name in PEFT_FILES:
        target = out_dir / name
        if name == CONFIG_FILE and base_model_name_or_path is not None:
            config = json.loads((artifact / name).read_text())
            config["base_model_name_or_path"] = base_model_name_or_path
            target.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(artifact / name, target)
        written.append(target)
    return written
