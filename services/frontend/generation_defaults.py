"""Sampling defaults a model ships in its generation_config.json (as vLLM applies them).

A request field left unset takes the model's value when the file has one, otherwise the
neutral value (temperature 1.0, top_p 1.0, top_k off, min_p off, no repetition penalty).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Defaults for sampling fields a request leaves unset."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        """Read generation_config.json if present; ignore keys that are missing or malformed."""
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", path, exc)
            return cls()
        values: dict[str, float | int] = {}
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                           ("repetition_penalty", float)):
            value = raw.get(name) if isinstance(raw, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                values[name] = kind(value)
        defaults = cls(**values)  # type: ignore[arg-type]
        if values:
            logger.info("sampling defaults from %s: %s", path, values)
        return defaults
