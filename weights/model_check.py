"""The check a server starting on a model runs before the slow load: the model is there, its family is one we
serve, and the name it will be served under is valid. Each failure is a StartupError naming the flag to change."""

from __future__ import annotations

from pathlib import Path

from opentinker.rpc.process.startup import StartupError
from opentinker.rpc.serving.errors import ServiceError


def check_model(model: str, revision: str | None = None, served_name: str | None = None) -> Path:
    """The model's directory, or StartupError naming --model: found before the slow load, not as a hub OSError.
    Its config.json is read and checked too (an unsupported family is refused before any weight is read), and
    the public name it will be served under (--served-model-name, weights/served_name.py)."""
    # Imported here: model_config imports torch (rope), which a command line that only checks should not load.
    from opentinker.weights.base_model import resolve_model_dir
    from opentinker.weights.model_config import load_config
    from opentinker.weights.served_name import served_model_name

    try:
        model_dir = resolve_model_dir(model, revision)
    except ServiceError as exc:
        raise StartupError(f"{exc.message} (--model)") from None
    if not (model_dir / "config.json").is_file():
        raise StartupError(f"--model {model}: {model_dir} has no config.json; pass a Hugging Face model directory")
    try:
        load_config(model_dir)
    except ServiceError as exc:
        raise StartupError(f"--model {model}: {exc.message}") from None
    try:
        served_model_name(model, served_name, model_dir)
    except ServiceError as exc:
        raise StartupError(exc.message) from None
    return model_dir
