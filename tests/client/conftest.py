"""The client tests' tokenizer and renderer over the session's tiny model (tests/conftest.py's tiny_model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from opentinker.client.renderer import Renderer


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def renderer(tiny_model: Path) -> Renderer:
    return Renderer.from_pretrained(tiny_model)
