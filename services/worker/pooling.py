"""Pooling for prefill-only models: one vector per sequence of a packed batch, and its config.

Pooling is vectorised over the packed batch (gathers and one `index_add_` segment sum, no loop
per sequence). The method comes from the sentence-transformers files in the model directory
(modules.json, 1_Pooling/config.json, sentence_bert_config.json) when present; anything there
spindle cannot reproduce exactly (Dense layers, max pooling) is rejected, never approximated.

Defaults without sentence-transformers files: CLS pooling (HF BertModel's own convention, as
vLLM does), no length cap beyond the position table. Cross-encoders always pool CLS (their
classifier reads the first token). L2 normalisation is not applied here by default: whether
a request is normalised is the frontend's decision (the pipeline's Normalize module sets the
default, a request may turn it off), carried through the scheduler; the worker normalises
exactly the requests whose `PoolingRequestData.normalize` is set, the round's vectors at once.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shared.types import RequestKind


class PoolingMethod(enum.Enum):
    CLS = "cls"  # first token of each sequence
    MEAN = "mean"  # average of every token of the sequence
    LAST = "last"  # last token (decoder-style embedding models)


@dataclass(slots=True)
class PoolingMetadata:
    """Where each sequence sits in the packed batch (device tensors, int64)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] first token of each sequence, then num_tokens
    seq_lens: torch.Tensor  # [num_reqs]
    token_to_req: torch.Tensor  # [num_tokens] sequence index of each token (segment ids)


def _cls(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden[meta.query_start_loc[:-1]].float()


def _last(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden[meta.query_start_loc[1:] - 1].float()


def _mean(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    """Segment sums in float32 (one index_add_ over all tokens) divided by sequence lengths."""
    sums = torch.zeros(len(meta.seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, meta.token_to_req, hidden.float())
    return sums / meta.seq_lens[:, None].float()


POOLING_METHODS: dict[PoolingMethod, Callable[[torch.Tensor, PoolingMetadata], torch.Tensor]] = {
    PoolingMethod.CLS: _cls,
    PoolingMethod.MEAN: _mean,
    PoolingMethod.LAST: _last,
}


def pool(hidden: torch.Tensor, method: PoolingMethod, meta: PoolingMetadata) -> torch.Tensor:
    """[num_reqs, hidden] float32 from packed hidden states [num_tokens, hidden]."""
    return POOLING_METHODS[method](hidden, meta)


def normalize_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L2-normalise the rows where `mask` [num_reqs] is set (as sentence-transformers' Normalize)."""
    return torch.where(mask[:, None], F.normalize(values, p=2.0, dim=-1), values)


@dataclass(slots=True, frozen=True)
class PoolingConfig:
    """How this deployment pools, resolved once at startup."""

    method: PoolingMethod
    max_seq_length: int | None = None  # sentence-transformers cap on input tokens


# sentence-transformers pooling mode names (new "pooling_mode" and legacy boolean keys)
_ST_MODES = {"cls": PoolingMethod.CLS, "mean": PoolingMethod.MEAN, "lasttoken": PoolingMethod.LAST}
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # module types spindle reproduces


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read sentence-transformers file {str(path)!r}: {exc}") from exc


def _st_mode(config: dict[str, Any], path: Path) -> PoolingMethod:
    """The one pooling mode of a Pooling module config (ST defaults to mean when none is set)."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_LEGACY_KEYS.items() if config.get(key)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    modes = modes or ["mean"]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"unsupported sentence-transformers pooling {modes} in {str(path)!r}; "
                         f"spindle supports exactly one of {sorted(_ST_MODES)}")
    return _ST_MODES[modes[0]]


def load_pooling_config(model_dir: str | Path, task: RequestKind) -> PoolingConfig:
    """Pooling method and length cap for `model_dir` served as `task` (EMBED or SCORE)."""
    root = Path(model_dir)
    st_config = root / "sentence_bert_config.json"
    max_seq_length = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    max_seq_length = int(max_seq_length) if max_seq_length else None
    if task is RequestKind.SCORE or not (root / "modules.json").is_file():
        return PoolingConfig(PoolingMethod.CLS, max_seq_length)
    method = None
    for module in _read_json(root / "modules.json"):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise ValueError(f"unsupported sentence-transformers module {module.get('type')!r} in "
                             f"{str(root / 'modules.json')!r}; spindle runs {', '.join(_ST_MODULES)}")
        if kind == "Transformer" and module.get("path", ""):
            raise ValueError(f"the Transformer module lives in {module['path']!r}; point the worker there")
        if kind == "Pooling":
            path = root / module.get("path", "") / "config.json"
            method = _st_mode(_read_json(path), path)
    if method is None:
        raise ValueError(f"{str(root / 'modules.json')!r} has no Pooling module: no sentence embedding")
    return PoolingConfig(method, max_seq_length)
