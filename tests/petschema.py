"""The six-field pydantic model the structured-output tests ask for (SDK and /v1): a bounded string, a bounded
integer, an enum, a bool, a bounded array of enums and a number, every field required and no other allowed, so
that any output the constraint lets through either validates or was cut by max_tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false: else any extra key is valid JSON too
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool
    toys: list[Literal["ball", "rope"]] = Field(max_length=2)
    weight: float
