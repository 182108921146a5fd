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

# The main job: Specter beside SpecMoEOff, LRU and resident on the default small model, then
# their table (conf/experiment/quickstart.yaml; ARGS adds run.py overrides, e.g.
# ARGS="hardware=a100_pcie4_ideal" or ARGS="model=small_phi").
MAIN_OUT ?= results/main_job
run: .venv/.installed
	$(PY) run.py -m experiment=quickstart out_dir=$(MAIN_OUT) $(ARGS)
	$(PY) -m experiments.summarize $(MAIN_OUT) --short
	$(PY) -m experiments.plots $(MAIN_OUT) --out $(MAIN_OUT)/figures --only quickstart_tpot

test: .venv/.installed
	$(PY) -m pytest -q $(ARGS)

gpu-check: .venv/.installed
	bash scripts/gpu_check.sh

clean-venv:
	rm -rf .venv
