# vllm-hopper-decode — thin targets over the one CLI, scripts/hd.py.
#
#   make build-wheel   fetch + verify the pinned vLLM, apply the series + overlay + kernels,
#                      write dist/vllm-<ver>+hd.N-*.whl and verify it
#   make test          every CPU test: tooling, the real pin, upstream's own test allow-list
#   make check         patch lint + export drift + ruff
#
# Everything installs itself: the dev venv (.venv) from ci/requirements-dev.txt, the wheel
# venv (build/venv-wheel) from the built wheel and its dependencies.

PYTHON ?= python3
VENV ?= .venv
WHEEL_VENV ?= build/venv-wheel
PY := $(VENV)/bin/python
HD := $(PY) scripts/hd.py

.PHONY: help venv-dev fetch import apply export lint drift ruff check build-wheel \
	verify-wheel index venv test test-tooling test-real-pin test-runtime test-upstream \
	test-gpu bench gpu-bundle gpu-bundle-kernels pre-commit _need-vllm rebase bump-pin \
	upstream-pr clean distclean

help:
	@sed -n '2,9p' Makefile

# pip install is tried three times: pip does not retry a download cut off midway.
$(VENV)/.installed: ci/requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	for attempt in 1 2 3; do \
	    $(VENV)/bin/pip install -q --disable-pip-version-check -r ci/requirements-dev.txt \
	        && break; \
	    [ $$attempt = 3 ] && exit 1; \
	    echo "pip install failed (attempt $$attempt of 3); trying again in 10 s"; sleep 10; \
	done
	touch $@

venv-dev: $(VENV)/.installed

fetch: venv-dev
	$(HD) fetch

import: venv-dev
	$(HD) import

apply: venv-dev
	$(HD) apply

export: venv-dev
	$(HD) export

lint: venv-dev
	$(HD) lint

drift: venv-dev
	$(HD) export --check

ruff: venv-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

check: lint apply drift ruff

build-wheel: venv-dev
	$(HD) build-wheel

verify-wheel: venv-dev
	$(HD) verify-wheel

index: venv-dev
	$(HD) index

# A fresh venv with the built wheel and its dependencies (torch 2.11.0, ...); reinstalled only
# when the wheel changed. VENV_ARGS: e.g. --min-free-gb=N (the free disk a fresh one needs).
VENV_ARGS ?=
venv: build-wheel
	$(HD) venv --if-stale --path $(WHEEL_VENV) $(VENV_ARGS)

test-tooling: venv-dev
	$(PY) -m pytest tests/tooling -q

test-real-pin: venv apply index
	HD_REQUIRE_REAL_PIN=1 HD_VENV=$(WHEEL_VENV) $(PY) -m pytest tests/test_real_pin.py -q

# decode_backend parsing and the unsupported-deployment reasons against the patched vLLM in
# the wheel venv (CPU; real engine configs, a stand-in H200 platform). Own process: the
# stand-in replaces vLLM's current platform.
test-runtime: venv
	$(WHEEL_VENV)/bin/python -m pytest tests/runtime -q

test-upstream: venv
	$(HD) upstream-tests --python $(WHEEL_VENV)/bin/python --subset cpu

# Kernel and end-to-end decode tests need an SM90 GPU; elsewhere they skip, each with its reason
# (the CuTe DSL compile checks and the small-model config checks run anywhere). They run in the
# wheel venv, which has the pinned torch and nvidia-cutlass-dsl.
test-gpu: venv
	$(WHEEL_VENV)/bin/python -m pytest tests/kernels tests/integration -q -rs

test: test-tooling test-real-pin test-runtime test-upstream test-gpu

# Decode step time inside vLLM, stock vs latency-specialized (needs the H200): writes
# docs/perf/decode.{json,md,png} with the patch-set fingerprint that `make upstream-pr` checks.
bench: venv
	$(WHEEL_VENV)/bin/python scripts/bench_decode.py --out-dir docs/perf $(BENCH_ARGS)

# This workplace's offline H200: the built wheel, vLLM's dependencies and CuTe DSL staged as
# .gpu-bundle/hdN/vllm/part-NN (copy them with PLAN.txt). Parts of 56 MiB: a device call carries
# at most 64 MiB, the part and the working tree (~6 MiB) together; the tool's 60 MiB default
# does not fit.
GPU_BUNDLE_BUILD ?= ../shared/gpu-bundle/build.py
gpu-bundle: build-wheel
	@label=$$(sed -n 's/^local_label = "\(.*\)"$$/\1/p' VERSION); \
	wheel=$$(ls dist/vllm-*+$$label-*.whl) && \
	$(PYTHON) $(GPU_BUNDLE_BUILD) vllm --extra-wheel $$PWD/$$wheel --part-mib 56 \
	    --out .gpu-bundle/$$(echo $$label | tr -d .)

# CuTe DSL alone (2 parts, .gpu-bundle/kernels): enough for tests/kernels and the kernel
# benchmarks, ~2.5 min to build against the vllm bundle's ~5. Same part size, same reason.
gpu-bundle-kernels:
	$(PYTHON) $(GPU_BUNDLE_BUILD) kernels --part-mib 56

# Move to another upstream release in two explicit steps (VLLM=<version>, e.g. 0.33.0):
#   make rebase VLLM=X     fetch + verify X, git am -3 the series onto it (build/upstream branch
#                          rebase/X), import-check the overlay, write reports/rebase-X.md;
#                          REBASE_ARGS=--continue after resolving a conflict, --restart to redo,
#                          --with-tests to also build X's wheel and run the CPU tests against it
#   make bump-pin VLLM=X   only after a complete rebase: VERSION -> X, patches/ from rebase/X
_need-vllm:
	@test -n "$(VLLM)" || { echo "set VLLM=<version>, e.g. make $(MAKECMDGOALS) VLLM=0.33.0" >&2; exit 2; }

rebase: _need-vllm venv-dev
	$(HD) rebase --to $(VLLM) $(REBASE_ARGS)

bump-pin: _need-vllm venv-dev
	$(HD) bump-pin --to $(VLLM) $(BUMP_ARGS)

# The patch set as one upstream PR: branch upstream-pr/<version> in build/upstream, the patch
# file and vLLM's lint in build/upstream-pr/, the description in reports/upstream-pr.md.
# Needs docs/perf/decode.json measured with the current patch set; UPSTREAM_PR_ARGS=--draft
# writes a draft (build/upstream-pr/upstream-pr-DRAFT.md) that says what is missing instead.
upstream-pr: venv-dev
	$(HD) upstream-pr $(UPSTREAM_PR_ARGS)

pre-commit: venv-dev
	$(VENV)/bin/pre-commit run --all-files

clean:
	rm -rf build dist .pytest_cache .ruff_cache

distclean: clean
	rm -rf .cache $(VENV)
