#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine and runs them all:
# a virtualenv with detproxy and its test extras, llama.cpp's llama-server built from the
# llama-cpp-python sdist (cached in ~/.cache/detproxy), the SmolLM2-135M GGUF, then
# ruff, mypy and pytest (unit and integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: the engine's toolchain, promtool (from prometheus) for the alert rules, and
# redis-server for the shared duplicate store and haproxy for the scale-out test (the tests start
# their own on free ports), chromium for the incident explorer's browser tests (headless),
# buildah and debootstrap for the image (tests/deploy/test_image.py: deploy/docker/build_image.sh
# builds it without a Docker daemon, its base and caches in ~/.cache/detproxy/image).
missing=""
command -v cmake >/dev/null || missing="$missing cmake"
command -v g++ >/dev/null || missing="$missing g++ make"
command -v promtool >/dev/null || missing="$missing prometheus"
command -v redis-server >/dev/null || missing="$missing redis-server"
command -v amtool >/dev/null || missing="$missing prometheus-alertmanager"
command -v haproxy >/dev/null || missing="$missing haproxy"
command -v chromium >/dev/null || missing="$missing chromium"
command -v buildah >/dev/null || missing="$missing buildah"
command -v debootstrap >/dev/null || missing="$missing debootstrap"
if [ -n "$missing" ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# setuptools >= 77 reads pyproject.toml's license; the compiled build below runs setup.py here.
.venv/bin/python -m pip install -q --upgrade pip setuptools
.venv/bin/python -m pip install -q -e '.[test]'

engine="$(PYTHON=.venv/bin/python bash tests/integration/build_llama_server.sh)"
export LLAMA_SERVER="$(sed -n 's/^LLAMA_SERVER=//p' <<<"$engine")"
export SMOLLM2_GGUF="$(sed -n 's/^SMOLLM2_GGUF=//p' <<<"$engine")"
export LLAMA_SRC="$(sed -n 's/^LLAMA_SRC=//p' <<<"$engine")"

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The GPU harnesses run only on the lent machine: type-check them here, so a rename in proxy/
# that they call cannot go unnoticed until the next device session.
.venv/bin/mypy --strict tests/gpu/validate.py tests/gpu/vllm/validate.py

# The tests, with the line coverage of proxy and policies measured in the tests' own process
# (detproxy started as a child process by a test is not measured): the modules not covered
# whole, then the total. A figure to read, not a gate. Its data file stays out of the checkout.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export COVERAGE_FILE="$scratch/coverage"
.venv/bin/python -m pytest -m "integration or not integration" \
  --cov=proxy --cov=policies --cov-report=term:skip-covered "$@"
echo "coverage of proxy and policies: $(.venv/bin/python -m coverage report --format=total)%"
unset COVERAGE_FILE

# The compiled build (DETPROXY_COMPILE=1: setup.py compiles pyproject.toml's
# [tool.detproxy] compiled with mypyc), made in a copy of the checkout, and the unit tests
# run on it, without coverage: what compiles must behave as the source does.
compiled="$scratch/compiled"
mkdir "$compiled"
.venv/bin/python tests/compiled_tree.py "$compiled/tree"
python="$PWD/.venv/bin/python"
(cd "$compiled/tree" && "$python" -m pytest -q -p no:cacheprovider)
