# Two entry points, both idempotent: `make run` and `make test`.
# Everything lives in .venv; a stamp keyed on pyproject.toml skips reinstalling.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
DEFAULT_MODEL := smollm2-135m

.PHONY: install model run test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 is on these machines; a bare `torch`
	# requirement would pull a multi-GB CUDA build, so pin it first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

model: install
	$(BIN)/kvtier models pull $(DEFAULT_MODEL)

run: model
	$(BIN)/kvtier demo

test: model
	$(BIN)/python -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
