# syntax=docker/dockerfile:1
# The matrixpool image (operator, checkpoint daemon, device plugin, example trainers), for users
# with a registry: `docker build -t matrixpool:dev .` at the repository root.
#
# It describes the same image `make image` builds here without a registry or Docker
# (tools/image/build.sh: mmdebstrap + wheels), in the same three layers: Debian bookworm with
# Debian's python3; a venv at /opt/matrixpool with PyPI's torch (pinned as in
# tools/torch-venv.sh) and NumPy; the project's wheel in that venv; the non-root uid 65532,
# ENTRYPOINT matrixpool. Keep the package list in step with `packages=` in tools/image/build.sh.
#
# The image runs torch on CPU (gloo). PyPI has no CPU-only torch for Linux: its wheel requires
# NVIDIA's CUDA wheels (~5.6 GB installed). The torch stage installs them, uninstalls triton
# (torch.compile's GPU kernels) and prunes what only a GPU opens with tools/image/torchlayer.py,
# the list build.sh uses, which also checks that every library left finds the libraries it needs
# (~2.7 GB left). PyTorch's own index (download.pytorch.org/whl/cpu) publishes CPU-only builds
# that are smaller still; this file stays with PyPI's wheel so that it matches `make image`.

ARG DEBIAN_IMAGE=debian:bookworm-slim
# torch's version: the one TORCH=torch==X.Y.Z in tools/torch-venv.sh pins (a unit test checks).
ARG TORCH_VERSION=2.15.0

FROM ${DEBIAN_IMAGE} AS base
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man \
    && groupadd --gid 65532 matrixpool \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin matrixpool

# The venv with torch and NumPy, pruned for CPU in the same step (one layer, never the 5.6 GB).
FROM base AS torch
ARG TORCH_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY tools/image/torchlayer.py /tmp/torchlayer.py
RUN python3 -m venv --system-site-packages /opt/matrixpool \
    && /opt/matrixpool/bin/pip install "torch==${TORCH_VERSION}" numpy \
    && /opt/matrixpool/bin/pip uninstall --yes triton \
    && python3 /tmp/torchlayer.py prune / /opt/matrixpool/lib/python3.11/site-packages

# Wheels of matrixpool and its dependencies (build tools stay in this stage).
FROM base AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY recovery/ recovery/
RUN python3 -m venv /tmp/pip && /tmp/pip/bin/pip wheel --wheel-dir /wheels .

FROM base
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/matrixpool \
    PATH=/opt/matrixpool/bin:$PATH
COPY --from=torch /opt/matrixpool /opt/matrixpool
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    /opt/matrixpool/bin/pip install --no-index --no-cache-dir --find-links=/wheels matrixpool \
    && /opt/matrixpool/bin/python -c "import matrixpool, matrixpool_recovery, torch, numpy"
USER 65532:65532
WORKDIR /tmp
# The smoke test build.sh runs too: gloo all_reduce, torchrun, FSDP2, DCP save/async_save/load.
ARG TORCH_VERSION
RUN --mount=type=bind,source=tools/image/smoke.py,target=/tmp/smoke.py \
    OMP_NUM_THREADS=1 python /tmp/smoke.py --expect-version "${TORCH_VERSION}" \
    --expect-prefix /opt/matrixpool/
EXPOSE 8080 9090
ENTRYPOINT ["matrixpool"]
CMD ["run", "--liveness=http://0.0.0.0:8080/healthz"]
