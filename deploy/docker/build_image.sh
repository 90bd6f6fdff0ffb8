#!/usr/bin/env bash
# Builds deploy/docker/Dockerfile's image without a Docker daemon, with buildah:
#
#   bash deploy/docker/build_image.sh [TAG]        (default detproxy:local; run as root)
#
# - The base: PYTHON_IMAGE if set (e.g. a pinned python:3.11-slim-bookworm@sha256:... that
#   buildah can pull); otherwise a stand-in made here with debootstrap (Debian bookworm minbase
#   with python3, python3-venv, python-is-python3, ca-certificates: the same Python 3.11 on the
#   same Debian as python:3.11-slim-bookworm), kept as a tarball in the cache and imported.
# - pip inside the build reaches the index this machine's pip does: what `pip config list` says
#   (index-url, extra-index-url, find-links, trusted-host, cert, constraint) goes in as PIP_*
#   build arguments, and each local path among them (file:// indexes, wheel folders, the CA
#   bundle) is mounted read-only at the same path for the build's RUN steps.
# - Caches outside the checkout, in DETPROXY_IMAGE_CACHE (default ~/.cache/detproxy/image): the
#   base tarball, pip's wheels and apt's .debs (mounted into the build stage only), and buildah's
#   layer cache (--layers). Delete the folder and `buildah rmi` the images for a cold build.
# - Reproducible inputs: SOURCE_DATE_EPOCH (default: the last commit's time) sets the image's
#   and its files' timestamps (--timestamp) and the OCI labels' created; the labels carry the
#   version (pyproject.toml) and the commit.
#
# Prints the image's size and the build's time on the last line of stderr, and the image's id
# on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."

tag="${1:-detproxy:local}"
cache="${DETPROXY_IMAGE_CACHE:-$HOME/.cache/detproxy/image}"
suite=bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
compile="${DETPROXY_COMPILE:-1}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] && python=.venv/bin/python
mkdir -p "$cache/pip" "$cache/apt/partial"
started=$(date +%s)

base="${PYTHON_IMAGE:-localhost/detproxy-base:$suite}"
if [ -z "${PYTHON_IMAGE:-}" ] && ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  tarball="$cache/base-$suite.tar"
  if [ ! -s "$tarball" ]; then
    rootfs="$(mktemp -d)"
    echo "build_image: debootstrap $suite into $rootfs (once; cached in $tarball)" >&2
    debootstrap --variant=minbase \
      --include=python3,python3-venv,python-is-python3,ca-certificates \
      "$suite" "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 \
      || { tail -20 "$cache/debootstrap.log" >&2; rm -rf "$rootfs"; exit 1; }
    # What the slim images leave out: package lists, downloaded .debs, documentation.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
      "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
      "$rootfs"/usr/share/locale/*
    tar --numeric-owner --sort=name --mtime="@${SOURCE_DATE_EPOCH:-0}" \
      -C "$rootfs" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  ctr="$(buildah from scratch)"
  buildah add --quiet "$ctr" "$tarball" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$ctr"
  buildah commit --quiet --rm "$ctr" "$base" >/dev/null
fi

# This machine's pip configuration, as build arguments, and the local paths it names, mounted
# (a file:// index's parent too: its pages link to the files beside it).
declare -A pip_config=() mounts=()
while IFS= read -r line; do
  key="${line%%=*}"
  key="${key#*.}"
  value="${line#*=}"
  value="${value#\'}"
  value="${value%\'}"
  case "$key" in
    index-url | extra-index-url | find-links | trusted-host | cert | constraint) ;;
    *) continue ;;
  esac
  pip_config["PIP_$(tr 'a-z-' 'A-Z_' <<<"$key")"]="$value"
  for word in $value; do
    path="${word#file://}"
    [[ "$word" == file://* ]] && path="$(dirname "$path")"
    if [[ "$path" == /* && -e "$path" ]]; then mounts["$path"]=1; fi
  done
done < <("$python" -m pip config list 2>/dev/null)
pip_args=()
for var in "${!pip_config[@]}"; do pip_args+=(--build-arg "$var=${pip_config[$var]}"); done
pip_args+=(--build-arg PIP_CACHE_DIR=/var/cache/detproxy-pip)
volumes=(-v "$cache/pip:/var/cache/detproxy-pip" -v "$cache/apt:/var/cache/apt/archives")
for path in "${!mounts[@]}"; do volumes+=(-v "$path:$path:ro"); done

epoch="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
buildah bud --quiet --format docker --isolation chroot --network host --layers \
  -f deploy/docker/Dockerfile --ignorefile deploy/docker/Dockerfile.dockerignore \
  --timestamp "$epoch" \
  --build-arg PYTHON_IMAGE="$base" \
  --build-arg DETPROXY_COMPILE="$compile" \
  --build-arg SOURCE_DATE_EPOCH="$epoch" \
  --build-arg DETPROXY_VERSION="$version" \
  --build-arg DETPROXY_REVISION="$revision" \
  --build-arg DETPROXY_CREATED="$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)" \
  "${pip_args[@]}" "${volumes[@]}" \
  -t "$tag" . >/dev/null

id="$(buildah inspect --type image --format '{{.FromImageID}}' "$tag")"
size="$(buildah images --noheading --format '{{.Size}}' "$id" | head -1)"
echo "build_image: $tag ($id) size $size, built in $(($(date +%s) - started)) s" >&2
echo "$id"
