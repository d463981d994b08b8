"""Skip marks for tests of oneDNN's paths, which this host's torch build or CPU may lack.

oneDNN packs and runs bf16 GEMMs only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT: on an
AVX2-only CPU (AMD Zen 3) the reorder raises, and spindle keeps F.linear for those layers
(`prepacked_linear._reorder`), which the tests of that fallback check instead.
"""

from __future__ import annotations

import pytest
import torch

ONEDNN = torch.backends.mkldnn.is_available()

needs_onednn = pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
needs_onednn_bf16 = pytest.mark.skipif(
    not (ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN runs no bf16 GEMM on this CPU (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)",
)
