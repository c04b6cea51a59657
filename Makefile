# The two commands of the README: `make demo` (the main job) and `make test`.
# Both create the virtual environment first; `make venv` is idempotent.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed
BIN    := $(VENV)/bin

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml setup.py tracekit/dlrm/csrc/sparse_update.cpp
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .  # builds the C++ kernel (~1 min)
	touch $(STAMP)

demo: venv
	$(BIN)/python -m tracekit.demo

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
