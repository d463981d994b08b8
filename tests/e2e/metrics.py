"""Prometheus scrapes of the real services' /metrics for end-to-end tests."""

from __future__ import annotations

import urllib.request


def scrape(port: int) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (label order as exposed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every series of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in metrics.items():
        same_name = key == name or key.startswith(name + "{")
        if same_name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total
