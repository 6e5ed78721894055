"""docs/architecture.md's module tables match the tree: every module of every package has its row, in the
table of its package, and no row names a module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("registry", "trainer_server", "sampler_server", "gateway", "weights", "rpc", "client", "cli")
SUBPACKAGE_INITS = {"kernels", "model"}  # their __init__ holds code, so it has a row of its own


def tree_modules(package: str) -> set[str]:
    modules = set()
    for path in (ROOT / package).rglob("*.py"):
        if path.name == "__init__.py" and path.parent.name not in SUBPACKAGE_INITS:
            continue
        modules.add(path.relative_to(ROOT / package).as_posix())
    return modules


def documented_modules(text: str) -> dict[str, set[str]]:
    """package -> the modules its table lists (`### \\`pkg/\\`` heading, then rows `| \\`module.py\\` | job |`)."""
    tables: dict[str, set[str]] = {}
    package = None
    for line in text.splitlines():
        if heading := re.match(r"### `(\w+)/`$", line):
            package = heading.group(1)
            tables[package] = set()
        elif line.startswith("## "):
            package = None
        elif package is not None and (row := re.match(r"\| `([\w/]+\.py)` \| (.+) \|$", line)):
            assert row.group(2).strip(), f"{package}/{row.group(1)} has an empty job"
            tables[package].add(row.group(1))
    return tables


def test_every_module_has_its_row_and_every_row_its_module() -> None:
    tables = documented_modules((ROOT / "docs" / "architecture.md").read_text())
    assert set(tables) == set(PACKAGES)
    for package in PACKAGES:
        in_tree = tree_modules(package)
        assert in_tree, package
        missing, gone = in_tree - tables[package], tables[package] - in_tree
        assert not missing, f"docs/architecture.md lacks rows for {package}/: {sorted(missing)}"
        assert not gone, f"docs/architecture.md lists modules {package}/ no longer has: {sorted(gone)}"


def test_the_parser_sees_a_missing_row() -> None:
    text = "### `rpc/`\n\n| module | job |\n| --- | --- |\n| `auth.py` | Tokens. |\n\n## Next\n"
    assert documented_modules(text) == {"rpc": {"auth.py"}}
    assert tree_modules("rpc") - documented_modules(text)["rpc"]  # the tree has more: the check would fail
