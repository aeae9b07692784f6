# lowmem: the two commands of the README, plus benchmarks. Torch is installed with pip, which takes
# the CPU/CUDA wheels this machine has on disk (uv/poetry would download gigabytes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m ruff check lowmem recipes scripts tests
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check lowmem recipes scripts tests

bench: $(STAMP)
	$(PY) scripts/bench_data.py
	$(PY) scripts/bench_memory.py

clean-venv:
	rm -rf $(VENV)
