# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      ?= .venv
PYTHON    ?= python3
BIN       := $(VENV)/bin
# torch for this machine as a node (make train): installed first, pinned. On a machine without a GPU
# this is the CPU build on disk; an open range with no torch present would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
INVENTORY ?= inventory/local
ARGS      ?=
export PATH := $(abspath $(BIN)):$(PATH)
# uv, under this machine's pip settings (scripts/venv-install.py): the set-up's installs in a fraction
# of pip's time.
PIP := $(BIN)/python scripts/venv-install.py $(VENV)

.PHONY: help install install-train install-dev install-mitogen system-deps train provision preflight up test test-fast molecule test-vm lint bench docs docs-gen clean

help:
	@echo "make install     the controller: Ansible, ansible-runner (no torch)"
	@echo "make train       train the embedded default on INVENTORY (default: inventory/local)"
	@echo "make test        lint, fast tests, then the Molecule multi-host test bed"
	@echo "make provision   ansible-playbook site.yml -i INVENTORY (FULL=1: every role, even on a converged cluster)"
	@echo "make preflight   check the cluster before a launch (report in output/preflight.json)"
	@echo "make up          provision, preflight's probe pass and launch in one go (trainer up)"
	@echo "make docs        the docs site, strict (build/site); make docs-gen regenerates docs/reference"
	@echo "make lint | bench | molecule | test-vm | install-train | install-dev | clean"

# Who needs what (scripts/system-packages.txt has the Debian packages, pyproject.toml the Python ones):
#   install        the controller: provision, launch and preflight a cluster; no torch
#   install-train  + the training stack: this machine trains too (make train, inventory/local)
#   install-dev    + test and lint tools and the test bed's packages (make test)
system-deps:
	@scripts/install-system-deps.sh controller

install: system-deps $(VENV)/.installed-controller
install-train: install $(VENV)/.installed-train
install-dev: install-train $(VENV)/.installed-dev

$(VENV)/.installed-controller: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-train: $(VENV)/.installed-controller
	@scripts/install-system-deps.sh train
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[train]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-train
	@scripts/install-system-deps.sh testbed
	$(PIP) -e ".[train,dev]"
	touch $@

train: install-train
	$(BIN)/trainer launch -i $(INVENTORY) $(ARGS)

# MITOGEN=1: Mitogen's strategy (opt-in; make install-mitogen first). FULL=1: run every role even
# when every node is as the last full run left it (roles/converged/README.md).
provision: install
	$(if $(MITOGEN),VENV_PYTHON=$(BIN)/python scripts/with-mitogen.sh )$(BIN)/ansible-playbook site.yml -i $(INVENTORY) $(if $(FULL),-e converged_full_run=true )$(ARGS)

install-mitogen: install
	$(PIP) -e ".[mitogen]"

# The embedded default's shared dir is the repo's output/, which a fresh clone does not have yet.
preflight: $(if $(filter inventory/local,$(INVENTORY)),install-train,install)
	$(if $(filter inventory/local,$(INVENTORY)),mkdir -p output)
	$(BIN)/trainer preflight -i $(INVENTORY) $(ARGS)

# From bare hosts to training: provision, preflight's probe pass, launch (trainer up; ARGS: its options).
up: $(if $(filter inventory/local,$(INVENTORY)),install-train,install)
	$(if $(filter inventory/local,$(INVENTORY)),mkdir -p output)
	$(BIN)/trainer up -i $(INVENTORY) $(ARGS)

# ruff --no-cache: a stale cache once hid an import-order error that a fresh clone (CI) reported.
lint: install-dev
	$(BIN)/ruff check --no-cache trainer tests bench scripts roles
	$(BIN)/ruff format --no-cache --check trainer tests bench scripts roles
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint --profile production

# pytest exit code 5 (no tests collected) fails like any other error.
# make test runs the bed's tests, so not the bed-free twins of some (marked bed_twin: the same
# scenario and assertions on loopback "nodes"); make test-fast, for a machine without the bed, runs both.
TEST_FAST_MARKS ?= not testbed
test-fast: install-dev
	$(BIN)/pytest -q -m "$(TEST_FAST_MARKS)" $(ARGS)

# create -> converge -> idempotence -> verify, then the launcher and preflight tests on the live
# bed, then destroy; on failure the last lines name the failing step (scripts/testbed/run-scenario.sh).
molecule: install-dev
	scripts/testbed/run-scenario.sh default $(ARGS)

# The same site.yml on 3 QEMU VMs with real kernels (about 21 min with the VM image cached).
test-vm: install-dev
	scripts/testbed/run-scenario.sh vm

test: lint
	$(MAKE) test-fast TEST_FAST_MARKS="not testbed and not bed_twin"
	$(MAKE) molecule
	@if [ "$${RUN_VM_TESTS:-0}" = 1 ]; then $(MAKE) test-vm; fi

# The GPU benchmarks (bench/gpu_*) need a GPU machine and run there (bench/README.md).
bench: install-dev
	for b in $(filter-out bench/gpu_% bench/scale.py,$(wildcard bench/*.py)); do echo "== $$b"; $(BIN)/python $$b || exit 1; done
	@echo "== bench/scale.py (2 and 8 simulated nodes; the table in docs/scale.md runs 2 to 64)"
	$(BIN)/python bench/scale.py --nodes 2,8 --skip first_step

# The docs site, strict: a broken link or anchor, or a page left out of the nav, fails (mkdocs.yml).
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The reference pages generated from the code (the CLI's parsers, the config's docstrings, the roles'
# argument_specs); tests/unit/test_docs.py fails when the committed ones are out of date.
docs-gen: install-dev
	$(BIN)/python scripts/gen_docs.py

clean:
	rm -rf $(VENV) output .pytest_cache .ruff_cache
