# syntax=docker/dockerfile:1
# The matrixpool operator image: `docker build -t matrixpool:dev .` at the repository root.
# Stage 1 builds wheels of matrixpool and its dependencies; stage 2 installs them into a venv
# on a fresh base, without build tools or pip caches, and runs as the non-root uid 65532.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY recovery/ recovery/
RUN python -m pip wheel --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/matrixpool \
    PATH=/opt/matrixpool/bin:$PATH
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv /opt/matrixpool \
    && /opt/matrixpool/bin/pip install --no-index --find-links=/wheels matrixpool \
    && groupadd --gid 65532 matrixpool \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin matrixpool
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080 9090
ENTRYPOINT ["matrixpool"]
CMD ["run", "--liveness=http://0.0.0.0:8080/healthz"]
