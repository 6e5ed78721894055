"""What the training loops show and write: a rich progress display and the metrics file (JSON lines)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["append_jsonl", "progress_display"]


@contextmanager
def progress_display(progress: bool | Progress) -> Iterator[Progress | None]:
    """The caller's started Progress, a new one (True) or None (False)."""
    if isinstance(progress, Progress):
        yield progress
        return
    if not progress:
        yield None
        return
    display = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with display:
        yield display


def append_jsonl(path: Path | None, record: Mapping[str, Any]) -> None:
    """Appends ``record`` as one JSON line to ``path`` (None: nowhere)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record, sort_keys=True) + "\n")
