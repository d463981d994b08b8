"""What the Dockerfile's final stage gives a container: entrypoint, command, environment, user, workdir.

The wiring test runs the chart's containers as local processes; a container's process is the
image's ENTRYPOINT plus the pod's args, in the image's environment overlaid by the pod's, so
reading them from the Dockerfile keeps image and chart honest with each other.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.helm.chart import REPO

DOCKERFILE = REPO / "Dockerfile"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def stages(path: Path = DOCKERFILE) -> list[list[tuple[str, str]]]:
    """Instructions grouped by stage, each starting with its FROM."""
    groups: list[list[tuple[str, str]]] = []
    for item in instructions(path):
        if item[0] == "FROM":
            groups.append([])
        if groups:
            groups[-1].append(item)
    return groups


@dataclass
class ImageConfig:
    entrypoint: list[str]
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    user: str = ""
    workdir: str = "/"


def final_image(path: Path = DOCKERFILE) -> ImageConfig:
    """The final stage's runtime settings (ENV values with `$VAR` references left as written)."""
    config = ImageConfig(entrypoint=[])
    for keyword, rest in stages(path)[-1]:
        if keyword == "ENTRYPOINT":
            config.entrypoint = json.loads(rest)
        elif keyword == "CMD":
            config.cmd = json.loads(rest)
        elif keyword == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                config.env[name] = value
        elif keyword == "USER":
            config.user = rest
        elif keyword == "WORKDIR":
            config.workdir = rest
    return config
