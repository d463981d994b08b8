"""Build the demo model `make run` serves: a small random Llama with a real tokenizer.

No download: the weights come from a fixed seed (shared/tiny_models.py). It generates
gibberish, but it exercises every part of the server exactly as a real checkpoint would.
"""

from __future__ import annotations

import argparse
import logging

from shared.logs import setup_logging
from shared.tiny_models import TinyModelSpec, build_model

logger = logging.getLogger(__name__)

DEMO_SPEC = TinyModelSpec(family="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                          intermediate_size=768, vocab_size=512, max_position_embeddings=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", help="where to write the checkpoint")
    args = parser.parse_args()
    setup_logging("demo-model")
    path = build_model(args.out_dir, DEMO_SPEC)
    logger.info("built demo model at %s", path)


if __name__ == "__main__":
    main()
