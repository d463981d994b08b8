# syntax=docker/dockerfile:1
# One image runs any spindle service: `docker run IMAGE frontend|scheduler|worker --help`.
#
#   docker build -t spindle:0.1.0-cpu .                          # CPU torch
#   docker build --build-arg VARIANT=cuda -t spindle:0.1.0-cuda .  # CUDA torch on an NVIDIA base
#
# The Helm chart (helm/spindle) runs frontend and scheduler from the -cpu image and GPU
# workers from the -cuda one. Versions come from pyproject.toml, never repeated here.

ARG VARIANT=cpu
# The CUDA major.minor of the torch wheel index (cu128) and of the NVIDIA base: keep them equal.
ARG TORCH_CUDA=cu128
ARG CUDA_BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

# Bookworm, not the moving `3.11-slim` tag: the CUDA stage reuses this Python on Ubuntu 24.04,
# whose glibc (2.39) must not be older than the one Python was built against (2.36).
FROM python:3.11-slim-bookworm AS python

# ---------------------------------------------------------------------------------------
# build: generate the gRPC code and install spindle with its dependencies into a venv, and (CPU
# variant) build the worker's CPU kernels. Every dependency ships wheels; the one compiler here
# is for the kernels, and it stays in this stage.
FROM python AS build
ARG VARIANT
ARG TORCH_CUDA
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY services services
COPY shared shared

# Same steps as `make protos`: protoc writes absolute imports, the sed makes them
# package-relative so the code lives under shared/pb. grpcio-tools stays out of the venv.
RUN pip install --no-cache-dir "$(grep -o 'grpcio-tools==[0-9.]*' pyproject.toml)" \
    && mkdir -p shared/pb \
    && python -m grpc_tools.protoc -Iprotos --python_out=shared/pb --pyi_out=shared/pb \
        --grpc_python_out=shared/pb protos/spindle/v1/*.proto \
    && sed -i -E 's/^from spindle\.v1 import/from . import/' shared/pb/spindle/v1/*.py \
    && touch shared/pb/__init__.py shared/pb/spindle/__init__.py shared/pb/spindle/v1/__init__.py

# torch first, from the PyTorch index of the variant: the PyPI wheel of the same version is
# the CUDA one and would pull gigabytes of CUDA libraries into the CPU image. `pip install .`
# then finds `torch==X` satisfied by `X+cpu` / `X+cu128`.
RUN python -m venv /opt/spindle \
    && index="$([ "$VARIANT" = cuda ] && echo "$TORCH_CUDA" || echo cpu)" \
    && /opt/spindle/bin/pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/$index" \
        "$(grep -o '"torch==[0-9.]*' pyproject.toml | tr -d '"')" \
    && /opt/spindle/bin/pip install --no-cache-dir . \
    && /opt/spindle/bin/spindle --help > /dev/null

# The worker's CPU kernels (services/worker/kernels). The final image has no compiler, so a
# worker there cannot build them for its own CPU (-march=native): they are built here for each
# CPU family of the image's machine (kernels/targets.py: four x86 levels, or any 64-bit Arm; any
# building CPU will do), and a worker loads the best one its CPU runs from SPINDLE_KERNEL_CACHE.
# Without them every op ran on torch's fallbacks. g++ is Debian's, unpinned as the runtime
# packages below are (DL3008).
# hadolint ignore=DL3008
RUN if [ "$VARIANT" = cpu ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/* \
        && SPINDLE_KERNEL_CACHE=/opt/spindle/kernels /opt/spindle/bin/python -m services.worker.kernels.build \
            --strict --targets family; \
    fi

# ---------------------------------------------------------------------------------------
# Runtime bases: the slim Python image for CPU, an NVIDIA CUDA base for GPU workers.
FROM python AS runtime-cpu

# The `base` flavour carries cudart, the driver compat libraries and the NVIDIA_* settings
# the container toolkit reads; torch's CUDA wheels bring their own cuBLAS and cuDNN, so the
# larger `runtime` flavour would only duplicate them.
FROM ${CUDA_BASE} AS runtime-cuda
# Python comes from the same image the venv was built with (its /usr/local), plus the
# shared libraries its standard modules link (ssl, ctypes, sqlite3, bz2, lzma, xml).
COPY --from=python /usr/local /usr/local
# Unpinned apt packages (DL3008) on purpose: the base image fixes the Ubuntu release, and
# exact versions of security-patched libraries leave the archive, which would break builds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3t64 libffi8 \
        libsqlite3-0 libbz2-1.0 liblzma5 libexpat1 zlib1g tzdata \
    && rm -rf /var/lib/apt/lists/* \
    && ldconfig \
    && python3 -c "import ssl, ctypes, sqlite3, bz2, lzma, pyexpat"

# ---------------------------------------------------------------------------------------
# final: the venv on the chosen base, a non-root user, nothing to compile with.
# DL3006 (untagged image): `runtime-${VARIANT}` is one of the two stages above, whose bases
# are pinned; hadolint cannot resolve a stage name built from a build argument.
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS final
ARG VARIANT
LABEL org.opencontainers.image.title="spindle" \
      org.opencontainers.image.description="LLM inference server: frontend, scheduler and worker in one image" \
      dev.spindle.variant="${VARIANT}"

# A fixed numeric uid/gid (10001) so Kubernetes' runAsNonRoot can verify it, and the chart's
# securityContext names the same one. No home directory: HOME points at /tmp, which is an
# emptyDir under a read-only root filesystem.
RUN groupadd --system --gid 10001 spindle \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin spindle

COPY --from=build /opt/spindle /opt/spindle
ENV PATH=/opt/spindle/bin:$PATH \
    SPINDLE_KERNEL_CACHE=/opt/spindle/kernels \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001

# HTTP, public gRPC, scheduler, worker, Prometheus metrics.
EXPOSE 8000 50051 50052 50061 9400
ENTRYPOINT ["spindle"]
CMD ["--help"]
