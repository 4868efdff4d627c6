# The README's commands. `make install` sets up .venv; every other target does it when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: install test test-slow lesson demo

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

lesson: $(STAMP)
	$(BIN)/tinygpt lesson

# The main job on the built-in corpus: the Python standard library's own source, character-level.
DEMO_DATA := data/python-stdlib
DEMO_RUN := runs/demo
DEMO_TIME ?= 5m

$(DEMO_DATA)/meta.json: | $(STAMP)
	$(BIN)/tinygpt prepare python-stdlib --out $(DEMO_DATA)

demo: $(STAMP) $(DEMO_DATA)/meta.json
	rm -rf $(DEMO_RUN)
	$(BIN)/tinygpt train --data $(DEMO_DATA) --out $(DEMO_RUN) --preset stretch --max-time $(DEMO_TIME) \
		--eval-interval 100 --eval-iters 10
	$(BIN)/tinygpt sample $(DEMO_RUN) --prompt "def " --max-new-tokens 300 --num-samples 2 --seed 1
	$(BIN)/tinygpt eval $(DEMO_RUN) --max-tokens 100000
