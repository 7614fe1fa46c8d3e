#!/usr/bin/env bash
# Build (or reuse from cache) a kube-apiserver, a kube-controller-manager (for
# its garbage collector and workload controllers), an etcd, the helm CLI, a
# kube-scheduler, KWOK's controller (fake nodes and pod phases), Kubeflow's
# training-operator, JobSet's controller and Kubeflow Trainer v2 for end-to-end tests that run a real control plane on
# 127.0.0.1 and install the chart with `helm`.
#
# All are built from Go modules with the local Go toolchain (no registry
# ships the binaries). Binaries are cached OUTSIDE the repository, keyed by
# version:
#
#   $PERSEUS_K8S_CACHE/kube-apiserver-<K8S_VERSION>/kube-apiserver
#   $PERSEUS_K8S_CACHE/kube-controller-manager-<K8S_VERSION>/kube-controller-manager
#   $PERSEUS_K8S_CACHE/etcd-<ETCD_VERSION>/etcd
#   $PERSEUS_K8S_CACHE/helm-<HELM_VERSION>/helm
#   $PERSEUS_K8S_CACHE/kube-scheduler-<K8S_VERSION>/kube-scheduler
#   $PERSEUS_K8S_CACHE/kwok-<KWOK_VERSION>/kwok
#   $PERSEUS_K8S_CACHE/kwok-<KWOK_VERSION>/stages/*.yaml
#   $PERSEUS_K8S_CACHE/training-operator-<TRAINING_OPERATOR_VERSION>/training-operator
#   $PERSEUS_K8S_CACHE/training-operator-<TRAINING_OPERATOR_VERSION>/manifests/*.yaml
#   $PERSEUS_K8S_CACHE/jobset-<JOBSET_VERSION>/{jobset,manifests/*.yaml}
#   $PERSEUS_K8S_CACHE/trainer-<TRAINER_VERSION>/{trainer-controller-manager,manifests/*.yaml}
#
# (default cache: ~/.cache/perseus-k8s). A second run with the same versions
# only checks that the binaries exist and run, and prints their paths.
#
# Usage:
#   scripts/build_test_control_plane.sh            # build/reuse all, print paths
#   eval "$(scripts/build_test_control_plane.sh --env)"
#       # ... and print shell exports PERSEUS_ETCD_BIN=... PERSEUS_KUBE_APISERVER_BIN=...
#       # PERSEUS_KUBE_CONTROLLER_MANAGER_BIN=... PERSEUS_HELM_BIN=...
#       # PERSEUS_KUBE_SCHEDULER_BIN=... PERSEUS_KWOK_BIN=... PERSEUS_KWOK_STAGES=...
#       # PERSEUS_TRAINING_OPERATOR_BIN=... PERSEUS_TRAINING_OPERATOR_MANIFESTS=...
#       # PERSEUS_JOBSET_BIN=... PERSEUS_JOBSET_MANIFESTS=... PERSEUS_TRAINER_BIN=...
#       # PERSEUS_TRAINER_MANIFESTS=...
#   scripts/build_test_control_plane.sh --only kwok,kube-scheduler
#       # build/reuse only those (names: etcd kube-apiserver kube-controller-manager
#       # helm kube-scheduler kwok training-operator jobset trainer; default: all);
#       # --env still prints every binary in the cache
#       # (not ETCD_BIN: etcd reads every ETCD_* environment variable as a flag
#       # and warns "unrecognized environment variable" about ETCD_BIN)
#
# Environment:
#   K8S_VERSION        k8s.io/kubernetes version      (default v1.36.3)
#   ETCD_VERSION       go.etcd.io/etcd/server/v3 ver. (default v3.6.16)
#   HELM_VERSION       helm.sh/helm/v3 version        (default v3.22.0)
#   KWOK_VERSION       sigs.k8s.io/kwok version       (default v0.8.0)
#   TRAINING_OPERATOR_VERSION  github.com/kubeflow/training-operator (default v1.8.1)
#   JOBSET_VERSION     sigs.k8s.io/jobset             (default v0.8.2)
#   TRAINER_VERSION    github.com/kubeflow/trainer/v2 (default v2.0.0)
#   PERSEUS_K8S_CACHE  cache directory                (default ~/.cache/perseus-k8s)
#   GO                 go binary (default: `go` on PATH, else /usr/local/go/bin/go)
#   BUILD_NICE         nice level for the builds      (default 10)
#   BUILD_PARALLEL     go build -p value              (default: the cores, 1 on <= 2 cores)
#
# Build output goes to <cache>/logs/*.log, each build's wall time to
# <cache>/logs/build-times.log; on failure the tail of the log (the
# exact compiler/go-command error) is printed and the script exits non-zero.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
TRAINING_OPERATOR_VERSION="${TRAINING_OPERATOR_VERSION:-v1.8.1}"
JOBSET_VERSION="${JOBSET_VERSION:-v0.8.2}"  # the one trainer v2.0.0's go.mod requires
TRAINER_VERSION="${TRAINER_VERSION:-v2.0.0}"
CACHE="${PERSEUS_K8S_CACHE:-$HOME/.cache/perseus-k8s}"
BUILD_NICE="${BUILD_NICE:-10}"
# One build at a time; each compiles on every core where there are more than two (CI), on
# one where there are two (a shared development machine).
CORES="$(nproc 2>/dev/null || echo 1)"
if [[ "$CORES" -gt 2 ]]; then BUILD_PARALLEL="${BUILD_PARALLEL:-$CORES}"; else BUILD_PARALLEL="${BUILD_PARALLEL:-1}"; fi

ALL_NAMES="etcd kube-apiserver kube-controller-manager helm kube-scheduler kwok training-operator jobset trainer"
PRINT_ENV=0
ONLY="$ALL_NAMES"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --env) PRINT_ENV=1 ;;
    --only)
      [[ $# -ge 2 ]] || { echo "--only needs a comma-separated list of: $ALL_NAMES" >&2; exit 2; }
      ONLY="${2//,/ }"; shift
      for name in $ONLY; do
        [[ " $ALL_NAMES " == *" $name "* ]] \
          || { echo "--only: unknown name '$name' (known: $ALL_NAMES)" >&2; exit 2; }
      done ;;
    -h|--help) sed -n '2,58p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
wanted() { [[ " $ONLY " == *" $1 "* ]]; }

if [[ -z "${GO:-}" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "ERROR: no Go toolchain found (set GO=/path/to/go)" >&2; exit 1
  fi
fi

log() { echo "[build_test_control_plane] $*" >&2; }
die() { echo "[build_test_control_plane] ERROR: $*" >&2; exit 1; }

[[ "$K8S_VERSION" =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] \
  || die "K8S_VERSION must look like v1.MINOR.PATCH, got '$K8S_VERSION'"
K8S_MINOR="${BASH_REMATCH[1]}"
STAGING_VERSION="v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"
[[ "$ETCD_VERSION" =~ ^v3\.[0-9]+\.[0-9]+$ ]] \
  || die "ETCD_VERSION must look like v3.MINOR.PATCH, got '$ETCD_VERSION'"
[[ "$HELM_VERSION" =~ ^v3\.[0-9]+\.[0-9]+$ ]] \
  || die "HELM_VERSION must look like v3.MINOR.PATCH, got '$HELM_VERSION'"
[[ "$KWOK_VERSION" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] \
  || die "KWOK_VERSION must look like vMAJOR.MINOR.PATCH, got '$KWOK_VERSION'"
[[ "$TRAINING_OPERATOR_VERSION" =~ ^v1\.[0-9]+\.[0-9]+$ ]] \
  || die "TRAINING_OPERATOR_VERSION must look like v1.MINOR.PATCH, got '$TRAINING_OPERATOR_VERSION'"

APISERVER_BIN="$CACHE/kube-apiserver-$K8S_VERSION/kube-apiserver"
KCM_BIN="$CACHE/kube-controller-manager-$K8S_VERSION/kube-controller-manager"
ETCD_BIN="$CACHE/etcd-$ETCD_VERSION/etcd"
HELM_BIN="$CACHE/helm-$HELM_VERSION/helm"
SCHEDULER_BIN="$CACHE/kube-scheduler-$K8S_VERSION/kube-scheduler"
KWOK_BIN="$CACHE/kwok-$KWOK_VERSION/kwok"
KWOK_STAGES="$CACHE/kwok-$KWOK_VERSION/stages"
TRAINING_OPERATOR_BIN="$CACHE/training-operator-$TRAINING_OPERATOR_VERSION/training-operator"
TRAINING_OPERATOR_MANIFESTS="$CACHE/training-operator-$TRAINING_OPERATOR_VERSION/manifests"
JOBSET_BIN="$CACHE/jobset-$JOBSET_VERSION/jobset"
JOBSET_MANIFESTS="$CACHE/jobset-$JOBSET_VERSION/manifests"
TRAINER_BIN="$CACHE/trainer-$TRAINER_VERSION/trainer-controller-manager"
TRAINER_MANIFESTS="$CACHE/trainer-$TRAINER_VERSION/manifests"
LOG_DIR="$CACHE/logs"
mkdir -p "$CACHE" "$LOG_DIR"

# One build at a time per binary, taken only to build (a lookup of cached binaries never
# waits for a build of others): the four original binaries share "$CACHE/.lock", as before.
lock_for() {  # lock_for NAME: hold the build lock of NAME on fd 9 until unlock
  local file="$CACHE/.lock-$1"
  case "$1" in etcd|kube-apiserver|kube-controller-manager|helm) file="$CACHE/.lock" ;; esac
  exec 9>"$file"
  if command -v flock >/dev/null 2>&1; then flock 9; fi
}
unlock() { exec 9>&-; }

# Go environment for the builds: static binaries, no VCS stamping (the module
# cache has no .git), module mode, workspace off.
export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOWORK=off GO111MODULE=on

# run_logged LOGFILE CMD... : run CMD niced, output to LOGFILE; on failure show
# the tail of the log and exit.
run_logged() {
  local logfile="$1"; shift
  echo "+ $*" >>"$logfile"
  if ! nice -n "$BUILD_NICE" "$@" >>"$logfile" 2>&1; then
    echo "[build_test_control_plane] ERROR: command failed: $*" >&2
    echo "[build_test_control_plane] ---- last 60 lines of $logfile ----" >&2
    tail -n 60 "$logfile" >&2
    echo "[build_test_control_plane] ---- end of log ----" >&2
    exit 1
  fi
}

# build_kubernetes NAME BIN: build k8s.io/kubernetes/cmd/NAME at $K8S_VERSION into BIN.
build_kubernetes() {
  local name="$1" bin="$2"
  local work="$CACHE/build/$name-$K8S_VERSION"
  local logfile="$LOG_DIR/$name-$K8S_VERSION.log"
  : >"$logfile"
  log "building $name $K8S_VERSION (staging modules $STAGING_VERSION); log: $logfile"
  rm -rf "$work"; mkdir -p "$work"
  cd "$work"

  # The k8s.io/kubernetes go.mod replaces every k8s.io/* staging module with a
  # local path (./staging/src/k8s.io/...). Those replaces are ignored for a
  # dependency, so our own go.mod replaces each of them with its published
  # v0.MINOR.PATCH version instead.
  local modinfo gomod
  modinfo="$("$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" 2>&1)" \
    || die "go mod download k8s.io/kubernetes@$K8S_VERSION failed:
$modinfo"
  gomod="$(printf '%s\n' "$modinfo" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  [[ -f "$gomod" ]] || die "cannot find go.mod of k8s.io/kubernetes@$K8S_VERSION in: $modinfo"
  local staging
  staging="$(sed -n 's|^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/.*|\1|p' "$gomod" | sort -u)"
  [[ -n "$staging" ]] || die "no staging replaces found in $gomod"
  local goline
  goline="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod" | head -n1)"

  {
    echo "module perseus.local/$name-build"
    echo
    echo "go ${goline:-1.26.0}"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    local m
    for m in $staging; do echo "	$m => $m $STAGING_VERSION"; done
    echo ")"
  } >go.mod
  cat >tools.go <<EOF
//go:build tools

package tools

import _ "k8s.io/kubernetes/cmd/$name"
EOF
  cp go.mod "$LOG_DIR/$name-$K8S_VERSION.go.mod"

  run_logged "$logfile" "$GO" mod tidy
  local ldflags="-s -w"
  ldflags+=" -X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
  ldflags+=" -X k8s.io/component-base/version.gitMajor=1"
  ldflags+=" -X k8s.io/component-base/version.gitMinor=$K8S_MINOR"
  ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
  ldflags+=" -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  mkdir -p "$(dirname "$bin")"
  run_logged "$logfile" "$GO" build -p "$BUILD_PARALLEL" -trimpath -ldflags "$ldflags" \
    -o "$bin.tmp" "k8s.io/kubernetes/cmd/$name"
  mv -f "$bin.tmp" "$bin"
  cd - >/dev/null
}

build_etcd() {
  local work="$CACHE/build/etcd-$ETCD_VERSION"
  local logfile="$LOG_DIR/etcd-$ETCD_VERSION.log"
  : >"$logfile"
  log "building etcd $ETCD_VERSION (go.etcd.io/etcd/server/v3); log: $logfile"
  rm -rf "$work"; mkdir -p "$work"
  cd "$work"
  # etcd's server/go.mod replaces its sibling modules with ../ paths; as a
  # dependency those replaces are ignored, so pin the siblings to the same tag.
  cat >go.mod <<EOF
module perseus.local/etcd-build

go 1.26.0

require (
	go.etcd.io/etcd/server/v3 $ETCD_VERSION
	go.etcd.io/etcd/api/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/pkg/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/v3 $ETCD_VERSION
	go.etcd.io/etcd/pkg/v3 $ETCD_VERSION
)
EOF
  cat >tools.go <<'EOF'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
EOF
  run_logged "$logfile" "$GO" mod tidy
  # tidy may raise the siblings above the tag; put them back.
  run_logged "$logfile" "$GO" mod edit \
    -require="go.etcd.io/etcd/api/v3@$ETCD_VERSION" \
    -require="go.etcd.io/etcd/client/pkg/v3@$ETCD_VERSION" \
    -require="go.etcd.io/etcd/client/v3@$ETCD_VERSION" \
    -require="go.etcd.io/etcd/pkg/v3@$ETCD_VERSION"
  mkdir -p "$(dirname "$ETCD_BIN")"
  run_logged "$logfile" "$GO" build -p "$BUILD_PARALLEL" -trimpath \
    -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
    -o "$ETCD_BIN.tmp" go.etcd.io/etcd/server/v3
  mv -f "$ETCD_BIN.tmp" "$ETCD_BIN"
  cd - >/dev/null
}

build_helm() {
  local work="$CACHE/build/helm-$HELM_VERSION"
  local logfile="$LOG_DIR/helm-$HELM_VERSION.log"
  : >"$logfile"
  log "building helm $HELM_VERSION (helm.sh/helm/v3/cmd/helm); log: $logfile"
  rm -rf "$work"; mkdir -p "$work"
  cd "$work"
  # A module of our own that requires helm keeps the same tidy/build/log path
  # as the other binaries (and the module cache shared with them).
  cat >go.mod <<EOF
module perseus.local/helm-build

go 1.26.0

require helm.sh/helm/v3 $HELM_VERSION
EOF
  cat >tools.go <<'EOF'
//go:build tools

package tools

import _ "helm.sh/helm/v3/cmd/helm"
EOF
  run_logged "$logfile" "$GO" mod tidy
  mkdir -p "$(dirname "$HELM_BIN")"
  # Stamp the tag: without it `helm version` reports the source's default.
  run_logged "$logfile" "$GO" build -p "$BUILD_PARALLEL" -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
    -o "$HELM_BIN.tmp" helm.sh/helm/v3/cmd/helm
  mv -f "$HELM_BIN.tmp" "$HELM_BIN"
  cd - >/dev/null
}

# build_module NAME MODULE VERSION PACKAGE BIN [LDFLAGS] [WEBHOOK_MAIN]: build PACKAGE (in
# MODULE at VERSION) into BIN from a module of our own that requires it, so the tidy/build/log
# path and the module cache are the same as for the other binaries; with WEBHOOK_MAIN (the
# package's main.go in MODULE), that file bound to loopback (loopback_webhook_main). Replaces in MODULE's go.mod are
# ignored for a dependency: none of the modules built this way has any (checked per version,
# see scripts/control_plane.md).
build_module() {
  local name="$1" module="$2" version="$3" package="$4" bin="$5" ldflags="${6:-}"
  local webhook_main="${7:-}"
  local work="$CACHE/build/$name-$version"
  local logfile="$LOG_DIR/$name-$version.log"
  : >"$logfile"
  log "building $name $version ($package); log: $logfile"
  rm -rf "$work"; mkdir -p "$work"
  cd "$work"
  cat >go.mod <<EOF
module perseus.local/$name-build

go 1.26.0

require $module $version
EOF
  local target="$package"
  if [[ -n "$webhook_main" ]]; then
    loopback_webhook_main "$module" "$version" "$webhook_main" >main.go
    target=.
  else
    cat >tools.go <<EOF
//go:build tools

package tools

import _ "$package"
EOF
  fi
  run_logged "$logfile" "$GO" mod tidy
  mkdir -p "$(dirname "$bin")"
  run_logged "$logfile" "$GO" build -p "$BUILD_PARALLEL" -trimpath -ldflags "-s -w $ldflags" \
    -o "$bin.tmp" "$target"
  mv -f "$bin.tmp" "$bin"
  cd - >/dev/null
}

# loopback_webhook_main MODULE VERSION MAIN: print MODULE's MAIN (a path in the module: a
# package main that imports no internal package) with its controller-runtime webhook server
# on 127.0.0.1, for build_module to build as its own main package (the rest comes from MODULE
# as a dependency; go's -overlay may not replace files in the module cache).
# controller-runtime's default host is "" (every address) and neither the training-operator
# nor Trainer has a flag for it; the tests' servers bind to loopback only. Fails if MAIN no
# longer has the one `webhook.NewServer(webhook.Options{` the patch expects.
loopback_webhook_main() {
  local main
  main="$(module_dir "$1" "$2")/$3"
  [[ "$(grep -c 'webhook\.NewServer(webhook\.Options{' "$main")" == 1 ]] \
    || die "expected one webhook.NewServer(webhook.Options{ in $main (to bind it to 127.0.0.1)"
  sed 's/webhook\.NewServer(webhook\.Options{/webhook.NewServer(webhook.Options{ Host: "127.0.0.1",/' \
    "$main"
}

# module_dir MODULE VERSION: the module's source in the module cache.
module_dir() {
  "$GO" mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p'
}

check_bin() {  # check_bin PATH ARGS... : binary exists and runs
  local bin="$1"; shift
  [[ -x "$bin" ]] || return 1
  "$bin" "$@" >/dev/null 2>&1
}

# timed NAME VERSION FUNC ARGS...: run a build, log its wall time to build-times.log.
timed() {
  local name="$1" version="$2"; shift 2
  lock_for "$name"
  local t1=$SECONDS
  "$@"
  local took=$((SECONDS - t1))
  unlock
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $name $version built in $took s (nice $BUILD_NICE, -p $BUILD_PARALLEL, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))" \
    >>"$LOG_DIR/build-times.log"
  log "$name $version built in $took s"
}

if wanted etcd; then
  if check_bin "$ETCD_BIN" --version; then
    log "etcd $ETCD_VERSION: cached"
  else
    timed etcd "$ETCD_VERSION" build_etcd
    check_bin "$ETCD_BIN" --version || die "built $ETCD_BIN but '$ETCD_BIN --version' fails: $("$ETCD_BIN" --version 2>&1 || true)"
  fi
fi

# kube-scheduler after the other two: the Go build cache is warm from them.
for name in kube-apiserver kube-controller-manager kube-scheduler; do
  wanted "$name" || continue
  case "$name" in
    kube-apiserver) bin="$APISERVER_BIN" ;;
    kube-controller-manager) bin="$KCM_BIN" ;;
    kube-scheduler) bin="$SCHEDULER_BIN" ;;
  esac
  if check_bin "$bin" --version; then
    log "$name $K8S_VERSION: cached"
  else
    timed "$name" "$K8S_VERSION" build_kubernetes "$name" "$bin"
    check_bin "$bin" --version || die "built $bin but '$bin --version' fails: $("$bin" --version 2>&1 || true)"
  fi
done

if wanted helm; then
  if check_bin "$HELM_BIN" version --short; then
    log "helm $HELM_VERSION: cached"
  else
    timed helm "$HELM_VERSION" build_helm
    check_bin "$HELM_BIN" version --short || die "built $HELM_BIN but '$HELM_BIN version' fails: $("$HELM_BIN" version 2>&1 || true)"
  fi
fi

if wanted kwok; then
  if check_bin "$KWOK_BIN" --version && [[ -f "$KWOK_STAGES/node-heartbeat.yaml" ]]; then
    log "kwok $KWOK_VERSION: cached"
  else
    timed kwok "$KWOK_VERSION" build_module kwok sigs.k8s.io/kwok "$KWOK_VERSION" \
      sigs.k8s.io/kwok/cmd/kwok "$KWOK_BIN"
    check_bin "$KWOK_BIN" --version || die "built $KWOK_BIN but '$KWOK_BIN --version' fails: $("$KWOK_BIN" --version 2>&1 || true)"
    # The controller alone has no stages (kwokctl passes them): the module's own, as kwokctl
    # uses them: nodes Ready at once and heartbeating (so the node lifecycle controller lifts
    # the not-ready taint and keeps it off), pods Running once bound, deleted pods gone. (Its
    # pod-complete only completes pods of batch Jobs; the tests add their own.)
    src="$(module_dir sigs.k8s.io/kwok "$KWOK_VERSION")"
    mkdir -p "$KWOK_STAGES"
    for stage in node/fast/node-initialize node/heartbeat/node-heartbeat pod/fast/pod-ready \
        pod/fast/pod-delete; do
      [[ -f "$src/kustomize/stage/$stage.yaml" ]] || die "no kustomize/stage/$stage.yaml in $src"
      cp "$src/kustomize/stage/$stage.yaml" "$KWOK_STAGES/"
    done
    chmod u+w "$KWOK_STAGES"/*.yaml
  fi
fi

if wanted training-operator; then
  # No --version flag: `-h` exits 0 once every flag (its own and controller-runtime's) is
  # registered, which proves the binary starts.
  # The mark says the binary's webhook server listens on 127.0.0.1 (loopback_webhook_overlay):
  # a binary cached before it is rebuilt.
  if check_bin "$TRAINING_OPERATOR_BIN" -h && [[ -f "$TRAINING_OPERATOR_MANIFESTS/webhook.yaml" ]] \
      && [[ -f "$TRAINING_OPERATOR_BIN.webhook-loopback" ]]; then
    log "training-operator $TRAINING_OPERATOR_VERSION: cached"
  else
    timed training-operator "$TRAINING_OPERATOR_VERSION" build_module training-operator \
      github.com/kubeflow/training-operator "$TRAINING_OPERATOR_VERSION" \
      github.com/kubeflow/training-operator/cmd/training-operator.v1 "$TRAINING_OPERATOR_BIN" \
      "" cmd/training-operator.v1/main.go
    touch "$TRAINING_OPERATOR_BIN.webhook-loopback"
    check_bin "$TRAINING_OPERATOR_BIN" -h || die "built $TRAINING_OPERATOR_BIN but '$TRAINING_OPERATOR_BIN -h' fails: $("$TRAINING_OPERATOR_BIN" -h 2>&1 | tail -n 5 || true)"
    # The real CRDs and validating webhook, from the same module: the tests install them as
    # the operator's manifests do.
    src="$(module_dir github.com/kubeflow/training-operator "$TRAINING_OPERATOR_VERSION")"
    [[ -d "$src/manifests/base/crds" && -f "$src/manifests/base/webhook/manifests.yaml" ]] \
      || die "no manifests/base/crds or manifests/base/webhook/manifests.yaml in $src"
    mkdir -p "$TRAINING_OPERATOR_MANIFESTS"
    cp "$src"/manifests/base/crds/kubeflow.org_*.yaml "$TRAINING_OPERATOR_MANIFESTS/"
    cp "$src/manifests/base/webhook/manifests.yaml" "$TRAINING_OPERATOR_MANIFESTS/webhook.yaml"
    chmod u+w "$TRAINING_OPERATOR_MANIFESTS"/*.yaml
  fi
fi

# JobSet's controller and Kubeflow Trainer v2's (a TrainJob runs as a JobSet); trainer after
# jobset: the same k8s and controller-runtime packages, in the Go build cache by then.
# copy_manifests DEST SRC-DIR RELATIVE-PATH...: a module's manifests, for the tests to apply.
copy_manifests() {
  local dest="$1" src="$2"; shift 2
  mkdir -p "$dest"
  local f
  for f in "$@"; do
    [[ -f "$src/$f" ]] || die "no $f in $src"
    cp "$src/$f" "$dest/$(echo "$f" | tr / _)"
  done
  chmod u+w "$dest"/*.yaml
}
if wanted jobset; then
  if check_bin "$JOBSET_BIN" -h && [[ -f "$JOBSET_MANIFESTS/config_components_webhook_manifests.yaml" ]]; then
    log "jobset $JOBSET_VERSION: cached"
  else
    timed jobset "$JOBSET_VERSION" build_module jobset sigs.k8s.io/jobset "$JOBSET_VERSION" \
      sigs.k8s.io/jobset "$JOBSET_BIN"
    check_bin "$JOBSET_BIN" -h || die "built $JOBSET_BIN but '$JOBSET_BIN -h' fails"
    copy_manifests "$JOBSET_MANIFESTS" "$(module_dir sigs.k8s.io/jobset "$JOBSET_VERSION")" \
      config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml \
      config/components/webhook/manifests.yaml
  fi
fi
if wanted trainer; then
  if check_bin "$TRAINER_BIN" -h && [[ -f "$TRAINER_MANIFESTS/podgroups.yaml" ]] \
      && [[ -f "$TRAINER_BIN.webhook-loopback" ]]; then
    log "trainer $TRAINER_VERSION: cached"
  else
    timed trainer "$TRAINER_VERSION" build_module trainer github.com/kubeflow/trainer/v2 \
      "$TRAINER_VERSION" github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager \
      "$TRAINER_BIN" "" cmd/trainer-controller-manager/main.go
    touch "$TRAINER_BIN.webhook-loopback"
    check_bin "$TRAINER_BIN" -h || die "built $TRAINER_BIN but '$TRAINER_BIN -h' fails"
    src="$(module_dir github.com/kubeflow/trainer/v2 "$TRAINER_VERSION")"
    copy_manifests "$TRAINER_MANIFESTS" "$src" \
      manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml \
      manifests/base/crds/trainer.kubeflow.org_trainingruntimes.yaml \
      manifests/base/crds/trainer.kubeflow.org_clustertrainingruntimes.yaml \
      manifests/base/webhook/manifests.yaml manifests/base/runtimes/torch_distributed.yaml
    # Its coscheduling plugin watches scheduler-plugins' PodGroups: their CRD, from the
    # version its go.mod requires.
    plugins="$(sed -n 's|^[[:space:]]*sigs.k8s.io/scheduler-plugins \(v[^[:space:]]*\).*|\1|p' "$src/go.mod")"
    [[ -n "$plugins" ]] || die "no sigs.k8s.io/scheduler-plugins in $src/go.mod"
    cp "$(module_dir sigs.k8s.io/scheduler-plugins "$plugins")/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml" \
      "$TRAINER_MANIFESTS/podgroups.yaml"
    chmod u+w "$TRAINER_MANIFESTS/podgroups.yaml"
  fi
fi

# show NAME BIN VERSION-ARGS...: one line per binary in the cache.
show() {
  local name="$1" bin="$2"; shift 2
  [[ -x "$bin" ]] || { log "$(printf '%-24s' "$name:") (not built)"; return 0; }
  log "$(printf '%-24s' "$name:") $bin ($("$bin" "$@" 2>/dev/null | head -n1))"
}
show etcd "$ETCD_BIN" --version
show kube-apiserver "$APISERVER_BIN" --version
show kube-controller-manager "$KCM_BIN" --version
show helm "$HELM_BIN" version --short
show kube-scheduler "$SCHEDULER_BIN" --version
show kwok "$KWOK_BIN" --version
# (no version flag: the module version it was built from)
[[ -x "$TRAINING_OPERATOR_BIN" ]] \
  && log "$(printf '%-24s' training-operator:) $TRAINING_OPERATOR_BIN ($TRAINING_OPERATOR_VERSION)"

# Every binary in the cache (built now or before); a test skips, with the reason, when the
# variable it needs is unset.
emit() {  # emit VARIABLE PATH
  [[ -e "$2" ]] || return 0
  if [[ "$PRINT_ENV" == 1 ]]; then printf 'export %s=%q\n' "$1" "$2"; else echo "$1=$2"; fi
}
emit PERSEUS_ETCD_BIN "$ETCD_BIN"
emit PERSEUS_KUBE_APISERVER_BIN "$APISERVER_BIN"
emit PERSEUS_KUBE_CONTROLLER_MANAGER_BIN "$KCM_BIN"
emit PERSEUS_HELM_BIN "$HELM_BIN"
emit PERSEUS_KUBE_SCHEDULER_BIN "$SCHEDULER_BIN"
emit PERSEUS_KWOK_BIN "$KWOK_BIN"
emit PERSEUS_KWOK_STAGES "$KWOK_STAGES"
emit PERSEUS_TRAINING_OPERATOR_BIN "$TRAINING_OPERATOR_BIN"
emit PERSEUS_TRAINING_OPERATOR_MANIFESTS "$TRAINING_OPERATOR_MANIFESTS"
emit PERSEUS_JOBSET_BIN "$JOBSET_BIN"
emit PERSEUS_JOBSET_MANIFESTS "$JOBSET_MANIFESTS"
emit PERSEUS_TRAINER_BIN "$TRAINER_BIN"
emit PERSEUS_TRAINER_MANIFESTS "$TRAINER_MANIFESTS"
