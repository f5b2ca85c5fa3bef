# syntax=docker/dockerfile:1
#
# sam-swin-serve image. Two runtime bases, picked with a build argument:
#   docker build -t sam-swin-serve:gpu .                        # BASE=cuda (default)
#   docker build --build-arg BASE=cpu -t sam-swin-serve:cpu .   # CPU-only torch
# Both install torch ${TORCH_VERSION} (2.13.0): the version CI runs the tests on (the
# README's install line), from PyTorch's CUDA or CPU wheel index onto the same Python base.
# Weights are read from /weights and the torch.compile caches live in /cache (both mounted);
# the root filesystem can be read-only, with a writable /tmp. See docs/DEPLOYMENT.md.

ARG BASE=cuda
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
# torchvision's nvJPEG decodes SAM's JPEG uploads on the GPU (SERVE_JPEG_DECODE); it must be
# the release made with TORCH_VERSION (2.13 <-> 0.28). The CPU image does not need it.
ARG TORCHVISION_VERSION=0.28.0

# ---- 1. build the project wheel from pyproject.toml (pure Python, any base will do) ----
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY models/ models/
COPY server/ server/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- 2a. CUDA base: torch's CUDA wheels bring CUDA, cuDNN and NCCL (the host: a driver) ----
FROM ${PYTHON_IMAGE} AS base-cuda
ARG TORCH_VERSION
ARG TORCHVISION_VERSION
ARG TORCH_CUDA=cu128
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"

# ---- 2b. CPU base for development: the CPU-only wheel of torch (no CUDA libraries) ----
FROM ${PYTHON_IMAGE} AS base-cpu
ARG TORCH_VERSION
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url https://download.pytorch.org/whl/cpu

# ---- 3. runtime: the chosen base, our dependencies, then our code; a non-root user ----
# (DL3006 does not apply: base-${BASE} names one of the two stages above, both pinned.)
# hadolint ignore=DL3006
FROM base-${BASE} AS runtime

# NVIDIA_DRIVER_CAPABILITIES: the container toolkit mounts the driver's compute libraries
# and nvidia-cuda-mps-control, with which two engines share a GPU side by side (SERVE_MPS)
ENV PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor \
    TRITON_CACHE_DIR=/cache/triton

# torch.compile needs a host compiler at run time (Triton builds its launchers with gcc,
# Inductor's CPU backend with g++); the slim base ships none.
# (DL3008: g++ comes from the base's own distribution release; its version follows it.)
# hadolint ignore=DL3008
RUN if ! command -v g++ >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin app \
    && mkdir -p /weights /cache/inductor /cache/triton \
    && chown -R app:app /cache

# The dependencies, from pyproject.toml alone: this layer is rebuilt only when
# pyproject.toml changes, not on every code change. The constraint keeps the base's torch
# build: pip may add our dependencies but never swap torch.
COPY pyproject.toml /tmp/deps/pyproject.toml
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/deps/constraint.txt \
    && python -c "import tomllib; project = tomllib.load(open('/tmp/deps/pyproject.toml', 'rb')); \
print(*project['project']['dependencies'], sep='\n')" > /tmp/deps/requirements.txt \
    && pip install --no-cache-dir --constraint /tmp/deps/constraint.txt \
        --requirement /tmp/deps/requirements.txt \
    && rm -rf /tmp/deps

# The project itself, without touching a dependency.
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels

USER 10001:10001
WORKDIR /tmp
EXPOSE 8000

# Liveness only (/healthz answers while models load); the start period covers a cold
# compile cache. Orchestrators use /readyz for traffic (see k8s/).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]

ENTRYPOINT ["python", "-m", "server"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
