#!/usr/bin/env bash
# Start a shell (or a command) in the Tempo image with the GPUs, a data directory and results/.
#   scripts/docker/launch.sh DATA_DIR [command ...]
# Flags, and why:
#   --gpus all                  every GPU (set NV_VISIBLE_DEVICES to restrict, e.g. "device=0,1")
#   --shm-size 16g              DataLoader workers pass batches through /dev/shm; Docker's 64 MB
#                               default makes them crash. This replaces the original scripts'
#                               --ipc=host, which also shares the host's IPC namespace.
#   --ulimit memlock/stack      what NCCL and PyTorch's pinned memory expect
#   -v DATA_DIR:/data:ro        input data, read-only
#   -v results:/results         benchmark and training output, kept on the host
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ $# -lt 1 ]; then
  echo "usage: $0 DATA_DIR [command ...]" >&2
  exit 2
fi
data_dir="$(cd "$1" && pwd)"
shift
image="${IMAGE:-tempo:latest}"
mkdir -p "$repo/results"
docker run --rm -it \
  --gpus "${NV_VISIBLE_DEVICES:-all}" \
  --shm-size "${SHM_SIZE:-16g}" \
  --ulimit memlock=-1 --ulimit stack=67108864 \
  -v "$data_dir":/data:ro \
  -v "$repo/results":/results \
  -w /opt/tempo \
  "$image" "${@:-bash}"
