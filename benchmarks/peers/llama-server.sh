#!/bin/bash
# Build and serve llama.cpp's OpenAI-compatible server, a peer of spindle's CPU benchmark.
# Modelled on ../shared/peers/llama-server.sh; driven by benchmarks/peer_servers.py.
#   benchmarks/peers/llama-server.sh install                       # once (~20 min on 2 cores): llama-server from the
#                                                                  # llama.cpp vendored in PyPI's llama-cpp-python sdist
#   benchmarks/peers/llama-server.sh convert HF_DIR OUT.gguf f32|bf16   # the checkpoint as GGUF
#   benchmarks/peers/llama-server.sh serve OUT.gguf PORT SLOTS CTX_PER_SLOT THREADS   # 127.0.0.1:PORT, model "peer"
# Restart the server between timed runs: its prompt cache answers repeated prompts.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEER_DIR=${PEER_DIR:-/tmp/spindle-peers}
VER=0.3.36
SRC=$PEER_DIR/llama_cpp_python-$VER/vendor/llama.cpp
BUILD=$PEER_DIR/llama-server-build
V=$PEER_DIR/llamacpp-venv
case "${1:-}" in
  install)
    command -v cmake >/dev/null && command -v ninja >/dev/null || { apt-get update && apt-get install -y build-essential cmake ninja-build; }
    mkdir -p "$PEER_DIR"
    [ -x "$V/bin/python" ] || python3 -m venv "$V"
    if [ ! -d "$SRC" ]; then
      "$V/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$PEER_DIR/sdist"
      tar xzf "$PEER_DIR/sdist/llama_cpp_python-$VER.tar.gz" -C "$PEER_DIR"
    fi
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    cmake --build "$BUILD" --target llama-server -j 2
    "$V/bin/pip" install -q torch==2.13.0 && "$V/bin/pip" install -q transformers sentencepiece safetensors numpy "$SRC/gguf-py" torch==2.13.0
    ;;
  convert)
    # Through convert_gguf.py: our freshly trained tokenizer's pre-tokenizer hash is unknown to the converter.
    "$V/bin/python" "$HERE/convert_gguf.py" "$SRC/convert_hf_to_gguf.py" "$2" --outfile "$3" --outtype "$4"
    ;;
  serve)
    # SLOTS parallel sequences share SLOTS x CTX_PER_SLOT tokens of KV cache; continuous batching on.
    exec "$BUILD/bin/llama-server" -m "$2" --alias peer --host 127.0.0.1 --port "$3" \
      -np "$4" -c "$(( $4 * $5 ))" --cont-batching -t "$6" -tb "$6"
    ;;
  *) sed -n 2,8p "$0"; exit 2 ;;
esac
