#!/usr/bin/env bash
# Build the Tempo image: scripts/docker/build.sh [image-name] [base-image]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
image="${1:-tempo:latest}"
base="${2:-pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime}"
docker build --build-arg BASE_IMAGE="$base" -t "$image" "$repo"
