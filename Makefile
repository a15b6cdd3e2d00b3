# The README's two commands: `make run` (decode live with the shipped model) and `make test`.
PY ?= python3
ARGS ?= --compare ar
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, from the CPU wheel on disk; anything looser pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m specblock.runtime $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV)
