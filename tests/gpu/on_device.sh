#!/usr/bin/env bash
# Runs on the lent GPU machine, in two calls (the model travels in two halves):
#   bash tests/gpu/on_device.sh build     # carry .gpu/llama-src.tar.gz .gpu/wheels .gpu/model.part-a
#   bash tests/gpu/on_device.sh validate  # carry .gpu/model.part-b; results land in $OUT
# Everything it makes stays in the ignored folder .gpu/dev/ (kept while the machine is warm).
set -euo pipefail
cd "$(dirname "$0")/../.."
dev=.gpu/dev
mkdir -p "$dev"
case "${1:-}" in
build)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  mkdir -p "$dev/src" && tar -xzf .gpu/llama-src.tar.gz -C "$dev/src"
  gen=""; command -v ninja >/dev/null && gen="-G Ninja"
  t0=$(date +%s)
  cmake -S "$dev/src" -B "$dev/build" $gen -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF > "$dev/cmake.log" 2>&1 || { tail -30 "$dev/cmake.log"; exit 1; }
  cmake --build "$dev/build" --target llama-server -j"$(nproc)" > "$dev/build.log" 2>&1 \
    || { tail -40 "$dev/build.log"; exit 1; }
  echo "built llama-server with CUDA in $(( $(date +%s) - t0 )) s"
  "$dev/build/bin/llama-server" --version 2>&1 | tail -2
  cp .gpu/model.part-a "$dev/model.part-a"
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --find-links .gpu/wheels --target "$dev/site" \
      aiohttp orjson xxhash pydantic prometheus-client
  else  # no pip: a wheel is a zip that unpacks onto sys.path
    mkdir -p "$dev/site" && for w in .gpu/wheels/*.whl; do python3 -m zipfile -e "$w" "$dev/site"; done
  fi
  PYTHONPATH="$dev/site:." python3 -c "import aiohttp, orjson, pydantic; from proxy.app import build_app; print('python', __import__('sys').version.split()[0], 'aiohttp', aiohttp.__version__)"
  ;;
validate)
  cat "$dev/model.part-a" .gpu/model.part-b > "$dev/model.gguf"
  echo "$(cat .gpu/model.sha256)  $dev/model.gguf" | sha256sum -c -
  out="${OUT:-$dev/out}"; mkdir -p "$out"
  PYTHONPATH="$dev/site:." python3 tests/gpu/validate.py --server "$dev/build/bin/llama-server" \
    --model "$dev/model.gguf" --out "$out" "${@:2}"
  ;;
*) echo "usage: $0 build|validate" >&2; exit 2 ;;
esac
