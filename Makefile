# Entry points: `make demo` (set up, then run the main job) and `make test` (set up, then run the tests).
# COMFYUI_DIR=/path/to/ComfyUI makes everything use that ComfyUI instead of the default 0.3.75.
PYTHON ?= python3
ACCEL_VENV ?= .venv
export ACCEL_VENV
VENV_PY := $(ACCEL_VENV)/bin/python

.PHONY: setup models demo test bench clean

setup:
	$(PYTHON) tools/setup_env.py --models test

models: setup
	$(VENV_PY) tools/make_models.py --set all

demo: setup
	$(VENV_PY) tools/demo.py

test: setup
	$(ACCEL_VENV)/bin/pytest

bench: models
	$(VENV_PY) bench/run.py

clean:
	rm -rf .venv .comfyui
