"""`SpindleModel`: what the loader and the worker need from every model class.

The loader builds a model on the meta device, materialises it, calls `post_init` and copies
checkpoint tensors to where `map_weight` says; `task` tells the worker which runner to build.
Forward signatures differ by kind (decoders take a KV cache, encoders token types).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import nn

from shared.types import RequestKind

# (spindle parameter name, first row inside a fused parameter or None for the whole parameter)
WeightTarget = tuple[str, int | None]


class SpindleModel(nn.Module, ABC):
    """Base of every registered model class."""

    task: ClassVar[RequestKind]

    @abstractmethod
    def map_weight(self, hf_name: str) -> WeightTarget | None:
        """Where a checkpoint tensor goes; None for tensors the model does not use."""

    def post_init(self) -> None:
        """Recompute what `to_empty` left uninitialised (tables, tied weights); default: nothing."""
