#!/usr/bin/env bash
# Build the operator and node agent images without a Docker daemon (buildah), smoke-test them,
# check that a docs edit changes no dependency layer, and leave each image's root filesystem
# mounted for the end-to-end tests. docs/operations/images.md says what, why and how to publish.
#
#   scripts/build_images.sh                 # build, check, smoke-test (make images)
#   scripts/build_images.sh --no-checks     # build only
#
# Base image: docker.io/library/python:3.11-slim-bookworm pinned by the digest the registry
# serves when a registry is reachable; otherwise a Debian bookworm root filesystem made with
# debootstrap (Python 3.11, the same Debian release), built once and cached. The dependencies'
# wheels are downloaded on the host into a cached wheelhouse (the host's pip and CA bundle), so
# nothing inside the build needs the network.
#
# Environment:
#   PERSEUS_K8S_CACHE   cache directory (default ~/.cache/perseus-k8s): base root filesystem,
#                       wheelhouse, buildah's storage, the images' records (images/*.json)
#   PYTHON_IMAGE        base image (fully qualified; skips the registry probe and bootstrap)
#   IMAGE_REPOSITORY    name prefix of the images (default localhost/perseus-k8s)
#   IMAGE_TAG           tag (default: the chart's appVersion)
#   STORAGE_DRIVER      overlay (default when the kernel allows) or vfs
#   DEBIAN_MIRROR       debootstrap's mirror (default: the first one apt uses)
#   PYTHON              the host's Python 3.11 for pip and the checks (default: .venv's, else
#                       python3)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

CHECKS=1
for arg in "$@"; do
  case $arg in
    --no-checks) CHECKS=0 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done

CACHE=${PERSEUS_K8S_CACHE:-$HOME/.cache/perseus-k8s}
PREFIX=${IMAGE_REPOSITORY:-localhost/perseus-k8s}
TAG=${IMAGE_TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' helm/perseus/Chart.yaml)}
OFFICIAL_BASE=docker.io/library/python:3.11-slim-bookworm
BOOTSTRAP_BASE=localhost/perseus-k8s/debian-python:3.11-bookworm
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$CACHE/logs" "$CACHE/images"
TIMES="$CACHE/logs/image-times.log"
started=$SECONDS
step() { echo "== $* ($((SECONDS - started)) s)" >&2; }

# -- tools ------------------------------------------------------------------------------------
need=()
command -v buildah >/dev/null || need+=(buildah)
command -v skopeo >/dev/null || need+=(skopeo)
command -v unshare >/dev/null || need+=(util-linux)
if ((${#need[@]})); then
  step "installing ${need[*]} (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

# -- storage: buildah's own, under the cache (kept between CI runs) ---------------------------
# buildah reads the driver from storage.conf only (it ignores STORAGE_DRIVER's usual meaning);
# overlay is ~3x faster than vfs where the kernel allows it.
driver=${STORAGE_DRIVER:-}
if [[ -z $driver ]]; then
  driver=vfs
  if grep -qw overlay /proc/filesystems 2>/dev/null || modprobe overlay 2>/dev/null; then
    driver=overlay
  fi
fi
export CONTAINERS_STORAGE_CONF="$CACHE/containers/storage-$driver.conf"
mkdir -p "$CACHE/containers"
cat >"$CONTAINERS_STORAGE_CONF" <<EOF
[storage]
driver = "$driver"
graphroot = "$CACHE/containers/storage-$driver"
runroot = "${XDG_RUNTIME_DIR:-/run}/perseus-k8s-containers-$(echo "$CACHE" | sha256sum | cut -c1-8)-$driver"
EOF
# crun fails on cgroups in hybrid mode here; chroot isolation needs no runtime at all.
export BUILDAH_ISOLATION=chroot

# -- base image -------------------------------------------------------------------------------
base_digest() { buildah images --no-trunc --format '{{.Digest}}' "$1" | head -n1; }

bootstrap_base() {
  local tarball="$CACHE/images/debian-bookworm-python3.11-rootfs.tar"
  if ! buildah images --quiet "$BOOTSTRAP_BASE" >/dev/null 2>&1; then
    if [[ ! -s $tarball ]]; then
      command -v debootstrap >/dev/null || {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >&2
      }
      # The Debian archive apt uses (not a third-party repository, not the security one).
      local mirror=${DEBIAN_MIRROR:-$(
        grep -rhoE '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
          awk '{print $2}' | grep -E '/debian/?$' | head -n1
      )}
      local rootfs
      rootfs=$(mktemp -d "$CACHE/images/rootfs.XXXXXX")
      step "bootstrapping a Debian bookworm base from ${mirror:-deb.debian.org} (once, ~3 min)"
      debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$CACHE/logs/debootstrap.log" 2>&1 || {
        tail -n 20 "$CACHE/logs/debootstrap.log" >&2
        rm -rf "$rootfs"
        exit 1
      }
      # A base image's own conventions: pip may install (into the venvs only, here), no apt
      # caches or logs, python3 also as python.
      rm -f "$rootfs"/usr/lib/python3.11/EXTERNALLY-MANAGED
      ln -sf python3 "$rootfs/usr/bin/python"
      rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*
      tar -C "$rootfs" --numeric-owner --sort=name -cf "$tarball.tmp" .
      mv "$tarball.tmp" "$tarball"
      rm -rf "$rootfs"
    fi
    step "importing the bootstrap base as $BOOTSTRAP_BASE"
    local ctr
    ctr=$(buildah from --pull=never scratch)
    buildah add --quiet "$ctr" "$tarball" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env LANG=C.UTF-8 --cmd python3 "$ctr"
    buildah commit --quiet --timestamp 0 "$ctr" "$BOOTSTRAP_BASE" >/dev/null
    buildah rm "$ctr" >/dev/null
  fi
  echo "$BOOTSTRAP_BASE"
}

if [[ -n ${PYTHON_IMAGE:-} ]]; then
  base=$PYTHON_IMAGE
  buildah images --quiet "$base" >/dev/null 2>&1 || buildah pull --quiet "$base" >/dev/null
elif digest=$(timeout 60 skopeo inspect --format '{{.Digest}}' "docker://$OFFICIAL_BASE" 2>/dev/null); then
  base="$OFFICIAL_BASE@$digest"
  step "base: $base (from the registry)"
  buildah images --quiet "$base" >/dev/null 2>&1 || buildah pull --quiet "$base" >/dev/null
else
  step "no registry reachable: the base is a Debian bootstrap"
  base=$(bootstrap_base)
fi
digest=$(base_digest "$base")
case $base in *@sha256:*) pinned=$base ;; *) pinned="${base%%@*}@$digest" ;; esac
step "base pinned: $pinned"
base_done=$SECONDS

# -- wheelhouse: the pinned wheels, downloaded on the host ------------------------------------
pins=(scripts/image-constraints-tools.txt scripts/image-constraints-operator.txt
  scripts/image-constraints-agent.txt)
"$PYTHON" scripts/image_constraints.py --check >&2 || {
  echo "the pins are stale: run $PYTHON scripts/image_constraints.py" >&2
  exit 1
}
arch=$(uname -m)
key=$(cat "${pins[@]}" | sha256sum | cut -c1-16)
wheels="$CACHE/image-wheels/$arch-$key"
if [[ ! -f $wheels/.complete ]]; then
  step "downloading the pinned wheels into $wheels"
  rm -rf "$wheels" && mkdir -p "$wheels"
  # Bookworm's glibc (2.36) and CPython 3.11, whatever the host runs (pip does not widen an
  # explicit platform to the older glibc versions: each is named).
  platforms=()
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
    "${platforms[@]}" --platform "manylinux2014_$arch" --platform any \
    --dest "$wheels" "${pins[@]/#/-r}"
  touch "$wheels/.complete"
fi
wheelhouse="localhost/perseus-k8s/wheelhouse:$arch-$key"
if ! buildah images --quiet "$wheelhouse" >/dev/null 2>&1; then
  ctr=$(buildah from --pull=never scratch)
  buildah copy --quiet "$ctr" "$wheels" /wheels >/dev/null
  buildah commit --quiet --timestamp 0 "$ctr" "$wheelhouse" >/dev/null
  buildah rm "$ctr" >/dev/null
fi
wheels_done=$SECONDS

# -- the two images ---------------------------------------------------------------------------
epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- 2>/dev/null || revision="$revision-dirty"
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
build() { # TARGET NAME [CONTEXT]
  local target=$1 name=$2 context=${3:-$REPO}
  # Layers dated 1970 whatever the commit, so that a new commit with the same pins gives the
  # same dependency layers (the commit's date goes into the created label).
  buildah build --quiet --layers --pull=never --timestamp 0 --target "$target" \
    --build-arg "PYTHON_IMAGE=$pinned" --build-arg "BASE_DIGEST=$digest" \
    --build-arg "WHEELHOUSE=$wheelhouse" --build-arg "REVISION=$revision" \
    --build-arg "CREATED=$created" --build-arg "VERSION=$TAG" \
    --file "$REPO/Dockerfile" --tag "$name" "$context" >/dev/null
}
# RUN --mount=...,from=<image> leaves a working container behind (buildah 1.28): remove them.
cleanup_mount_containers() {
  buildah containers --format '{{.ContainerName}}' | grep -E -- '-working-container(-[0-9]+)?$' |
    xargs -r buildah rm >/dev/null || true
}
declare -A IMAGES=([operator]="$PREFIX/perseus-operator:$TAG" [node-agent]="$PREFIX/perseus-node-agent:$TAG")
for target in operator node-agent; do
  t0=$SECONDS
  step "building ${IMAGES[$target]}"
  build "$target" "${IMAGES[$target]}"
  echo "$(date -u +%FT%TZ) build $target $((SECONDS - t0)) s driver=$driver base=$base" >>"$TIMES"
done
cleanup_mount_containers
built=$SECONDS

# -- records for the tests: image, id, root filesystem (mounted), entrypoint, user, env --------
for target in operator node-agent; do
  image=${IMAGES[$target]}
  ctr="perseus-k8s-rootfs-$target"
  buildah rm "$ctr" >/dev/null 2>&1 || true
  buildah from --quiet --pull=never --name "$ctr" "$image" >/dev/null
  rootfs=$(buildah mount "$ctr")
  buildah inspect --type image "$image" |
    "$PYTHON" scripts/image_run.py record --image "$image" --rootfs "$rootfs" \
      --storage-conf "$CONTAINERS_STORAGE_CONF" >"$CACHE/images/$target.json"
  size=$(buildah images --format '{{.Size}}' "$image" | head -n1)
  step "$image: $size, root filesystem at $rootfs ($CACHE/images/$target.json)"
done

# -- checks -----------------------------------------------------------------------------------
if ((CHECKS)); then
  step "smoke tests (read-only root, the image's entrypoint, user and environment)"
  "$PYTHON" scripts/image_smoke.py "$CACHE/images/operator.json" "$CACHE/images/node-agent.json"
  smoked=$SECONDS
  step "a docs edit changes no dependency layer"
  edited=$(mktemp -d)
  trap 'rm -rf "$edited"' EXIT
  # The build context as the Dockerfile sees it, with the README and a source file edited.
  git ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md operator \
    node_agent scripts docs .dockerignore | tar --null -T - --ignore-failed-read -cf - 2>/dev/null |
    tar -C "$edited" -xf -
  echo "An edit of the documentation." >>"$edited/README.md"
  mkdir -p "$edited/docs" && echo "An edit of the documentation." >>"$edited/docs/index.md"
  for target in operator node-agent; do
    build "$target" "${IMAGES[$target]}-docs-edit" "$edited"
    buildah inspect --type image "${IMAGES[$target]}" >"$edited/before.json"
    buildah inspect --type image "${IMAGES[$target]}-docs-edit" >"$edited/after.json"
    "$PYTHON" scripts/image_layers.py "$edited/before.json" "$edited/after.json" "$target"
    buildah rmi "${IMAGES[$target]}-docs-edit" >/dev/null
  done
  cleanup_mount_containers
  echo "$(date -u +%FT%TZ) checks smoke $((smoked - built)) s, layers $((SECONDS - smoked)) s" >>"$TIMES"
fi
echo "$(date -u +%FT%TZ) total $((SECONDS - started)) s (base $((base_done - started)) s, wheels $((wheels_done - base_done)) s, builds $((built - wheels_done)) s) driver=$driver" >>"$TIMES"
step "done: ${IMAGES[operator]} ${IMAGES[node-agent]}"
