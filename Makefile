# matrixpool developer entry points. `make test` is what CI runs (.ci/run); `make demo` is the
# quick start. Both install what they need on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv binaries engine crds crds-check lint typecheck imports helm-lint unit integration integration-demo integration-engine integration-shared chaos e2e image kind-node-image kind kind-down kind-e2e real-nodes torch peers scale serving goodput test demo clean

venv: $(STAMP)
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The binaries (etcd, kube-*, kubelet, kube-proxy, kwok, helm, CoreDNS, pause), built once into
# ~/.cache/matrixpool (tools/k8s/build.sh; a cold build takes ~12 min on 2 cores).
binaries:
	tools/k8s/build.sh

# The real inference engine of the serving tests and benchmark: llama.cpp's server, built from
# source once into ~/.cache/matrixpool/engine (tools/engine/build.sh; a cold build ~7 min on 2
# cores), linked into the virtualenv's bin, where the process kubelet's pods find it on PATH.
engine: venv
	ln -sfn "$$(tools/engine/build.sh)" $(BIN)/llama-server

crds: venv
	$(BIN)/python -m matrixpool.api.crdgen

crds-check: venv
	$(BIN)/python -m matrixpool.api.crdgen --check

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

imports: venv
	$(BIN)/lint-imports

helm-lint: venv binaries
	"$$(tools/k8s/build.sh)/helm" lint charts/matrixpool --strict

unit: venv
	$(BIN)/pytest tests/unit -q

integration: venv binaries engine
	$(BIN)/pytest tests/integration -q --durations=10

# make test's split of it: the demo's test brings up a control plane of its own (no shared
# cluster), so it runs in the first lane, and so do the experts' test, the preemption choice's
# test and the files that hold no timing (API validation, placement, the CLI and chart: ~4.5
# min), on a control plane of their own session (that lane ends before the real nodes and kind
# do); the rest (autoscaling's SLO, the real engine's SLO, stress, the day-night cycle, status
# within seconds), on the suite's cluster, alone. The real engine's autoscaling test ran in the
# first lane until its SLO step missed beside the real nodes (0.941, 0.836, 0.945 of 0.95).
DEMO_TEST := tests/integration/test_demo.py
ENGINE_TEST := tests/integration/test_experts.py \
  tests/integration/test_preemption_choice.py \
  $(addprefix tests/integration/test_,scheduling.py pod_constraints.py validation.py peers.py \
    sim.py timesharing.py admission.py plugin.py kv_cache.py recovery_limits.py helm.py \
    rendezvous.py locality_wait.py)
integration-demo: venv binaries
	$(BIN)/pytest $(DEMO_TEST) -q --durations=1
integration-engine: venv binaries engine
	$(BIN)/pytest $(ENGINE_TEST) -q --durations=2
integration-shared: venv binaries engine
	$(BIN)/pytest tests/integration -q --durations=10 --ignore=$(DEMO_TEST) $(ENGINE_TEST:%=--ignore=%)

chaos: venv binaries
	$(BIN)/pytest tests/chaos -q --durations=5

checkpoint: venv
	$(BIN)/pytest tests/checkpoint -q --durations=5

# The chart installed by helm, its operator and daemons run by matrixpool sim's process kubelet,
# the sim from .venv-torch: it stands in for the image, which carries torch (torchrun's pods).
e2e: venv binaries
	tools/torch-venv.sh
	$(BIN)/pytest tests/e2e -q --durations=5

# The matrixpool image from Debian packages (mmdebstrap, this machine's apt sources) and the
# project's wheel, no registry; loaded into the running local cluster's real nodes, if any.
# Needs root. The Dockerfile describes the same image for a registry.
image: venv
	archive=$$(tools/image/build.sh matrixpool:dev) && $(BIN)/matrixpool cluster load-image --if-any "$$archive"

# kind with podman (Debian's; installed if missing, and said so), nothing pulled: the node image
# from Debian packages (mmdebstrap), kind's base-image files and the Kubernetes binaries we build
# (tools/kind/node-image.sh; cached by content, ~1.2 GB in podman); `make kind` brings up a
# cluster of KIND_NODES (1 or 2) nodes with its kubeconfig in ~/.cache/matrixpool/kind/
# (tools/kind/cluster.sh), `make kind-down` deletes it and checks nothing of it is left. Root.
KIND_NODES ?= 1
kind-node-image:
	tools/kind/node-image.sh
kind:
	tools/kind/cluster.sh up $(KIND_NODES)
kind-down:
	tools/kind/cluster.sh down
# docs/install-kind.md section B on a 1-node kind cluster (tools/kind/e2e.sh: steps 1-3 with
# this machine's substitutions, 4-11 read from the doc and run as written; it prints which).
# In `test`, after the real nodes, whose image archive it loads into kind. Root.
kind-e2e: binaries
	tools/kind/e2e.sh

# Real nodes (kubelet + containerd + runc), the image and the chart in real containers; root.
real-nodes: venv binaries
	$(BIN)/pytest tests/realnodes -q --durations=5

# The PyTorch trainer and matrixpool_recovery.torch (DCP) against real checkpoint daemons:
# .venv-torch with PyPI's torch 2.15.0 (wheels cached in ~/.cache/matrixpool/wheels), on CPU.
torch: venv
	tools/torch-venv.sh
	.venv-torch/bin/pytest tests/torch -q

# matrixpool beside kube-scheduler's own gang + topology scheduling and Kueue (TAS), one trace on
# one local cluster (benchmarks/peers.py); root (Kueue's certificate path). Not part of `test`.
peers: venv binaries
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python benchmarks/peers.py --json --png docs/img/peers.png

# The whole operator (matrixpool run) at 4 and 32 supernodes of kwok nodes (benchmarks/scale.py):
# cycle p50/p99, operator RSS, API requests/s, node-fault detection and recovery. Not in `test`.
scale: venv binaries
	$(BIN)/python benchmarks/scale.py --json

# One day of load on one InferenceService, sized fixed / by the window / by the autoscaler, and
# the KV-cache pool on shared prefixes (benchmarks/serving.py; simulated time, a few minutes):
serving: venv engine
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python benchmarks/serving.py --json --png docs/img/serving.png

# 54 simulated days of a 16,384-card job in a 165,888-card pool, matrixpool's recovery against
# four baselines (benchmarks/goodput.py; the simulator, no cluster; a few minutes):
goodput: venv
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python benchmarks/goodput.py --json --plot-dir docs/img

# Two lanes, then one suite at a time (2 cores; warm CI ≤ 35 min). Lane 1: the static checks
# and the pure suites (unit, checkpoint, torch; two at a time), then e2e, then the demo's
# integration test, then the real engine's and the experts' (each its own control plane; these
# sims never overlap: their node and pod addresses are the same loopback ones).
# Lane 2, beside it:
# the real nodes, whose suite mostly waits (its trainers step every 0.5–1 s; the machine was
# 55 % idle through it) and asserts no durations, then kind (make kind-e2e: ~2 min warm, plus
# ~4 min for the node image cold); their output is kept in .real-nodes.log and printed whole
# when they end. Then the suites whose recoveries, serving SLO and stress figures
# are timing-sensitive, alone: integration, then chaos (a chaos recovery missed its 30 s when
# it shared the machine with the real nodes' PyTorch job). -O prints each target's output whole.
test:
	$(MAKE) --no-print-directory venv binaries engine
	tools/torch-venv.sh  # once, before the lanes: the image (real nodes) reads its wheels too
	@($(MAKE) --no-print-directory real-nodes && $(MAKE) --no-print-directory kind-e2e) > .real-nodes.log 2>&1 & lane=$$!; \
	$(MAKE) --no-print-directory -j2 -O lint typecheck imports crds-check helm-lint unit checkpoint torch \
	  && $(MAKE) --no-print-directory e2e && $(MAKE) --no-print-directory integration-demo \
	  && $(MAKE) --no-print-directory integration-engine; first=$$?; \
	wait $$lane; second=$$?; \
	echo "---- make real-nodes, then make kind-e2e (beside the first lane) ----"; cat .real-nodes.log; \
	echo "---- first lane: exit $$first; real nodes and kind: exit $$second ----"; \
	[ $$first -eq 0 ] && [ $$second -eq 0 ]
	$(MAKE) --no-print-directory integration-shared
	$(MAKE) --no-print-directory chaos

demo: venv binaries
	$(BIN)/matrixpool demo

clean:
	-$(BIN)/matrixpool cluster down
	rm -rf $(VENV) .venv-torch .mypy_cache .ruff_cache .pytest_cache
