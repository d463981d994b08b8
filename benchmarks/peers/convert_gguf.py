"""Run llama.cpp's convert_hf_to_gguf.py on a spindle bench checkpoint, whose tokenizer it does not know.

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text, and
refuses hashes it has no entry for ("BPE pre-tokenizer was not recognized"). The bench models'
tokenizer is trained on the fly (shared/tiny_models), so its hash is new, but its pre-tokenizer is
plain ByteLevel with GPT-2's regex, which llama.cpp implements as "gpt-2". This wrapper makes
`conversion.base.TextModel.get_vocab_base_pre` fall back to "gpt-2" for exactly that case, then
runs the converter unchanged. It runs in the llama.cpp venv (benchmarks/peers/llama-server.sh
convert), so it imports nothing from spindle.

    python convert_gguf.py LLAMA_CPP/convert_hf_to_gguf.py HF_DIR --outfile OUT.gguf --outtype f32
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

GPT2_PRE_TOKENIZER = "gpt-2"


def is_gpt2_byte_level(tokenizer_json: Path) -> bool:
    """Whether the tokenizer's pre-tokenizer is ByteLevel splitting with GPT-2's regex (its default)."""
    try:
        pre = json.loads(tokenizer_json.read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return False
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def _patch(converter_dir: Path) -> None:
    sys.path.insert(0, str(converter_dir))
    from conversion.base import TextModel  # the converter's own package, next to the script

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not is_gpt2_byte_level(Path(self.dir_model) / "tokenizer.json"):
                raise
            return GPT2_PRE_TOKENIZER

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def main() -> None:
    if len(sys.argv) < 3:
        sys.stderr.write(__doc__.rsplit("\n\n", 1)[-1] + "\n")
        sys.exit(2)
    converter = Path(sys.argv[1]).resolve()
    _patch(converter.parent)
    sys.argv = [str(converter), *sys.argv[2:]]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
