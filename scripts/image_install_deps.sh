#!/bin/sh
# Install one image's pinned dependencies (the constraints file given) into /opt/perseus, a venv
# without pip or setuptools, from the wheelhouse the Dockerfile mounts at /wheels (the tools
# stage's pip settings: no index, --find-links /wheels). kubernetes.aio is dropped (nothing
# imports it) and the bytecode compiled with hash-based invalidation (no build time in it).
# Run by the Dockerfile's operator-deps and node-agent-deps stages, so that both install alike.
set -eu
constraints=$1
python3 -m venv --without-pip /opt/perseus
/opt/tools/bin/python -m pip --python /opt/perseus/bin/python install --no-compile \
    --no-deps -r "$constraints"
site=$(/opt/perseus/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
rm -rf "$site/kubernetes/aio"
/opt/perseus/bin/python -m compileall -q -j0 --invalidation-mode unchecked-hash "$site"
