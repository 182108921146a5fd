# Two set-up-and-go targets (README): `make run` (main job, CPU default) and `make test`.
# Both create .venv and install the project from its own files on first use.
PY      := .venv/bin/python
# The CPU build of torch; on a GPU machine use TORCH_SPEC="torch" (or your CUDA build).
TORCH_SPEC ?= torch==2.13.0
ARGS    ?=

.PHONY: run test setup gpu-check clean-venv

.venv/.installed: pyproject.toml Makefile requirements/crosscheck.txt
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps -r requirements/crosscheck.txt
	touch $@

setup: .venv/.installed

run: .venv/.installed
	$(PY) run.py $(ARGS)

test: .venv/.installed
	$(PY) -m pytest -q $(ARGS)

gpu-check: .venv/.installed
	bash scripts/gpu_check.sh

clean-venv:
	rm -rf .venv
