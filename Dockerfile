# syntax=docker/dockerfile:1
# Container images of Perseus for Kubernetes, one target per component:
#
#   docker build --target operator   -t perseus-operator   .
#   docker build --target node-agent -t perseus-node-agent .
#
# Both install the project's wheel with every dependency pinned (scripts/image-constraints.txt,
# regenerate with scripts/image_constraints.py). Pin the base image by digest for reproducible
# builds: --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: the project's wheel, then one virtual environment per component ------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY scripts/image-constraints.txt /constraints.txt
RUN python -m pip install --constraint /constraints.txt setuptools wheel
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY node_agent ./node_agent
RUN python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

FROM build AS operator-env
RUN python -m venv /opt/perseus \
 && /opt/perseus/bin/pip install --constraint /constraints.txt \
        "$(ls /wheels/perseus_k8s-*.whl)[operator]"

FROM build AS node-agent-env
RUN python -m venv /opt/perseus \
 && /opt/perseus/bin/pip install --constraint /constraints.txt \
        "$(ls /wheels/perseus_k8s-*.whl)[agent]"

# -- operator: non-root, read-only root filesystem friendly (caches in /tmp) ------------------
FROM ${PYTHON_IMAGE} AS operator
RUN groupadd --system --gid 65532 perseus \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin perseus
COPY --from=operator-env /opt/perseus /opt/perseus
ENV PATH=/opt/perseus/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/tmp/numba \
    MPLCONFIGDIR=/tmp/matplotlib
USER 65532:65532
# /metrics, kopf's /healthz
EXPOSE 8080 8081
ENTRYPOINT ["perseus-operator"]

# -- node agent: root, as NVML's clock locking needs (with CAP_SYS_ADMIN, see the chart) ------
FROM ${PYTHON_IMAGE} AS node-agent
COPY --from=node-agent-env /opt/perseus /opt/perseus
ENV PATH=/opt/perseus/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
USER 0:0
# /metrics and /healthz
EXPOSE 9400
ENTRYPOINT ["perseus-node-agent"]
