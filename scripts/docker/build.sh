#!/usr/bin/env bash
# Build the Tempo image: scripts/docker/build.sh [image-name] [base-image]
# The base must carry a CUDA build of torch >= 2.11 (the Dockerfile checks); the default is the
# Dockerfile's (pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel). The checkout's commit is baked in
# (TEMPO_GIT_COMMIT) so results written inside the container name it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
image="${1:-tempo:latest}"
base="${2:-pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel}"
commit="$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$commit" != unknown ] && [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit-dirty"
fi
docker build --build-arg BASE_IMAGE="$base" --build-arg TEMPO_GIT_COMMIT="$commit" -t "$image" "$repo"
