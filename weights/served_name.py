"""The base model's public name: what clients call it (the tinker SDK's `base_model`, the tokenizer id it loads
from a Hugging Face cache), the same in every process serving the same model.

The name is, in order: the hub id given as `--model`; else `--served-model-name`; else the hub id the model's own
`config.json` names (`_name_or_path`, which transformers writes when it saves a model it loaded from the hub); else
the hub id of a cache snapshot directory (`.../models--org--name/snapshots/<rev>`); else the directory as given
(a tokenizer id that loads on the machines sharing that path, as before names existed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from opentinker.rpc.serving.errors import InvalidArgument

# `org/name` as the hub spells model ids (one slash, no leading dot or dash).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# A served name: printable, no spaces, short enough for a log line and a URL path.
SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,199}")


def check_served_name(name: str) -> str:
    if not SERVED_NAME.fullmatch(name):
        raise InvalidArgument(
            f"served model name {name!r} must be 1-200 characters of letters, digits and ._/:@+- "
            "starting with a letter or digit (e.g. a hub id such as Qwen/Qwen3-4B-Instruct-2507)",
            reason="INVALID_SERVED_NAME",
        )
    return name


def served_model_name(model: str, served: str | None, model_dir: Path) -> str:
    """The public name of the model `model` (as given to `--model`) resolved to `model_dir`."""
    is_hub_id = not Path(model).expanduser().is_dir()
    if served is not None:
        check_served_name(served)
        if is_hub_id and served != model:
            # Two public names for one model would make the tokenizer id ambiguous: the hub id is the name.
            raise InvalidArgument(
                f"--served-model-name {served!r} differs from the hub id {model!r} given as --model, which is "
                "the model's name; drop one of them",
                reason="INVALID_SERVED_NAME",
            )
        return served
    if is_hub_id:
        return model
    return _config_name(model_dir) or _cache_name(model_dir) or model


def _config_name(model_dir: Path) -> str | None:
    try:
        recorded = json.loads((model_dir / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None  # the config's own checks (model_config.py) report a broken file
    if isinstance(recorded, str) and HUB_ID.fullmatch(recorded) and not Path(recorded).exists():
        return recorded
    return None


def _cache_name(model_dir: Path) -> str | None:
    parts = model_dir.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        org_name = parts[-3].removeprefix("models--").split("--", 1)
        if len(org_name) == 2 and HUB_ID.fullmatch("/".join(org_name)):
            return "/".join(org_name)
    return None
