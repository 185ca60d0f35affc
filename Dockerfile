# syntax=docker/dockerfile:1
# The matrixpool image (operator, checkpoint daemon, device plugin, example trainers), for users
# with a registry: `docker build -t matrixpool:dev .` at the repository root.
#
# It describes the same image `make image` builds here without a registry or Docker
# (tools/image/build.sh: mmdebstrap + the wheel): Debian bookworm with Debian's python3,
# python3-numpy and python3-torch (CPU), a venv at /opt/matrixpool that sees them
# (--system-site-packages) holding the project's wheel, the non-root uid 65532, ENTRYPOINT
# matrixpool. Keep the package list in step with `packages=` in tools/image/build.sh.

ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE} AS base
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv python3-numpy python3-torch ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man \
    && groupadd --gid 65532 matrixpool \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin matrixpool

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
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m venv --system-site-packages /opt/matrixpool \
    && /opt/matrixpool/bin/pip install --no-index --no-cache-dir --find-links=/wheels matrixpool \
    && /opt/matrixpool/bin/python -c "import matrixpool, matrixpool_recovery, torch, numpy"
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["matrixpool"]
CMD ["run", "--liveness=http://0.0.0.0:8080/healthz"]
