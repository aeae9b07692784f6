# lowmem: the two commands of the README, plus benchmarks. Torch is installed with pip, which takes
# the CPU/CUDA wheels this machine has on disk (uv/poetry would download gigabytes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-translation test test-all test-slow lint bench bench-accuracy bench-compress-accuracy bench-fsdp gpu-check gpu-report fairseq docs clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,models]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

demo-translation: $(STAMP)
	$(PY) scripts/demo_translation.py

# The tests in TEST_JOBS processes (pytest-xdist), one thread each on a 2-core machine (tests/conftest.py):
# most tests are bound by Python, not arithmetic, so one process at a time leaves a core idle.
# `make test` (what CI runs) leaves out the tests marked slow: the longest cases of capabilities it
# covers with a shorter one (more models, ranks, parameters); `make test-all` runs every test.
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist worksteal
test: $(STAMP)
	$(PY) -m ruff check lowmem recipes scripts tests
	$(PYTEST) -m "not slow"

test-all: $(STAMP)
	$(PY) -m ruff check lowmem recipes scripts tests
	$(PYTEST)

test-slow: $(STAMP)
	$(PYTEST) -m slow

lint: $(STAMP)
	$(PY) -m ruff check lowmem recipes scripts tests

# Every recipe x precision x technique for a few steps on the GPU, a killed-and-resumed run, and the
# Table 3/4 profiles against the CPU accounting: one PASS/FAIL line each (without CUDA: says so, exit 0).
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py

# The first thing to run on a GPU: gpu-check, the memory/speed benchmark (default and capped workspaces)
# and the demo, written to docs/measurements/<date>-<device>.md (OUT=path elsewhere; TINY=1: toy shapes,
# what a CPU-only machine runs). On a machine without the venv: make gpu-report PY=python3.
# OUT only from the command line: the GPU machine's own $OUT (an output folder) is not a report path.
REPORT_OUT := $(if $(filter command line,$(origin OUT)),$(OUT))
gpu-report: $(if $(filter command line,$(origin PY)),,$(STAMP))
	$(PY) scripts/gpu_report.py $(if $(filter-out 0,$(TINY)),--tiny) $(if $(REPORT_OUT),--out "$(REPORT_OUT)") \
		--command "make gpu-report$(if $(TINY), TINY=$(TINY))$(if $(REPORT_OUT), OUT=$(REPORT_OUT))"

bench: $(STAMP)
	$(PY) scripts/bench_data.py
	$(PY) scripts/bench_evaluation.py
	$(PY) scripts/bench_memory.py
	$(PY) scripts/step_breakdown.py
	$(PY) scripts/table4_memory.py
	$(PY) scripts/optimal_curve.py
	$(PY) scripts/bench_your_model.py
	$(PY) scripts/bench_side_outputs.py
	$(PY) scripts/moe_sparse_memory.py
	$(PY) scripts/plan_moe_unet.py
	$(PY) scripts/bench_state_bits.py --part bytes
	$(PY) scripts/bench_state_bits.py --part blocks
	$(PY) scripts/bench_compress.py --part memory
	$(PY) scripts/bench_compress.py --part planner
	$(PY) -c "import torchao" 2>/dev/null || $(PY) -m pip install --quiet torchao==0.18.0  # the usual stack's 8-bit AdamW
	$(PY) scripts/bench_head_loss.py
	OMP_NUM_THREADS=1 $(PY) scripts/bench_cpu_compute_choice.py
	OMP_NUM_THREADS=1 $(PY) scripts/plan_targets.py
	$(PY) scripts/compile_breaks.py
	$(PY) scripts/bench_compile.py
	$(PY) scripts/bench_compile.py --cpu-compute native
	$(PY) scripts/bench_compile.py --models
	$(PY) scripts/bench_compile.py --models --cpu-compute native
	$(PY) scripts/bench_compile.py --optimizer
	$(PY) scripts/bench_compact_layout.py
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) scripts/bench_compile.py --rows 2,3,6,full
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) scripts/bench_compile.py --models

# 8- and 4-bit optimizer state against 16-bit: WRN-28-2 and DynamicConv accuracy over 3 seeds
# (~90 min on 2 CPU cores; resumable: finished runs are kept under outputs/bench_state_bits).
bench-accuracy: $(STAMP)
	$(PY) scripts/bench_state_bits.py --part accuracy --seeds 0 1 2 --json outputs/bench_state_bits/accuracy.json
	$(PY) scripts/bench_chunked_loss_accuracy.py --seeds 0 1 --json outputs/bench_chunked_loss/bleu.json

# Compressed saved activations (checkpointing.compress) against uncompressed: WRN-28-2 BF16 on digits (none,
# 8, 4, 2 bits) and DynamicConv on phrases (none, 8) over 3 seeds (resumable: outputs/bench_compress).
bench-compress-accuracy: $(STAMP)
	$(PY) scripts/bench_compress.py --part accuracy --seeds 0 1 2 --json outputs/bench_compress/accuracy.json

# Sharded training (trainer.parallel=fsdp) on CPU with gloo: rank 0's memory at 1/2/4 ranks, and WRN-28-2's
# full combination on digits in one process against 2 ranks over 3 seeds (resumable: outputs/bench_fsdp).
bench-fsdp: $(STAMP)
	$(PY) scripts/bench_fsdp.py --part all --seeds 0 1 2 --json outputs/bench_fsdp/figures.json

# Optional: fairseq (a Python 3.11 fork, built against the installed torch, ~4 min) for the parity
# tests in tests/test_fairseq_parity.py, which are skipped without it.
FAIRSEQ_STAMP := $(VENV)/.fairseq
fairseq: $(FAIRSEQ_STAMP)
$(FAIRSEQ_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,fairseq]'
	$(PY) -m pip install --quiet --no-deps --no-build-isolation fairseq-fixed==0.12.3.1
	touch $(FAIRSEQ_STAMP)

# The documentation site into site/ (mkdocs.yml): guides from docs/, the knob and profile references
# generated from the code, the API from its docstrings. --strict: a broken link or missing page fails.
DOCS_STAMP := $(VENV)/.docs
docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict --quiet
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

clean-venv:
	rm -rf $(VENV)
