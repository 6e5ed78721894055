"""Peft LoRA folders in and out of the registry: check a folder trained elsewhere before it becomes a version,
and write a version back out as a plain peft folder.

A folder is importable when the trainer and the sampler can use it exactly as peft does: `adapter_config.json`
(peft_type LORA, no DoRA, no per-module ranks or alphas, no bias or modules_to_save) and
`adapter_model.safetensors` holding one `lora_A`/`lora_B` pair per targeted projection with shapes that agree
with the rank and, when the base model is at hand, with the base model's own weights. Everything is checked
before anything is sent, so a refused import changes nothing in the registry.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from opentinker.trainer_server.base_model import ATTN_MODULES, MLP_MODULES, model_digest
from opentinker.v1 import common_pb2

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PEFT_PREFIX = "base_model.model."
SERVABLE_MODULES = frozenset(ATTN_MODULES + MLP_MODULES)
MAX_RANK = 1024  # the registry's limit


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

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.rsplit(".", 1)[-1] for m in self.modules})

    def lora_config(self) -> common_pb2.LoraConfig:
        # rsLoRA scales by alpha / sqrt(r); the registry's config (alpha / r) is descriptive only, the artifact's
        # adapter_config.json is what the sampler and trainer read.
        return common_pb2.LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                                     target_modules=self.target_modules)  # fmt: skip


def _fail(directory: Path, why: str) -> PeftFolderError:
    return PeftFolderError(f"{directory}: {why}")


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise _fail(directory, f"cannot read {CONFIG_FILE}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail(directory, f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(directory, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_features(directory: Path, config: dict[str, Any]) -> tuple[int, float, float, bool]:
    """Rank, alpha, dropout, rslora; refuses every peft feature that would change the math we serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(directory, f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layouts"),
                       ("lora_bias", "LoRA bias terms")):  # fmt: skip
        if config.get(flag):
            raise _fail(directory, f"{what} is not supported ({flag}: true)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _fail(directory, f"per-module ranks or alphas ({key}) are not supported")
    if config.get("modules_to_save"):
        raise _fail(directory, f"modules_to_save {config['modules_to_save']} (full weights) are not supported")
    if config.get("bias", "none") != "none":
        raise _fail(directory, f"bias {config['bias']!r} is not supported (only 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise _fail(directory, f"rank r={rank!r} must be an integer in [1, {MAX_RANK}]")
    alpha = config.get("lora_alpha", rank)
    dropout = config.get("lora_dropout", 0.0) or 0.0
    if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise _fail(directory, f"lora_alpha {alpha!r} must be a positive number")
    if not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise _fail(directory, f"lora_dropout {dropout!r} must be in [0, 1)")
    return rank, float(alpha), float(dropout), bool(config.get("use_rslora"))


def _base_shapes(base_model: Path) -> dict[str, tuple[int, int]]:
    """Linear weight path (without '.weight') -> (d_in, d_out), from the safetensors headers only."""
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
    return shapes


def _read_pairs(directory: Path, rank: int) -> dict[str, tuple[int, int]]:
    """Module -> (d_in, d_out) of every lora_A/lora_B pair; refuses anything else in the weights file."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        hint = " (adapter_model.bin found: re-save it with safe_serialization=True)" if (
            directory / "adapter_model.bin").exists() else ""  # fmt: skip
        raise _fail(directory, f"missing {WEIGHTS_FILE}{hint}")
    shapes: dict[str, list[int]] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
            for key in keys:
                shapes[key] = list(handle.get_slice(key).get_shape())
            for key in keys:
                tensor = handle.get_tensor(key)
                if not bool(tensor.float().isfinite().all()):
                    raise _fail(directory, f"{WEIGHTS_FILE}: {key} has non-finite values")
    except (SafetensorError, OSError) as exc:
        raise _fail(directory, f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None
    modules: dict[str, tuple[int, int]] = {}
    for key, shape in shapes.items():
        if key.endswith(".lora_B.weight") and key.replace(".lora_B.", ".lora_A.") in shapes:
            continue
        if not key.startswith(PEFT_PREFIX) or not key.endswith(".lora_A.weight"):
            raise _fail(directory, f"{WEIGHTS_FILE}: unexpected tensor {key!r} (only "
                        f"'{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight' pairs)")  # fmt: skip
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b_shape = shapes.get(key.replace(".lora_A.", ".lora_B."))
        if b_shape is None:
            raise _fail(directory, f"{WEIGHTS_FILE}: {module} has lora_A but no lora_B")
        if len(shape) != 2 or len(b_shape) != 2 or shape[0] != rank or b_shape[1] != rank:
            raise _fail(directory, f"{WEIGHTS_FILE}: {module} has lora_A {shape} / lora_B {b_shape}, "
                        f"which does not match rank r={rank}")  # fmt: skip
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in SERVABLE_MODULES:
            raise _fail(directory, f"targets {module!r}; only {', '.join(sorted(SERVABLE_MODULES))} can be served")
        modules[module] = (shape[1], b_shape[0])
    if not modules:
        raise _fail(directory, f"{WEIGHTS_FILE} holds no LoRA weights")
    return modules


def _check_targets(directory: Path, config: dict[str, Any], modules: dict[str, tuple[int, int]]) -> None:
    targets = config.get("target_modules")
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    if isinstance(targets, list) and targets and not leaves <= {str(t).rsplit(".", 1)[-1] for t in targets}:
        raise _fail(directory, f"weights for {sorted(leaves)} but target_modules is {targets}")


def inspect_peft_folder(directory: Path, base_model: Path | None = None) -> PeftAdapter:
    """The adapter in `directory`, checked; against `base_model` (a local HF folder) when given, else against
    the config's base_model_name_or_path when that is a local folder. PeftFolderError otherwise."""
    if not directory.is_dir():
        raise PeftFolderError(f"{directory}: not a directory")
    config = _read_config(directory)
    rank, alpha, dropout, rslora = _check_features(directory, config)
    modules = _read_pairs(directory, rank)
    _check_targets(directory, config, modules)
    named_base = str(config.get("base_model_name_or_path") or "")
    notes: list[str] = []
    if base_model is None and named_base and Path(named_base).is_dir():
        base_model = Path(named_base)
        notes.append(f"checked against base_model_name_or_path {named_base}")
    digest = checked = ""
    if base_model is not None:
        base_shapes = _base_shapes(base_model)
        for module, (d_in, d_out) in sorted(modules.items()):
            if module not in base_shapes:
                raise _fail(directory, f"targets {module!r}, which base model {base_model} does not have")
            if base_shapes[module] != (d_in, d_out):
                raise _fail(directory, f"{module} maps {d_in} -> {d_out} features but base model {base_model} "
                            f"has {base_shapes[module][0]} -> {base_shapes[module][1]}")  # fmt: skip
        digest, checked = model_digest(base_model), str(base_model)
    else:
        notes.append("base model not checked (pass --base-model DIR)")
    sha = hashlib.sha256()
    with (directory / WEIGHTS_FILE).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return PeftAdapter(directory=directory, rank=rank, alpha=alpha, dropout=dropout, use_rslora=rslora,
                       modules=modules, base_model_name_or_path=named_base, weights_sha256=sha.hexdigest(),
                       base_model_digest=digest, base_model_checked=checked, notes=notes)  # fmt: skip


def write_peft_folder(artifact: Path, out_dir: Path, *, base_model_name_or_path: str | None = None) -> list[Path]:
    """Copies a stored artifact's peft files to `out_dir` (new or empty); optionally renames the base model in
    adapter_config.json (the weights file is copied byte for byte). Returns the files written."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PeftFolderError(f"{out_dir}: exists and is not an empty directory")
    missing = [name for name in PEFT_FILES if not (artifact / name).is_file()]
    if missing:
        raise PeftFolderError(f"this version's artifact is not a peft folder (no {', '.join(missing)})")
    out_dir.mkdir(parents=True, exist_ok=True)
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
