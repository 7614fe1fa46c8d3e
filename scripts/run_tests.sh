#!/usr/bin/env bash
# The pytest part of `make test`: the tests that need no Kubernetes binaries run while those
# binaries build, then the end-to-end tests run on them.
#
#   1. scripts/build_test_control_plane.sh starts in the background, as two builds side by side
#      (the Kubernetes binaries and helm; KWOK and the Kubeflow controllers), niced, output in
#      $PERSEUS_K8S_CACHE/logs/. With a warm cache both only look the binaries up (seconds).
#   2. tests/unit and tests/integration run meanwhile (they use kmock, fake NVML, torch and
#      local processes, never the control plane). Their timing tests are written to hold on a
#      loaded 2-core machine, and the builds run at nice 10, so the tests take the cores first.
#   3. When both builds are done, the exports of `build_test_control_plane.sh --env` are
#      loaded and tests/e2e runs. A failed build leaves the e2e tests without their binaries:
#      they skip saying so, or fail under PERSEUS_REQUIRE_E2E=1 (CI).
#
# Cold, on 2 cores, the two build streams take about as long as the first stage's tests plus
# the remaining builds would one after the other; see the README's "Running the tests".
# Exit status: non-zero if any pytest run or build failed. Extra arguments go to both pytest
# runs (e.g. `-x`, `-k name`).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
CACHE="${PERSEUS_K8S_CACHE:-$HOME/.cache/perseus-k8s}"
mkdir -p "$CACHE/logs"
BUILD_LOG="$CACHE/logs/run_tests-build.log"
: >"$BUILD_LOG"

# Two streams, each one `go build` at a time on one core: together they keep both cores busy
# through the link steps, which a single build runs on one core. Each stream is its own
# process group (set -m), so that an interrupted test run stops the go commands too.
set -m
scripts/build_test_control_plane.sh --only etcd,kube-apiserver,kube-controller-manager,kube-scheduler,helm \
  >>"$BUILD_LOG" 2>&1 &
build_core=$!
scripts/build_test_control_plane.sh --only kwok,training-operator,jobset,trainer \
  >>"$BUILD_LOG" 2>&1 &
build_controllers=$!
# A test run stopped with Ctrl-C must not leave builds behind.
set +m
trap 'kill -- "-$build_core" "-$build_controllers" 2>/dev/null' INT TERM EXIT

status=0
start=$SECONDS
"$PYTHON" -m pytest tests/unit tests/integration "$@" || status=$?
echo "[run_tests] unit + integration: exit $status after $((SECONDS - start)) s"

wait_start=$SECONDS
build_status=0
wait "$build_core" || build_status=$?
wait "$build_controllers" || build_status=$?
trap - INT TERM EXIT
echo "[run_tests] waited $((SECONDS - wait_start)) s for the test control plane builds (exit $build_status):"
sed 's/^/  /' "$BUILD_LOG"
if [[ "$build_status" -ne 0 ]]; then
  echo "WARNING: the test control plane did not build (log above): Kubernetes end-to-end tests will skip, or fail under PERSEUS_REQUIRE_E2E=1"
  [[ "${PERSEUS_REQUIRE_E2E:-}" == 1 ]] && status=1
fi

# With an empty --only, --env builds nothing and prints the binaries the cache holds.
if exports="$(scripts/build_test_control_plane.sh --env --only '' 2>/dev/null)"; then
  eval "$exports"
fi
e2e_start=$SECONDS
e2e_status=0
"$PYTHON" -m pytest tests/e2e "$@" || e2e_status=$?
echo "[run_tests] e2e: exit $e2e_status after $((SECONDS - e2e_start)) s"
[[ "$e2e_status" -ne 0 ]] && status=$e2e_status
exit "$status"
