#!/usr/bin/env bash
# Start a shell (or a command) in the Tempo image with the GPUs, a data directory and results/.
#   scripts/docker/launch.sh DATA_DIR [command ...]
#   scripts/docker/launch.sh DATA_DIR scripts/gpu_check.sh     # the GPU check, results on the host
# Flags, and why:
#   --gpus all                  every GPU (set NV_VISIBLE_DEVICES to restrict, e.g. "device=0,1")
#   --shm-size 16g              DataLoader workers pass batches through /dev/shm; Docker's 64 MB
#                               default makes them crash. This replaces the original scripts'
#                               --ipc=host, which also shares the host's IPC namespace.
#   --ulimit memlock/stack      what NCCL and PyTorch's pinned memory expect
#   -v DATA_DIR:/data:ro        input data, read-only
#   -v results:/opt/tempo/results   where every command writes (results/ under the working
#                               directory /opt/tempo; /results is a link to it), kept on the host
#   -i, and -t when run from a terminal (so it also works from scripts and CI)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ $# -lt 1 ]; then
  echo "usage: $0 DATA_DIR [command ...]" >&2
  exit 2
fi
if [ ! -d "$1" ]; then
  echo "$0: DATA_DIR $1 is not a directory" >&2
  exit 2
fi
data_dir="$(cd "$1" && pwd)"
shift
image="${IMAGE:-tempo:latest}"
mkdir -p "$repo/results"
tty=(-i)
if [ -t 0 ] && [ -t 1 ]; then
  tty+=(-t)
fi
if [ $# -eq 0 ]; then
  set -- bash
fi
docker run --rm "${tty[@]}" \
  --gpus "${NV_VISIBLE_DEVICES:-all}" \
  --shm-size "${SHM_SIZE:-16g}" \
  --ulimit memlock=-1 --ulimit stack=67108864 \
  -v "$data_dir":/data:ro \
  -v "$repo/results":/opt/tempo/results \
  -w /opt/tempo \
  "$image" "$@"
