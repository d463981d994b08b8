"""The values table of helm/spindle/README.md, generated from values.yaml's `# --` comments.

    .venv/bin/python -m tests.helm.values_doc          # rewrite the table in the README
    .venv/bin/python -m tests.helm.values_doc --check  # exit 1 when the README is stale

helm-docs' comment convention, read without helm-docs (a Go binary no registry here ships):
a `# -- text` line documents the key below it. A documented map whose children carry no
comments is one row (a Kubernetes object such as a securityContext, shown whole); one whose
children are documented gets a row per child. Types come from values.schema.json.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "spindle"
README = CHART / "README.md"
BEGIN, END = "<!-- values-table:begin -->", "<!-- values-table:end -->"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w-]*):(?P<rest>.*)$")


@dataclass(frozen=True)
class Row:
    path: tuple[str, ...]
    description: str


def documented_keys(text: str) -> dict[tuple[str, ...], str]:
    """Map each key path with a `# --` comment to its description, in file order."""
    docs: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    pending: str | None = None
    block_indent: int | None = None  # inside a `|` / `>` block scalar: its key's indent
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if block_indent is not None:
            if not line.strip() or indent > block_indent:
                continue
            block_indent = None
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = stripped.removeprefix("# --").strip()
            continue
        match = _KEY.match(line)
        if not match:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        if pending is not None:
            docs[tuple(key for _, key in stack)] = pending
            pending = None
        if match["rest"].strip() in ("|", "|-", ">", ">-"):
            block_indent = indent
    return docs


def all_key_paths(values: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if not isinstance(values, dict):
        return []
    paths = []
    for key, value in values.items():
        paths.append((*prefix, key))
        paths += all_key_paths(value, (*prefix, key))
    return paths


def _has_documented_children(path: tuple[str, ...], docs: dict[tuple[str, ...], str]) -> bool:
    return any(len(d) > len(path) and d[: len(path)] == path for d in docs)


def undocumented(values: dict[str, Any], docs: dict[tuple[str, ...], str]) -> list[tuple[str, ...]]:
    """Keys that need a `# --` comment: all, except inside a documented map none of whose children are."""

    def opaque(prefix: tuple[str, ...]) -> bool:
        return prefix in docs and not _has_documented_children(prefix, docs)

    return [path for path in all_key_paths(values)
            if path not in docs and not any(opaque(path[:i]) for i in range(1, len(path)))]


def _lookup(values: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        values = values[key]
    return values


def schema_node(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    """The schema of a key path, following properties and local $refs; None when not declared."""
    node: dict[str, Any] | None = schema
    for key in path:
        node = _resolve(schema, node or {}).get("properties", {}).get(key)
        if node is None:
            return None
    return _resolve(schema, node or {})


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = _lookup(schema, tuple(node["$ref"].removeprefix("#/").split("/")))
    return node


def _type(node: dict[str, Any] | None) -> str:
    if not node:
        return ""
    if "enum" in node and "type" not in node:
        return " \\| ".join(json.dumps(v) for v in node["enum"])
    kind = node.get("type", "")
    return " or ".join(kind) if isinstance(kind, list) else kind


def table(values_text: str, schema: dict[str, Any]) -> str:
    values = yaml.safe_load(values_text)
    docs = documented_keys(values_text)
    lines = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for path, description in docs.items():
        default = "" if _has_documented_children(path, docs) else f"`{json.dumps(_lookup(values, path))}`"
        default = default.replace("|", "\\|")
        cell = description.replace("|", "\\|")
        lines.append(f"| `{'.'.join(path)}` | {_type(schema_node(schema, path))} | {default} | {cell} |")
    return "\n".join(lines)


def expected_readme() -> str:
    readme = README.read_text()
    assert BEGIN in readme and END in readme, f"{README} lacks the {BEGIN} / {END} markers"
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    schema = json.loads((CHART / "values.schema.json").read_text())
    return f"{head}{BEGIN}\n{table((CHART / 'values.yaml').read_text(), schema)}\n{END}{tail}"


def main(argv: list[str]) -> int:
    expected = expected_readme()
    if "--check" in argv:
        if README.read_text() != expected:
            print(f"{README} is stale: run .venv/bin/python -m tests.helm.values_doc", file=sys.stderr)
            return 1
        return 0
    README.write_text(expected)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
