#!/usr/bin/env bash
# Builds the agent's image from Containerfile with buildah (`make image`).
#
#   scripts/build-image.sh [IMAGE]      IMAGE defaults to ghcr.io/stallwatch/stallwatch:VERSION, the
#                                       chart's default image (VERSION: pyproject.toml = appVersion)
#
# BASE=python:3.11-slim-bookworm (any image with python3, its venv module and sh) builds from a registry
# image, installing from the package index inside the build. Without BASE, nothing is pulled: the base is
# built here from Debian packages (debootstrap, cached as a root filesystem archive under build/image/),
# and the package with its dependencies goes in as wheels built here (the same Python 3.11 as bookworm's).
# buildah runs with chroot isolation and the vfs storage driver: both work without user namespaces or
# overlay mounts, in a container or a CI runner.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
image=${1:-ghcr.io/stallwatch/stallwatch:$version}
export BUILDAH_ISOLATION=chroot STORAGE_DRIVER=vfs
scripts/install-system-deps.sh

if [ -z "${BASE:-}" ]; then
  BASE=localhost/stallwatch-base:bookworm
  cache=build/image
  rootfs="$cache/bookworm-python3.tar"
  if [ ! -s "$rootfs" ]; then
    # The mirror apt uses here (deb822 sources, then the one-line format), else Debian's own.
    mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
    mirror=${mirror:-$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
    mirror=${mirror:-http://deb.debian.org/debian}
    echo "building a Debian bookworm root filesystem with python3 from $mirror"
    staging=$(mktemp -d)
    trap 'rm -rf "$staging"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$staging/rootfs" "$mirror" >/dev/null
    # Package caches and lists, documentation and translations are not needed to run python.
    rm -rf "$staging"/rootfs/var/cache/apt/* "$staging"/rootfs/var/lib/apt/lists/* \
      "$staging"/rootfs/usr/share/{doc,info,locale,man}/*
    mkdir -p "$cache"
    tar -C "$staging/rootfs" --numeric-owner -cf "$rootfs.partial" .
    mv "$rootfs.partial" "$rootfs"
  fi
  if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    container=$(buildah from scratch)
    buildah add --quiet "$container" "$rootfs" /
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$container"
    buildah commit --quiet --rm "$container" "$BASE" >/dev/null
  fi
  # The build context: a wheelhouse of the two distributions (make dist; the agent's records the checkout's
  # commit for stallwatch_build_info, stallwatch/build.py) and their dependencies.
  context=$cache/context
  rm -rf "$context" && mkdir -p "$context"
  make --no-print-directory dist PY="${PYTHON:-.venv/bin/python}" DIST="$context/dist"
  "${PYTHON:-.venv/bin/python}" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$context/wheels" \
    "$context/dist/stallwatch_client-$version-py3-none-any.whl" \
    "$context/dist/stallwatch-$version-py3-none-any.whl[kubernetes]"
  # and the agent's wheel with the correlator's C kernels: pip takes it where its tag fits the base's Python
  cp "$context"/dist/stallwatch-"$version"-cp*.whl "$context/wheels/"
  set -- --build-arg WHEELS=wheels "$context"
else
  make --no-print-directory dist PY="${PYTHON:-.venv/bin/python}"
  set -- .
fi
echo "building $image from $BASE"
previous=$(buildah images --quiet --no-trunc "$image" 2>/dev/null || true)
buildah bud --quiet --layers=false --build-arg "BASE=$BASE" -f Containerfile -t "$image" "$@" >/dev/null
# The image this tag named before is left without a name: remove it (unless a container still uses it).
if [ -n "$previous" ] && [ "$previous" != "$(buildah images --quiet --no-trunc "$image")" ]; then
  buildah rmi "$previous" >/dev/null 2>&1 || true
fi
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$image"
