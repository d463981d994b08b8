"""values.yaml documents every key, the schema declares every documented key, the README table is current."""

from __future__ import annotations

import json

import yaml

from tests.helm import values_doc
from tests.helm.chart import CHART


def test_every_value_has_a_doc_comment() -> None:
    text = (CHART / "values.yaml").read_text()
    missing = values_doc.undocumented(yaml.safe_load(text), values_doc.documented_keys(text))
    assert not missing, "keys without a `# --` comment: " + ", ".join(".".join(p) for p in missing)


def test_schema_declares_every_documented_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    docs = values_doc.documented_keys((CHART / "values.yaml").read_text())
    missing = [".".join(p) for p in docs if values_doc.schema_node(schema, p) is None]
    assert not missing, f"values.schema.json does not declare: {', '.join(missing)}"


def test_values_keys_are_camel_case() -> None:
    docs = values_doc.documented_keys((CHART / "values.yaml").read_text())
    # grafana_dashboard is the label Grafana's sidecar looks for, not a chart setting.
    bad = [".".join(p) for p in docs if any(("-" in k or "_" in k) and k != "grafana_dashboard" for k in p)]
    assert not bad, f"not camelCase: {bad}"


def test_readme_values_table_is_current() -> None:
    assert (CHART / "README.md").read_text() == values_doc.expected_readme(), (
        "helm/spindle/README.md is stale: run .venv/bin/python -m tests.helm.values_doc")
