# Container images of Perseus for Kubernetes, one target per component. How to build, test and
# publish them (also multi-arch, and without a Docker daemon): docs/operations/images.md.
#
#   scripts/build_images.sh                            # buildah, no daemon; smoke-tests both
#   docker build --target operator   -t perseus-operator   .
#   docker build --target node-agent -t perseus-node-agent .
#   docker buildx build --platform linux/amd64,linux/arm64 --target operator ...   # multi-arch
#
# No `# syntax=` line on purpose: the builder's own Dockerfile frontend reads this file, so a
# build that may only reach a mirror pulls nothing but the base image.
#
# Each image's layers, bottom to top: the base; its dependencies, every one pinned
# (scripts/image-constraints-<component>.txt, written by scripts/image_constraints.py) and
# installed before any project file is copied; the project's own packages, installed with
# --no-deps. A README, docs or source edit changes only that last, small layer
# (scripts/image_layers.py checks it on every scripts/build_images.sh run).
#
# Reproducible: pin the base by digest (PYTHON_IMAGE=...@sha256:..., as build_images.sh does)
# and give the build a fixed timestamp (buildah --timestamp 0, BuildKit SOURCE_DATE_EPOCH=0 with
# rewrite-timestamp), meant to give the same dependency layers for the same pins whatever the
# commit (its date is the created label). Bytecode is compiled with hash-based invalidation and
# a fixed hash seed, so no file carries the time or the seed of its build.
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
# Where the dependencies' wheels come from: the stage below (PyPI) by default; build_images.sh
# passes an image holding a wheelhouse it downloaded on the host, so the build needs no network.
ARG WHEELHOUSE=pypi-wheels

# -- the dependencies' wheels, from PyPI ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS pypi-wheels
COPY scripts/image-constraints-tools.txt scripts/image-constraints-operator.txt \
     scripts/image-constraints-agent.txt /constraints/
# A venv of its own: not every base has pip outside one (the Debian bootstrap has not).
RUN python3 -m venv /tmp/pip \
 && /tmp/pip/bin/python -m pip download --disable-pip-version-check --no-cache-dir \
        --no-deps --only-binary=:all: --dest /wheels \
        -r /constraints/image-constraints-tools.txt \
        -r /constraints/image-constraints-operator.txt \
        -r /constraints/image-constraints-agent.txt \
 && rm -rf /tmp/pip

FROM ${WHEELHOUSE} AS wheelhouse

# -- build tools: pip, setuptools and wheel at their pins (not the base's or ensurepip's) ------
FROM ${PYTHON_IMAGE} AS tools
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_NO_INDEX=1 \
    PIP_FIND_LINKS=/wheels \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONHASHSEED=0 \
    SOURCE_DATE_EPOCH=315532800
COPY scripts/image-constraints-tools.txt /constraints/
RUN --mount=type=bind,from=wheelhouse,source=/wheels,target=/wheels \
    python3 -m venv /opt/tools \
 && /opt/tools/bin/python -m pip install --no-compile \
        -r /constraints/image-constraints-tools.txt
COPY scripts/image_install_deps.sh /opt/tools/

# -- each component's dependencies, in a venv of their own (no pip or setuptools in it) -------
#    (scripts/image_install_deps.sh: a venv without pip, --no-deps from the pins, bytecode)
FROM tools AS operator-deps
COPY scripts/image-constraints-operator.txt /constraints/
RUN --mount=type=bind,from=wheelhouse,source=/wheels,target=/wheels \
    sh /opt/tools/image_install_deps.sh /constraints/image-constraints-operator.txt

FROM tools AS node-agent-deps
COPY scripts/image-constraints-agent.txt /constraints/
RUN --mount=type=bind,from=wheelhouse,source=/wheels,target=/wheels \
    sh /opt/tools/image_install_deps.sh /constraints/image-constraints-agent.txt

# -- the project: its wheel, cut to each component's packages and console script --------------
FROM tools AS wheels
COPY pyproject.toml README.md /src/
COPY operator /src/operator
COPY node_agent /src/node_agent
COPY scripts/image_wheel.py /src/scripts/
RUN /opt/tools/bin/python -m pip wheel --no-deps --no-build-isolation --wheel-dir /dist /src \
 && /opt/tools/bin/python /src/scripts/image_wheel.py operator /dist/perseus_k8s-*.whl /dist/operator \
 && /opt/tools/bin/python /src/scripts/image_wheel.py agent /dist/perseus_k8s-*.whl /dist/node-agent

# Installed under /out (pip --root) beside the dependencies' venv, so that the final COPY is a
# layer of the project's files alone. (COPY, not RUN --mount from the stage: buildah 1.28 cannot
# mount a stage that came from its layer cache.)
FROM operator-deps AS operator-app
COPY --from=wheels /dist/operator/ /dist/
RUN /opt/tools/bin/python -m pip --python /opt/perseus/bin/python install --no-compile \
        --no-deps --no-warn-script-location --root /out /dist/perseus_k8s-*.whl \
 && /opt/perseus/bin/python -m compileall -q -j0 --invalidation-mode unchecked-hash \
        -s /out -p / /out/opt/perseus

FROM node-agent-deps AS node-agent-app
COPY --from=wheels /dist/node-agent/ /dist/
RUN /opt/tools/bin/python -m pip --python /opt/perseus/bin/python install --no-compile \
        --no-deps --no-warn-script-location --root /out /dist/perseus_k8s-*.whl \
 && /opt/perseus/bin/python -m compileall -q -j0 --invalidation-mode unchecked-hash \
        -s /out -p / /out/opt/perseus

# -- runtime base: the base without its pip, setuptools and wheel (nothing here runs them;
#    the official base's setuptools 65.5 is flagged by scanners: CVE-2024-6345) -------------
FROM ${PYTHON_IMAGE} AS runtime
RUN if python3 -m pip --version >/dev/null 2>&1; then \
        python3 -m pip uninstall --yes --disable-pip-version-check pip setuptools wheel; \
    fi \
 && rm -rf /usr/share/python-wheels /root/.cache

# -- operator: non-root, read-only root filesystem friendly (numba's cache in /tmp) -----------
FROM runtime AS operator
RUN groupadd --gid 65532 perseus \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin --no-log-init perseus
COPY --from=operator-deps /opt/perseus /opt/perseus
COPY --from=operator-app /out/ /
ENV PATH=/opt/perseus/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/tmp/numba
USER 65532:65532
# /metrics, kopf's /healthz, the admission webhook (HTTPS)
EXPOSE 8080 8081 9443
ENTRYPOINT ["perseus-operator"]
# Last, so that a new revision or date changes the image's configuration only, no layer.
ARG PYTHON_IMAGE
ARG BASE_DIGEST=""
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=1980-01-01T00:00:00Z
ARG SOURCE_URL=""
LABEL org.opencontainers.image.title="perseus-operator" \
      org.opencontainers.image.description="Perseus for Kubernetes: the operator (kopf) that plans GPU clocks of pipeline-parallel training jobs" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}"

# -- node agent: root, as NVML's clock locking needs (with CAP_SYS_ADMIN, see the chart) ------
FROM runtime AS node-agent
COPY --from=node-agent-deps /opt/perseus /opt/perseus
COPY --from=node-agent-app /out/ /
ENV PATH=/opt/perseus/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
USER 0:0
# /metrics and /healthz, the training processes' TCP endpoint (the socket file is the default)
EXPOSE 7461 7460
ENTRYPOINT ["perseus-node-agent"]
ARG PYTHON_IMAGE
ARG BASE_DIGEST=""
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=1980-01-01T00:00:00Z
ARG SOURCE_URL=""
LABEL org.opencontainers.image.title="perseus-node-agent" \
      org.opencontainers.image.description="Perseus for Kubernetes: the node agent that sets GPU clocks (NVML) and exports GPU energy metrics" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}"
