# Entry points: `make demo` (set up, then run the main job) and `make test` (set up, then run the tests).
# COMFYUI=0.33.0 sets up and uses ComfyUI 0.33.0 (copied from ../shared/comfyui/0.33.0) in an environment of its
# own (.venv-0.33.0) instead of the default 0.3.75 (.venv); CI runs `make test` on both (.ci/run).
# COMFYUI_DIR=/path/to/ComfyUI makes everything use that ComfyUI instead (your own install).
PYTHON ?= python3
COMFYUI ?= 0.3.75
export ACCEL_COMFYUI := $(COMFYUI)
ifeq ($(COMFYUI),0.3.75)
ACCEL_VENV ?= .venv
else
ACCEL_VENV ?= .venv-$(COMFYUI)
endif
export ACCEL_VENV
VENV_PY := $(ACCEL_VENV)/bin/python

.PHONY: setup models demo test test-full bench bench-quick bench-gpu clean

setup:
	$(PYTHON) tools/setup_env.py --models test

models: setup
	$(VENV_PY) tools/make_models.py --set all

demo: setup
	$(VENV_PY) tools/demo.py

test: setup
	$(ACCEL_VENV)/bin/pytest

# `make test` and the full tier: the long tests `make test` skips by name to stay within 18 minutes a ComfyUI
# (tests/conftest.py, docs/contributing.md).
test-full: setup
	ACCEL_TEST_FULL=1 $(ACCEL_VENV)/bin/pytest

# Every scenario side by side in one run: docs/benchmarks/REPORT.md with its charts (full-size models, an hour or
# more on a CPU); bench-quick the same on the small models into bench/results/quick/.
bench: models
	$(VENV_PY) bench/report.py

bench-quick: setup
	$(VENV_PY) tools/make_models.py --set quick
	$(VENV_PY) bench/report.py --quick

# Every check only a GPU can show, in at most 10 minutes: docs/benchmarks/gpu.md. Without a GPU it says so and exits
# 0. `setup` writes the families; bench/gpu.py writes the benchmark Flux when missing (not `models`: the full-size
# SD1.5 UNets and second files it does not use), and only on a GPU machine.
bench-gpu: setup
	$(VENV_PY) bench/gpu.py

clean:
	rm -rf .venv .venv-* .comfyui
