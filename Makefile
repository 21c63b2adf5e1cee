# Two entry points, both idempotent: `make run` and `make test`.
# Everything lives in .venv; a stamp keyed on pyproject.toml, setup.py and the C sources skips reinstalling.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
BUILD  := pyproject.toml setup.py $(sort $(wildcard src/kvtier/*/*.c src/kvtier/*/*.h))
STAMP  := $(VENV)/.installed-$(shell cat $(BUILD) | cksum | cut -d' ' -f1)
DEFAULT_MODEL := smollm2-135m

.PHONY: install vllm model run test clean

install: $(STAMP)

$(STAMP): $(BUILD)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 is on these machines; a bare `torch`
	# requirement would pull a multi-GB CUDA build, so pin it first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

# vLLM 0.33 for the vLLM tier's contract tests (tests/integrations/vllm), on this CPU-only machine.
# `pip install vllm` would swap the CPU torch for vLLM's CUDA torch 2.14 and pull gigabytes of CUDA
# wheels, so the vLLM wheel goes in with --no-deps, then the pure-Python modules its offloading
# code imports; xgrammar also with --no-deps (its own requirements pull a CUDA torch). The import
# at the end fails the step if anything is missing; a stamp keyed on the list skips the step after
# the first time, so `make test` stays quick.
# (On a GPU machine install `kvtier[vllm]` instead: there vLLM brings the torch it was built for.)
VLLM_DEPS := msgspec cachetools blake3 py-cpuinfo 'pyzmq>=25' cbor2 'aiohttp>=3.14.4' openai openai-harmony \
	pybase64 cloudpickle uvloop prometheus-client fastapi partial-json-parser 'llguidance>=1.7,<1.8' \
	opentelemetry-api 'apache-tvm-ffi==0.1.11'
VLLM_STAMP := $(VENV)/.vllm-$(shell echo "$(VLLM_DEPS)" | cksum | cut -d' ' -f1)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps 'vllm==0.33.0' 'xgrammar==0.2.8'
	$(BIN)/python -m pip install -q $(VLLM_DEPS)
	$(BIN)/python -c "import vllm.v1.kv_offload.tiering.spec, torch; print('vLLM tier tests: vllm importable, torch', torch.__version__)"
	rm -f $(VENV)/.vllm-*
	touch $@

model: install
	$(BIN)/kvtier models pull $(DEFAULT_MODEL)

run: model
	$(BIN)/kvtier demo

test: model vllm
	$(BIN)/python -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
