#!/usr/bin/env bash
# Prepares, on this machine, what the GPU validation carries to the device (none of it is
# committed; everything lands in the ignored folder .gpu/):
#   .gpu/llama-src.tar.gz   llama.cpp from the llama-cpp-python sdist, trimmed to what a CUDA
#                           build of llama-server needs (about 5 MB)
#   .gpu/wheels/            detproxy's dependencies as cp312 wheels (the device has no registry)
#   .gpu/model.part-a, -b   SmolLM2-135M-Instruct Q4_1 in two halves (98 MB is over what one
#                           device call carries), and its sha256
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu
mkdir -p "$out"
src="${LLAMA_SRC:-$HOME/.cache/detproxy/llama-server-0.3.36-portable/src/vendor/llama.cpp}"
[ -d "$src" ] || { echo "no llama.cpp source at $src: run tests/integration/build_llama_server.sh" >&2; exit 2; }
gguf="${SMOLLM2_GGUF:-$(find "$HOME/.cache/detproxy" -name '*.gguf' -print -quit)}"

if [ ! -f "$out/llama-src.tar.gz" ]; then
  tar -C "$src" -czf "$out/llama-src.tar.gz" \
    --exclude='ggml/src/ggml-cann' --exclude='ggml/src/ggml-hip' --exclude='ggml/src/ggml-metal' \
    --exclude='ggml/src/ggml-musa' --exclude='ggml/src/ggml-opencl' \
    --exclude='ggml/src/ggml-openvino' --exclude='ggml/src/ggml-sycl' \
    --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-hexagon' \
    --exclude='ggml/src/ggml-webgpu' --exclude='ggml/src/ggml-zdnn' --exclude='ggml/src/ggml-et' \
    --exclude='tools/server/webui' --exclude='*.png' --exclude='*.jpg' \
    CMakeLists.txt cmake common ggml include src tools vendor licenses app \
    scripts/ui-assets.cmake
fi
if [ ! -d "$out/wheels" ]; then
  python3 -m pip download -q --only-binary :all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --implementation cp \
    -d "$out/wheels" aiohttp orjson xxhash 'pydantic>=2.6' prometheus-client
fi
if [ ! -f "$out/model.part-b" ]; then
  half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
  head -c "$half" "$gguf" > "$out/model.part-a"
  tail -c +$(( half + 1 )) "$gguf" > "$out/model.part-b"
  sha256sum "$gguf" | cut -d' ' -f1 > "$out/model.sha256"
fi
du -sh "$out"/*
