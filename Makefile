# The two commands of the README: `make demo` (the main job) and `make test`.
# Both create the virtual environment first; `make venv` is idempotent.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed
BIN    := $(VENV)/bin

.PHONY: venv torchrec-venv demo test bench clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml setup.py tracekit/dlrm/csrc/sparse_update.cpp
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .  # builds the C++ kernel (~1 min)
	touch $(STAMP)

# The TorchRec venv (bench/.venv-torchrec) the TorchRec tests install tracekit into; idempotent.
# Without a package index it fails: the rest of `make test` still runs, and those tests skip saying why;
# under TRACEKIT_STRICT_PREREQUISITES (CI, .ci/run) the failure stops `make test` (tests/prerequisites.py).
torchrec-venv:
	bash bench/setup_torchrec_venv.sh || { test -z "$$TRACEKIT_STRICT_PREREQUISITES" || exit 1; \
		echo "make: no TorchRec venv (see above); the TorchRec tests will skip" >&2; }

demo: venv
	$(BIN)/python -m tracekit.app.demo

test: venv torchrec-venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
