# The README's two commands:
#   make repro   set up .venv if needed, then `dvc repro` (the cpu profile by default)
#   make test    set up .venv if needed, then `make lint` and every test not marked `full` (CI runs it first, .ci/run)
# Both are idempotent; the install step is skipped while pyproject.toml is unchanged. Beside them:
#   make smoke        prepare, train@*, report and plan on the micro profile in a temporary copy (nothing here changes)
#   make verify       re-execute the report from the committed results in a temporary copy; fail on any difference
#   make repro-all    retrain every run of the cpu profile (prints the plan and its estimate first)
#   make paper-smoke  the paper code path at paper shapes on CPU, in a temporary copy; results land in reports/paper-smoke/ (git-ignored)
#   make docs         rewrite the documents' generated blocks from their sources (a test runs `mapl docs --check`)
#   make lint         ruff (rules and their reasons in pyproject.toml [tool.ruff]); seconds
#   make test-all     `make test`, then the `full` tests: every test once (about 90 minutes on 2 cores)
#   make test-fast    the in-process unit tests only
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
MAPL   := $(VENV)/bin/mapl
STAMP  := $(VENV)/.mapl-installed

export DVC_NO_ANALYTICS := 1
# dvc.yaml's commands call mapl from PATH: the project's venv comes first
export PATH := $(abspath $(VENV))/bin:$(PATH)
export PYTHONHASHSEED := 0

.PHONY: install repro repro-all smoke verify paper-smoke estimate docs lint test test-all test-full test-fast clean-venv

install: $(STAMP)

# torch first, from its one pin (pyproject.toml): an unpinned resolve would pull a multi-GB CUDA build
TORCH_PIN := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
$(STAMP): pyproject.toml
	test -n "$(TORCH_PIN)" || { echo "error: no torch==<version> pin in pyproject.toml" >&2; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

repro: install
	$(VENV)/bin/dvc repro

# retrain everything from scratch (the committed results make a plain `dvc repro` a no-op on a clone)
repro-all: install
	$(VENV)/bin/dvc repro -f

# runs per group and the wall-time estimate of the default profile
estimate: install
	$(MAPL) sweep --estimate

# rewrite the documents' generated blocks (the ledger, the headline, the stage and benchmark tables, the estimate)
docs: install
	$(MAPL) docs

smoke: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(MAPL) workspace smoke

verify: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(MAPL) workspace verify

paper-smoke: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(MAPL) workspace repro --profile paper-smoke --copy-back

lint: install
	$(VENV)/bin/ruff check .

PYTEST := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -rfEs --durations=20
# the project's tests, and the GPU kit's beside it (they run on a CPU)
TESTS  := tests benchmarks/gpu

# The test sets (markers in pyproject.toml). `make test` must stay near 10 minutes on 2 cores from a fresh clone (586-607 s measured),
# install included: lint, the unit and property tests and a chosen share of the slow and child-process tests; the
# rest is marked `full` (tests/conftest.py's FULL_ONLY and each marker say why) and runs in `make test-all`. Lint first: a style failure costs seconds.
test: install lint
	$(PYTEST) -m "not full" $(TESTS)

# every test exactly once: `make test`, then the `full` remainder
test-all: test
	$(MAKE) --no-print-directory test-full

# the remainder alone (what `make test-all` adds to `make test`)
test-full: install
	$(PYTEST) -m full $(TESTS)

# in-process unit tests only; MAPL_TEST_IN_PROCESS=1 fails an unmarked test that starts a child process, so a
# new subprocess test cannot slip into the fast set unmarked
test-fast: install
	MAPL_TEST_IN_PROCESS=1 $(PYTEST) -m "not slow and not process" $(TESTS)

clean-venv:
	rm -rf $(VENV)
