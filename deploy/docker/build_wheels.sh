#!/usr/bin/env bash
# detproxy's wheels for pip users, into DIR (default dist/):
#
#   bash deploy/docker/build_wheels.sh [DIR]
#   pip install --find-links DIR detproxy
#
# - detproxy-VERSION-cpXY-cpXY-linux_ARCH.whl: the compiled build (mypyc; the modules that
#   pyproject.toml's [tool.detproxy] compiled lists, as C extensions) for this machine's Python
#   (PYTHON, default python3) and platform; needs gcc and Python's headers here, nothing on the
#   machines that install it (same Python minor version and platform, glibc no older).
# - detproxy-VERSION-py3-none-any.whl: the pure-Python build, for every other Python/platform.
#
# pip prefers the wheel whose tags fit best: the compiled one where it fits, the pure one
# elsewhere. Each is built from a fresh copy of what the image's build stage is sent
# (Dockerfile.dockerignore), so that no build output of one leaks into the other.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="$(realpath -m "${1:-dist}")"
python="${PYTHON:-python3}"
mkdir -p "$dest"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sources=$(sed -n 's/^!\(.*\)/\1/p' deploy/docker/Dockerfile.dockerignore | sed 's:/$::')
for compile in 1 0; do
  mkdir "$work/$compile"
  # shellcheck disable=SC2086  # one word per path
  tar --exclude=__pycache__ --exclude='*.so' -cf - $sources | tar -xf - -C "$work/$compile"
  DETPROXY_COMPILE="$compile" "$python" -m pip wheel -q --no-deps -w "$dest" "$work/$compile"
done
ls -1 "$dest"/detproxy-*.whl
