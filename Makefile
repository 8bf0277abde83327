# The README's two commands:
#   make repro   set up .venv if needed, then `dvc repro` (the cpu profile by default)
#   make test    set up .venv if needed, then `make lint` and the whole test suite (CI runs this via .ci/run)
# Both are idempotent; the install step is skipped while pyproject.toml is unchanged. Beside them:
#   make smoke        prepare, train@*, report and plan on the micro profile in a temporary copy (nothing here changes)
#   make verify       re-execute the report from the committed results in a temporary copy; fail on any difference
#   make repro-all    retrain every run of the cpu profile (prints the plan and its estimate first)
#   make paper-smoke  the paper code path at paper shapes on CPU, in a temporary copy; results land in reports/paper-smoke/
#   make lint         ruff (rules and their reasons in pyproject.toml [tool.ruff]); seconds
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mapl-installed

export DVC_NO_ANALYTICS := 1
# dvc.yaml's commands call python/papermill from PATH: the project's venv comes first
export PATH := $(abspath $(VENV))/bin:$(PATH)
export PYTHONHASHSEED := 0

.PHONY: install repro repro-all smoke verify paper-smoke estimate lint test test-fast clean-venv

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
	$(PY) -m mapl.sweep --estimate

smoke: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m mapl.workspace smoke

verify: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m mapl.workspace verify

paper-smoke: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m mapl.workspace repro --profile paper-smoke --copy-back

lint: install
	$(VENV)/bin/ruff check .

# lint first: a style failure costs seconds, not a test run
test: install lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -rs tests

# in-process unit tests only (markers in pyproject.toml); MAPL_TEST_IN_PROCESS=1 fails an unmarked test that
# starts a child process, so a new subprocess test cannot slip into the fast set unmarked
test-fast: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MAPL_TEST_IN_PROCESS=1 $(PY) -m pytest -q -m "not slow and not process" tests

clean-venv:
	rm -rf $(VENV)
