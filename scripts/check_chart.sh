#!/usr/bin/env bash
# Judge helm/perseus with tools nobody here wrote (`make check-chart`):
#
#   helm lint --strict            the helm CLI of the test control plane build
#                                 (scripts/build_test_control_plane.sh --only helm)
#   kubeconform -strict           Kubernetes 1.30, 1.33, 1.37 (schemas offline, from PyPI's
#                                 kubernetes-validate; our CRDs' schemas converted from crds/)
#   kube-score score              every rendered object
#   checkov                       every rendered object (kubernetes), and the Dockerfile
#   promtool check rules          the PrometheusRule's groups (--lint=all)
#
# each on the chart rendered with every helm/perseus/ci/*-values.yaml. Tools are installed on
# first use from the Go proxy and PyPI into ~/.cache/perseus-k8s/check-chart (keyed by version)
# and reused after. promtool is Debian's (package prometheus, as .ci/run installs it).
# Findings the chart keeps on purpose are skipped here by check ID, each with its reason in
# helm/perseus/README.md ("What the checkers say"); any other finding fails the script.
#
# Environment: PYTHON (default .venv/bin/python), PERSEUS_K8S_CACHE, GO,
# CHECK_CHART_NO_BUILD=1: use the helm CLI only if already built, else helm-python-sdk's lint
# (the same engine; strict) and say so.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
CACHE="${PERSEUS_K8S_CACHE:-$HOME/.cache/perseus-k8s}"
TOOLS="$CACHE/check-chart"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
KUBECONFORM_VERSION=v0.8.0
KUBE_SCORE_VERSION=v1.20.0
CHECKOV_VERSION=3.3.30
K8S_VERSIONS="1.30.0 1.33.0 1.37.0"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
failed=0
say() { printf '[check_chart] %s\n' "$*" >&2; }
step() { local name="$1"; shift; local t0=$SECONDS; if "$@"; then say "$name: ok ($((SECONDS - t0)) s)"; else say "$name: FAILED"; failed=1; fi; }

go_tool() {  # name module version -> path of the binary, built once
  local bin="$TOOLS/$1-$3/$1"
  if [[ ! -x "$bin" ]]; then
    say "installing $2@$3 (Go proxy)"
    mkdir -p "$(dirname "$bin")"
    GOBIN="$(dirname "$bin")" CGO_ENABLED=0 GOFLAGS=-buildvcs=false nice "$GO" install "$2@$3" >&2
  fi
  echo "$bin"
}

checkov_bin() {
  local venv="$TOOLS/checkov-$CHECKOV_VERSION"
  if [[ ! -x "$venv/bin/checkov" ]]; then
    say "installing checkov==$CHECKOV_VERSION (PyPI)"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "checkov==$CHECKOV_VERSION" >&2
  fi
  echo "$venv/bin/checkov"
}

# --- render: one file per ci values file, CRDs included (as helm install applies them) ---
"$PYTHON" - "$OUT" <<'EOF'
import json, pathlib, sys, yaml
sys.path.insert(0, "tests")
from support.helm_render import CHART, crds, render
out = pathlib.Path(sys.argv[1])
for values_file in sorted((CHART / "ci").glob("*-values.yaml")):
    name = values_file.name.removesuffix("-values.yaml")
    rendered = render(yaml.safe_load(values_file.read_text()) or {})
    docs = [*crds(), *rendered.objects]
    (out / f"{name}.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
    rules = [o for o in rendered.objects if o["kind"] == "PrometheusRule"]
    if rules:
        groups = [g for r in rules for g in r["spec"]["groups"]]
        (out / "rules").mkdir(exist_ok=True)
        (out / "rules" / f"{name}.yaml").write_text(yaml.safe_dump({"groups": groups}))
EOF
say "rendered: $(cd "$OUT" && ls | tr '\n' ' ')"

# --- helm lint --strict ---
helm_lint() {
  local helm=""
  if [[ "${CHECK_CHART_NO_BUILD:-}" == 1 ]]; then
    helm="$(scripts/build_test_control_plane.sh --env --only '' 2>/dev/null | sed -n 's/^export PERSEUS_HELM_BIN=//p')"
  else
    helm="$(scripts/build_test_control_plane.sh --env --only helm | sed -n 's/^export PERSEUS_HELM_BIN=//p')"
  fi
  local ok=0
  for values in helm/perseus/ci/*-values.yaml; do
    if [[ -n "$helm" ]]; then
      "$helm" lint --strict helm/perseus -f "$values" --kube-version 1.30.0 || ok=1
    else
      "$PYTHON" - "$values" <<'EOF' || ok=1
import sys, yaml, helm_python
report = helm_python.lint("helm/perseus", yaml.safe_load(open(sys.argv[1])) or {}, strict=True,
                          kube_version="1.30.0")
for m in report.get("messages", []):
    print(f"{m['severity']}: {m['path']}: {m['error']}")
sys.exit(1 if report.get("errors") or report.get("messages") else 0)
EOF
    fi
  done
  [[ -n "$helm" ]] || say "helm lint: the helm CLI is not built yet; used helm-python-sdk's lint (strict)"
  return $ok
}
step "helm lint --strict" helm_lint

# --- kubeconform: schemas offline ---
kubeconform_check() {
  local kc schemas
  kc="$(go_tool kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION")"
  schemas="$TOOLS/schemas-v2"
  "$PYTHON" - "$schemas" $K8S_VERSIONS <<'EOF'
import json, os, pathlib, sys, yaml
import kubernetes_validate
src = pathlib.Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
dest = pathlib.Path(sys.argv[1])
for version in sys.argv[2:]:
    target = dest / f"v{version}-standalone-strict"
    if (target / ".done").exists():
        continue
    target.mkdir(parents=True, exist_ok=True)
    for f in (src / f"v{version}-local-strict").glob("*.json"):
        # kubernetes-validate's $refs point at /api/_definitions.json: make them file URLs
        # (kubeconform resolves no relative reference against that file's own $id).
        url = (target / "_definitions.json").resolve().as_uri()
        text = f.read_text().replace('"/api/_definitions.json#', f'"{url}#')
        (target / f.name).write_text(text)
    (target / ".done").write_text("")
# Our CRDs' openAPIV3Schema, as kubeconform names them: {kind}-{group's first part}-{version}.
crd_dir = dest / "crds"
crd_dir.mkdir(parents=True, exist_ok=True)
for path in sorted(pathlib.Path("crds").glob("*.yaml")):
    crd = yaml.safe_load(path.read_text())
    group = crd["spec"]["group"].split(".")[0]
    for v in crd["spec"]["versions"]:
        schema = dict(v["schema"]["openAPIV3Schema"])
        schema["properties"] = {**schema.get("properties", {}),
                                "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                "metadata": {"type": "object"}}
        name = f"{crd['spec']['names']['kind'].lower()}-{group}-{v['name']}.json"
        (crd_dir / name).write_text(json.dumps(schema))
EOF
  local ok=0 version
  for version in $K8S_VERSIONS; do
    # Prometheus Operator's schemas are not served from a registry here: its kinds are
    # skipped (their fields are checked by tests/integration/test_helm_chart*.py).
    "$kc" -strict -summary -output text \
      -kubernetes-version "$version" \
      -schema-location "$schemas/{{ .NormalizedKubernetesVersion }}-standalone-strict/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
      -schema-location "$schemas/crds/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
      -skip ServiceMonitor,PodMonitor,PrometheusRule \
      "$OUT"/*.yaml || ok=1
  done
  return $ok
}
step "kubeconform (Kubernetes $K8S_VERSIONS)" kubeconform_check

# --- kube-score ---
KUBE_SCORE_IGNORE=(
  # Each is explained in helm/perseus/README.md, "What the checkers say".
  --ignore-test container-image-pull-policy         # IfNotPresent with versioned tags
  --ignore-test container-ephemeral-storage-request-and-limit  # emptyDirs with sizeLimit
  --ignore-test container-cpu-limit                 # the agent and the one-shot hook pods
  --ignore-container-cpu-limit
  --ignore-test container-security-context-user-group-id  # the agent runs as root (NVML)
  --ignore-test pod-networkpolicy                   # networkPolicy.enabled is opt-in
  --ignore-test pod-probes-identical                # the agent: one /healthz
)
kube_score_check() {
  local ks
  ks="$(go_tool kube-score github.com/zegl/kube-score/cmd/kube-score "$KUBE_SCORE_VERSION")"
  "$ks" score --output-format ci --exit-one-on-warning "${KUBE_SCORE_IGNORE[@]}" \
    "$OUT"/*.yaml >"$OUT/kube-score.txt" 2>&1 && return 0
  grep -vE '^\[(OK|SKIPPED)\]' "$OUT/kube-score.txt"
  return 1
}
step "kube-score" kube_score_check

# --- checkov ---
CHECKOV_SKIP=(
  # Each is explained in helm/perseus/README.md, "What the checkers say"; only those the
  # ci values raise, so that a new finding fails.
  CKV_K8S_19   # hostNetwork: the agent with agent.tcp (training pods reach it on the node)
  CKV_K8S_23   # root: the agent (NVML locks clocks only for root)
  CKV_K8S_40   # high UID: same
  CKV_K8S_25   # added capability: the agent's SYS_ADMIN (NVML)
  CKV_K8S_39   # SYS_ADMIN: same
  CKV_K8S_15   # pull policy Always: IfNotPresent with versioned tags
  CKV_K8S_43   # image digest: optional (image.digest)
  CKV_K8S_11   # CPU limit: none on the agent and the one-shot hook pods
  CKV_K8S_38   # service account token: every pod calls the API
  CKV2_K8S_6   # NetworkPolicy per pod: networkPolicy.enabled is opt-in
  CKV_K8S_8    # liveness probe: the hook and test pods run once, seconds
  CKV_K8S_9    # readiness probe: same
)
checkov_check() {
  local ck skip
  ck="$(checkov_bin)"
  skip="$(IFS=,; echo "${CHECKOV_SKIP[*]}")"
  BC_SKIP_MAPPING=TRUE "$ck" --quiet --compact --framework kubernetes -d "$OUT" --skip-path rules \
    --skip-check "$skip" --skip-download
}
step "checkov (kubernetes)" checkov_check

# The images' Dockerfile (built by the repository's top-level Dockerfile, not the chart):
# CKV_DOCKER_2 (HEALTHCHECK): Kubernetes ignores it, the chart's probes do that job;
# CKV_DOCKER_7 (base tag): checkov cannot read the tag of `FROM ${PYTHON_IMAGE}` (an ARG whose
# default, python:3.11-slim-bookworm, is tagged).
checkov_dockerfile() {
  BC_SKIP_MAPPING=TRUE "$(checkov_bin)" --quiet --compact --framework dockerfile -f Dockerfile \
    --skip-check CKV_DOCKER_2,CKV_DOCKER_7 --skip-download
}
step "checkov (Dockerfile)" checkov_dockerfile

# --- promtool ---
promtool_check() {
  if ! command -v promtool >/dev/null; then
    say "promtool not installed (apt-get install prometheus): skipped"
    return 1
  fi
  promtool check rules --lint=all --lint-fatal "$OUT"/rules/*.yaml
}
step "promtool check rules" promtool_check

exit $failed
