# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      ?= .venv
PYTHON    ?= python3
BIN       := $(VENV)/bin
# torch is installed first, pinned: on a machine without a GPU this is the CPU build on disk;
# an open range with no torch present would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
INVENTORY ?= inventory/local
ARGS      ?=
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: help install system-deps train provision preflight test test-fast molecule test-vm lint bench clean

help:
	@echo "make train       train the embedded default on INVENTORY (default: inventory/local)"
	@echo "make test        lint, fast tests, then the Molecule multi-host test bed"
	@echo "make provision   ansible-playbook site.yml -i INVENTORY"
	@echo "make preflight   check the cluster before a launch (report in output/preflight.json)"
	@echo "make lint | bench | molecule | install | clean"

system-deps:
	@scripts/install-system-deps.sh

install: system-deps $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[train,dev]"
	touch $@

train: install
	$(BIN)/trainer launch -i $(INVENTORY) $(ARGS)

provision: install
	$(BIN)/ansible-playbook site.yml -i $(INVENTORY) $(ARGS)

# The embedded default's shared dir is the repo's output/, which a fresh clone does not have yet.
preflight: install
	$(if $(filter inventory/local,$(INVENTORY)),mkdir -p output)
	$(BIN)/trainer preflight -i $(INVENTORY) $(ARGS)

lint: install
	$(BIN)/ruff check trainer tests bench
	$(BIN)/ruff format --check trainer tests bench
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint --profile production

# pytest exit code 5 (no tests collected) fails like any other error.
test-fast: install
	$(BIN)/pytest -q -m "not testbed" $(ARGS)

# create -> converge -> idempotence -> verify, then the launcher and preflight tests on the live
# bed, then destroy; on failure the last lines name the failing step (scripts/testbed/run-scenario.sh).
molecule: install
	scripts/testbed/run-scenario.sh default $(ARGS)

# The same site.yml on 3 QEMU VMs with real kernels (about 21 min with the VM image cached).
test-vm: install
	scripts/testbed/run-scenario.sh vm

test: lint test-fast molecule
	@if [ "$${RUN_VM_TESTS:-0}" = 1 ]; then $(MAKE) test-vm; fi

bench: install
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) output .pytest_cache .ruff_cache
