"""The benchmark checkpoints (small and medium random Llamas, vocab 8192), built locally and cached.

The shapes match /work/shared/peers/README.md so peer figures measured elsewhere describe the
same models. Builds are deterministic (shared/tiny_models), so a cached directory whose recorded
spec matches is reused instead of rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from shared.tiny_models import TinyModelSpec, build_model

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_ROOT = REPO / ".models"

BENCH_MODELS: dict[str, TinyModelSpec] = {
    "small": TinyModelSpec(family="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                           intermediate_size=768, vocab_size=8192, max_position_embeddings=2048),
    # About 106M parameters.
    "medium": TinyModelSpec(family="llama", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                            intermediate_size=2816, vocab_size=8192, max_position_embeddings=2048),
}

# Same weights' shapes with room for long prompts: the context sweep (benchmarks/peer_bench.py)
# runs prompts of up to 4,096 tokens plus their outputs, past the table models' 2,048 positions.
LONG_CONTEXT_POSITIONS = 8192
LONG_SUFFIX = "-long"
BENCH_MODELS.update({
    name + LONG_SUFFIX: dataclasses.replace(spec, max_position_embeddings=LONG_CONTEXT_POSITIONS)
    for name, spec in list(BENCH_MODELS.items())
})


def _spec_file(model_dir: Path) -> Path:
    # Written by shared/tiny_models.build_model next to the checkpoint.
    return model_dir / "spindle_tiny_spec.json"


def _is_built(model_dir: Path, spec: TinyModelSpec) -> bool:
    spec_file = _spec_file(model_dir)
    if not (spec_file.is_file() and (model_dir / "config.json").is_file()):
        return False
    try:
        return json.loads(spec_file.read_text()) == dataclasses.asdict(spec)
    except (OSError, ValueError):
        return False


def ensure_model(name: str, root: Path = DEFAULT_MODELS_ROOT) -> Path:
    """Directory of benchmark model `name` under `root`, building it first if missing or stale.

    The directory is named `bench-<name>`; servers serve it under that name by default.
    """
    if name not in BENCH_MODELS:
        raise ValueError(f"model name={name!r} is not one of {sorted(BENCH_MODELS)}")
    spec = BENCH_MODELS[name]
    model_dir = root / f"bench-{name}"
    if _is_built(model_dir, spec):
        logger.debug("reusing %s", model_dir)
        return model_dir
    logger.info("building %s model at %s", name, model_dir)
    return build_model(model_dir, spec)
