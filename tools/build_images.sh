#!/usr/bin/env bash
# Builds docker/cpu.Dockerfile on this machine with buildah (no Docker engine, no registry
# needed) and runs tools/image_smoke.py in a container of the result: as the image's user
# (uid 1000), the demo model the image carries served at PP 2 answers "Paris" over OpenAI HTTP
# and over gRPC (`sarathictl generate`), and the C kernels import with no compiler in the image.
# `make images`; not part of `make test`. Needs root (buildah's storage in /var/lib/containers).
#
# Steps:
#   1. buildah and debootstrap, installed with apt-get when missing.
#   2. The base image BASE_IMAGE (default localhost/sarathi-base:bookworm), made with debootstrap
#      from Debian's mirror when it is not already in buildah's storage (no base image has to be
#      pulled): Debian bookworm with python3 (3.11), python3-venv, `python`, ca-certificates and
#      libpython3.11-dev (Python.h: the wheel stage compiles the C kernels; the default base,
#      python:3.11-slim, carries the headers too). REBUILD_BASE=1 makes it again.
#   3. `buildah bud --isolation chroot --layers` of docker/cpu.Dockerfile (RUN steps in a chroot,
#      layers cached: a second run reuses them). torch: when TORCH_WHEELS (default /opt/wheels)
#      holds the CPU wheel of TORCH_CPU_SPEC it is mounted into the RUN steps and pinned from
#      there (torch's dependencies from PyPI); otherwise the Dockerfile's default, PyTorch's CPU
#      index. The host's CA bundle (BUILD_CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt;
#      empty: none) is mounted over the image's for the RUN steps only, so pip (Debian's pip uses
#      that file) works behind a TLS-intercepting proxy; it is not in the image.
#   4. tools/image_smoke.py in a container of the image (`buildah run --isolation chroot`,
#      host network: the smoke test picks free ports). `podman run` is not used: without
#      CAP_SYS_RESOURCE crun cannot set the container's rlimits.
#
# docker/cuda.Dockerfile is not built here: its base (nvidia/cuda:*-devel) cannot be pulled
# without a registry, debootstrap makes no CUDA toolkit, and its torch and flashinfer wheels come
# from download.pytorch.org and flashinfer.ai; without a GPU its smoke test could not serve anyway.
#
# The local build leaves an empty /opt/wheels in the image (the mount point of the torch wheels).
# The untagged images `buildah images` lists are the stages' layer cache: `buildah rmi --prune`
# frees them (the next build then starts over from the base).
#
# Usage: tools/build_images.sh [--smoke-only]   (--smoke-only: test the image already built)
# Environment: IMAGE, BASE_IMAGE, REBUILD_BASE, TORCH_WHEELS, TORCH_CPU_SPEC, BUILD_CA_BUNDLE,
# DEBIAN_MIRROR, WORK_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
IMAGE=${IMAGE:-localhost/sarathi-cluster:${version}-cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/sarathi-base:bookworm}
REBUILD_BASE=${REBUILD_BASE:-0}
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
TORCH_CPU_SPEC=${TORCH_CPU_SPEC:-torch==2.13.0+cpu}
BUILD_CA_BUNDLE=${BUILD_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WORK_DIR=${WORK_DIR:-build/images}
SMOKE_ONLY=0
case "${1:-}" in
  --smoke-only) SMOKE_ONLY=1 ;;
  "") ;;
  *) echo "usage: $0 [--smoke-only]" >&2; exit 2 ;;
esac

say() { printf '\n== %s\n' "$*"; }
die() { printf 'build_images: %s\n' "$*" >&2; exit 1; }
timings=()
phase_start=0
start_phase() { phase_name=$1; say "$2"; phase_start=$(date +%s); }
end_phase() { timings+=("$(printf '%-10s %5ss' "$phase_name" "$(( $(date +%s) - phase_start ))")"); }
image_exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }

[ "$(id -u)" = 0 ] || die "run as root: buildah keeps its images in /var/lib/containers"

# 1. tools
missing=()
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  start_phase apt-get "installing ${missing[*]} (apt-get)"
  command -v apt-get >/dev/null 2>&1 || die "no apt-get to install ${missing[*]}: install them by hand"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  end_phase
fi
echo "$(buildah --version); storage: $(buildah info --format '{{.store.GraphRoot}}' 2>/dev/null || echo '?')"
df -h / | tail -1 | awk '{print "disk free on /: " $4}'

if [ "$SMOKE_ONLY" = 0 ]; then
  # 2. base image
  if [ "$REBUILD_BASE" != 1 ] && image_exists "$BASE_IMAGE"; then
    say "base image $BASE_IMAGE: present, reused (REBUILD_BASE=1 makes it again)"
  else
    start_phase base "base image $BASE_IMAGE (debootstrap bookworm from $DEBIAN_MIRROR)"
    rootfs=$WORK_DIR/rootfs
    rm -rf "$rootfs"
    mkdir -p "$rootfs"
    debootstrap --variant=minbase \
      --include=python3,python3-venv,python-is-python3,ca-certificates,libpython3.11-dev \
      bookworm "$rootfs" "$DEBIAN_MIRROR"
    # As Debian's own image: updates and security beside the release; no package caches.
    rm -f "$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $DEBIAN_MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${DEBIAN_MIRROR}-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
    image_exists "$BASE_IMAGE" && buildah rmi "$BASE_IMAGE" >/dev/null
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$rootfs" -cf - . | tar -C "$mnt" --numeric-owner -xpf -
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env LANG=C.UTF-8 --cmd python3 "$ctr"
    buildah commit --rm -q "$ctr" "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    end_phase
  fi

  # 3. the CPU image
  build_args=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
  mounts=()
  torch_wheel=""
  if [ -d "$TORCH_WHEELS" ]; then
    local_version=${TORCH_CPU_SPEC#torch==}
    torch_wheel=$(find "$TORCH_WHEELS" -maxdepth 1 -name "torch-${local_version}-cp311-*.whl" | head -1)
  fi
  if [ -n "$torch_wheel" ]; then
    echo "torch: $TORCH_CPU_SPEC from $torch_wheel (its dependencies from PyPI)"
    build_args+=(--build-arg "TORCH_INDEX=https://pypi.org/simple"
                 --build-arg "TORCH_PIP_ARGS=--find-links $TORCH_WHEELS"
                 --build-arg "TORCH_SPEC=$TORCH_CPU_SPEC")
    mounts+=(--volume "$TORCH_WHEELS:$TORCH_WHEELS:ro")
  else
    echo "torch: no ${TORCH_CPU_SPEC} wheel in $TORCH_WHEELS; the Dockerfile's default index"
  fi
  if [ -n "$BUILD_CA_BUNDLE" ] && [ -f "$BUILD_CA_BUNDLE" ]; then
    echo "CA bundle for the RUN steps: $BUILD_CA_BUNDLE"
    mounts+=(--volume "$BUILD_CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
  fi
  start_phase build "image $IMAGE (buildah bud docker/cpu.Dockerfile)"
  buildah bud --isolation chroot --layers \
    -f docker/cpu.Dockerfile --ignorefile docker/cpu.Dockerfile.dockerignore \
    "${build_args[@]}" "${mounts[@]}" -t "$IMAGE" .
  end_phase
fi

image_exists "$IMAGE" || die "no image $IMAGE: build it first (without --smoke-only)"
size=$(buildah images --format '{{.Size}}' "$IMAGE" | head -1)
echo "image $IMAGE: $size"

# 4. smoke test as uid 1000 in a container of the image
start_phase smoke "smoke test in $IMAGE"
ctr=$(buildah from --pull-never "$IMAGE")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
status=0
buildah run --isolation chroot --user 1000:1000 \
  --volume "$PWD/tools/image_smoke.py:/opt/sarathi-smoke/image_smoke.py:ro" \
  "$ctr" -- python /opt/sarathi-smoke/image_smoke.py || status=$?
end_phase

say "timings"
printf '%s\n' "${timings[@]}"
echo "image $IMAGE: $size"
[ "$status" = 0 ] || die "smoke test FAILED in $IMAGE (exit $status); see its output above"
echo "build_images: $IMAGE: smoke test passed"
