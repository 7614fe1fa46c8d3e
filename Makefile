# The two front-door commands (see README): `make demo` and `make test`.
# Each bootstraps a local virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OUT    ?= out/plan

.PHONY: demo test docs reference lint typecheck unit torch frameworks check-chart images bench bench-large bench-agent bench-operator bench-apiserver bench-schedules reproduce clean

# The dependencies the images ship are installed at the images' pins (scripts/image_constraints.py
# writes them): the tests run what ships, and a new upstream release cannot make a fresh
# machine's environment differ from the pins (`make images` checks them). To move a pin:
# `pip install -U NAME` in the venv, then run scripts/image_constraints.py.
$(STAMP): pyproject.toml scripts/image-constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# `make demo` makes its venv without pip when the host's can install into it.
	$(BIN)/python -m pip --version >/dev/null 2>&1 || $(BIN)/python -m ensurepip --default-pip
	# setuptools >= 77 reads the SPDX license field; the packaging test builds the client with
	# the venv's own (no build isolation), and a fresh venv comes with 65.5.
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=77"
	$(BIN)/python -m pip install --quiet -c scripts/image-constraints.txt -e ".[dev]"
	touch $(STAMP)

# torch for the adapter's real-training tests (the `torch` extra), kept out of `dev`: with its
# CUDA runtime wheels it is ~2.8 GB of downloads and 5.3 GB installed. The wheels are kept in a
# wheelhouse under ~/.cache (pip's own HTTP cache stores nothing behind a proxy that sends no
# caching headers, as here), so a fresh venv installs them without downloading: see README.
TORCH_SPEC ?= torch==2.15.0
WHEELHOUSE ?= $(HOME)/.cache/perseus-k8s/wheels/$(subst ==,-,$(TORCH_SPEC))
TORCH_STAMP := $(VENV)/.installed-torch

$(TORCH_STAMP): $(STAMP)
	$(BIN)/python -m pip download --quiet --dest $(WHEELHOUSE) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --no-index --find-links $(WHEELHOUSE) "$(TORCH_SPEC)"
	touch $@

torch: $(TORCH_STAMP)

# DeepSpeed and megatron-core for the framework adapters' tests (the `deepspeed` and `megatron`
# extras), pinned in scripts/frameworks-requirements.txt, installed after torch so that neither
# brings its own. Their wheels (DeepSpeed's built once from its sdist with DS_BUILD_OPS=0, ~30 s)
# are kept in a wheelhouse beside torch's, so a fresh venv installs them without the index.
# DeepSpeed compiles a C++ op (shm_comm, ~90 s) when a job first starts on the CPU: the tests
# keep it under ~/.cache/perseus-k8s/torch_extensions (TORCH_EXTENSIONS_DIR), so CI compiles it
# once per cache.
FRAMEWORKS_REQUIREMENTS := scripts/frameworks-requirements.txt
FRAMEWORKS_WHEELHOUSE ?= $(HOME)/.cache/perseus-k8s/wheels/frameworks
FRAMEWORKS_STAMP := $(VENV)/.installed-frameworks

$(FRAMEWORKS_STAMP): $(TORCH_STAMP) $(FRAMEWORKS_REQUIREMENTS)
	$(BIN)/python -m pip wheel --quiet --no-deps --no-index --find-links $(FRAMEWORKS_WHEELHOUSE) \
	    --wheel-dir $(FRAMEWORKS_WHEELHOUSE) -r $(FRAMEWORKS_REQUIREMENTS) 2>/dev/null \
	  || DS_BUILD_OPS=0 $(BIN)/python -m pip wheel --quiet --no-deps \
	    --wheel-dir $(FRAMEWORKS_WHEELHOUSE) -r $(FRAMEWORKS_REQUIREMENTS)
	$(BIN)/python -m pip install --quiet --no-index --find-links $(FRAMEWORKS_WHEELHOUSE) \
	    --find-links $(WHEELHOUSE) -r $(FRAMEWORKS_REQUIREMENTS)
	touch $@

frameworks: $(FRAMEWORKS_STAMP)

## Main job: plan the bundled GPT-3 175B / A100-SXM profile (8 stages, 24 microbatches).
## A fresh checkout installs only what that needs, quietly (scripts/demo_venv.sh): the
## dependencies and the `demo` extra (numpy, pydantic, scipy; no numba, so the solver runs as
## plain Python, quicker than compiling it once; no matplotlib, the demo draws nothing),
## without building the project: the CLI runs from the source tree. A venv that has the
## development install uses it. Timings: docs/measurements/demo-and-standalone.md.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml scripts/demo_requirements.py scripts/demo_venv.sh
	test -f $(STAMP) || PYTHON=$(PYTHON) scripts/demo_venv.sh $(VENV)
	touch $@

demo: $(DEMO_STAMP)
	PYTHONPATH=operator $(BIN)/python -m perseus_cli.main plan --microbatches 24 --out $(OUT) \
	    --force --no-plot

## Whole test suite: lint (ruff, import contracts), strict typing, unit + reproduction tests.
test: lint typecheck unit

lint: $(STAMP) docs
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHONPATH=operator:node_agent $(BIN)/lint-imports --no-logo  # pyproject: [tool.importlinter]

## The documentation site (docs/, mkdocs.yml), warnings as errors: out/site/index.html.
docs: $(STAMP)
	$(BIN)/mkdocs build --quiet

## The generated reference pages, rewritten from the code: docs/reference/crds.md (the CRDs)
## and docs/reference/metrics.md (the metrics the agent and the operator register). `make test`
## fails while either is stale.
reference: $(STAMP)
	$(BIN)/python -m perseus_api.crd_reference
	$(BIN)/python scripts/metrics_reference.py

typecheck: $(STAMP)
	$(BIN)/mypy

# The end-to-end tests need a kube-apiserver, a kube-controller-manager, an etcd, helm,
# kube-scheduler, KWOK, the training-operator, JobSet and Trainer v2, built from Go modules on
# first use and cached in ~/.cache/perseus-k8s (scripts/control_plane.md). scripts/run_tests.sh
# builds them in the background while tests/unit and tests/integration run, then runs tests/e2e;
# without a Go toolchain those tests skip, saying why (CI sets PERSEUS_REQUIRE_E2E=1: they fail
# instead). The real-torch tests likewise skip without torch (`make torch`), the DeepSpeed and
# Megatron ones without those (`make frameworks`), and fail under
# PERSEUS_REQUIRE_E2E=1 or PERSEUS_REQUIRE_TORCH=1.
unit: $(STAMP) $(TORCH_STAMP) $(FRAMEWORKS_STAMP)
	PYTHON=$(BIN)/python scripts/run_tests.sh

## Container images (operator, node agent) built without a Docker daemon (buildah, installed
## with apt when missing), smoke-tested from their root filesystems, and the check that a docs
## edit changes no dependency layer; base, wheels and layers cached in ~/.cache/perseus-k8s.
## The helm end-to-end test then runs both from these images. docs/operations/images.md.
images: $(STAMP)
	PYTHON=$(BIN)/python scripts/build_images.sh

## Side-by-side benchmark against lowtime 0.3.0 (8 stages x 24 microbatches), then how the
## solve time grows from 24 to 192 microbatches (benchmarks/planner_scale.py). Then the power
## budget allocation, quick form (200 jobs x 200 points; the full 1,000 x 1,000 without --quick),
## and the operator at scale's quick form with its target (20 jobs, ~45 s; benchmarks/README.md).
bench: $(STAMP)
	$(BIN)/python benchmarks/planner_vs_lowtime.py
	$(BIN)/python benchmarks/power_allocation.py --quick
	$(BIN)/python benchmarks/operator_scale.py --ci

## The large cases: A40, 96 microbatches, 0.1 ms (~65,000 frontier points, within 15 s), and
## 16 stages x 128 microbatches (within the planner's 600 s limit, memory reported, checked
## against the old algorithm).
bench-large: $(STAMP)
	$(BIN)/python benchmarks/planner_vs_lowtime.py --large
	$(BIN)/python benchmarks/planner_scale.py --large

## Schedules side by side: 1F1B, interleaved 1F1B (V=2), ZB-H1: savings at T_min (the README
## table), planning time and tracemalloc peak, each beside 1F1B (~1 min).
bench-schedules: $(STAMP)
	$(BIN)/python benchmarks/schedules.py

## Node agent overhead: hook round trip vs a bare NVML call, agent CPU and RSS.
bench-agent: $(STAMP)
	$(BIN)/python benchmarks/agent_overhead.py

## Operator at scale: 200 jobs, 1,000 simulated nodes; reconcile latency, straggler reaction.
bench-operator: $(STAMP)
	$(BIN)/python benchmarks/operator_scale.py

## The API server's side of the agents' reports: real etcd + kube-apiserver of the e2e tests,
## 1,000 nodes at the production cadence, every report vs the agents' dead-band (~6 min; builds
## or reuses etcd and kube-apiserver in ~/.cache/perseus-k8s).
bench-apiserver: $(STAMP)
	eval "$$(scripts/build_test_control_plane.sh --env --only etcd,kube-apiserver)" && \
	  $(BIN)/python benchmarks/apiserver_load.py

## The paper's Figure 7 (1,024 GPUs, one straggler at T'/T = 1.2): ours beside the published
## numbers, and savings vs. T'/T for every method in docs/figure7-savings-vs-straggler.png (~5 min).
reproduce: $(STAMP)
	$(BIN)/python benchmarks/reproduce_figure7.py

clean:
	rm -rf $(VENV) out .mypy_cache .ruff_cache .pytest_cache .import_linter_cache

## The chart judged by third-party tools (helm lint --strict, kubeconform, kube-score, checkov,
## promtool), installed on first use into ~/.cache/perseus-k8s/check-chart.
check-chart: $(STAMP)
	PYTHON=$(BIN)/python scripts/check_chart.sh
