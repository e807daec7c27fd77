# Every target does its own set-up on a fresh Debian machine with Python 3.10+.
SHELL := /bin/bash
# The interpreter .venv is made from: the distribution's /usr/bin/python3 where it is 3.10 or
# newer, else the first python3 on PATH. Debian's and Ubuntu's are built with profile-guided
# optimization and libpython linked in; on a build from source without --enable-optimizations
# (pyenv's default) this project's processes took 1.1-1.4x the CPU and the test suite 1.2x
# (`python benchmarks/interpreter.py`). `make setup PYTHON=python3.12` takes another; an
# existing .venv is kept as it is.
PYTHON ?= $(shell /usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
	2>/dev/null && echo /usr/bin/python3 || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
NPROC ?= $(shell nproc)
# Test processes: four, three for the CPU-bound files and one for the files that mostly wait
# (tests/support/lanes.py). Many tests wait (on a broker, a device job's children, a paced
# fine-tune), so two processes left a 2-core host a fifth idle; a third filled most of that,
# a fourth taking files of every kind only contended. Clean-clone runs on 2 cores: 2 -> 1,667 s
# of tests, 1.57 cores busy; 3 -> 1,544 s, 1.76; 4 -> 1,620 s, 1.79 (more CPU in all:
# contention). Three of every kind against three + the waiting lane, on a slower host:
# 1.75 -> 1.77-1.78 cores busy (docs/benchmarks/process-start.md).
TEST_WORKERS ?= 4
# When make started (read once, as the Makefile is parsed): `make test` reports its wall time
# from here, set-up included.
MAKE_START := $(shell date +%s)

.PHONY: demo test test-gpu bench bench-quick lint docs setup services clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, so a local CPU build is taken where one is present;
# the project's own `torch>=` range is then already satisfied.
# pip byte-compiles every file it installs, one at a time (half of a fresh set-up here):
# --no-compile, then compileall over all cores writes the same .pyc files (46 -> 34 s for the
# project's dependencies on 2 cores). It exits 1 for the few files in the dependencies that
# are not Python 3 (templates, test data), as pip passes over them.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install --no-compile torch==2.13.0 || $(PIP) install --no-compile torch
	@# torch pinned to what was just installed: torchvision resolves to its matching release.
	$(PIP) install --no-compile -e '.[dev]' -c <(echo "torch==$$($(PY) -c 'import torch;print(torch.__version__.split("+")[0])')")
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $(STAMP)

setup: $(STAMP)

# Real services the tests talk to (mosquitto for MQTT, PostgreSQL, Slurm).
services:
	@if ! command -v mosquitto >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients >/dev/null; \
	  else \
	    echo "mosquitto is missing: run 'sudo apt-get install -y mosquitto mosquitto-clients' (MQTT tests will skip)"; \
	  fi; \
	fi
	@# systemd-analyze: the unit's verify and hardening score (no systemd runs here).
	@if ! command -v systemd-analyze >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null; \
	fi
	@# Chromium: the dashboard's browser test drives Debian's build headless (Playwright).
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "chromium is missing: run 'sudo apt-get install -y chromium' (the dashboard's browser test will skip)"; \
	  fi; \
	fi
	@# PostgreSQL (shared Optuna study), Slurm + munge (sbatch launch tests); the tests start them.
	@if ! command -v slurmctld >/dev/null 2>&1 || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql slurm-wlm munge >/dev/null; \
	  else \
	    echo "run 'sudo apt-get install -y postgresql slurm-wlm munge' (PostgreSQL and Slurm tests will skip)"; \
	  fi; \
	fi

# The whole mission on this machine (scripts/demo.py): DDP upstream, signed registry over
# HTTP, broker with per-device accounts, three edge-agents, a two-wave fleetctl rollout.
demo: setup services
	$(PY) scripts/demo.py --out runs/demo

test: setup services
	@# pytest rewrites the asserts of each test module it imports and caches the result beside
	@# it, except where PYTHONDONTWRITEBYTECODE is set: there each test process rewrote all of
	@# them again (collection 10.4 -> 5.9 CPU-s a process with the cache). One collection that
	@# writes the cache runs beside the linters, on the core they leave free.
	@env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest --collect-only -q -p no:cacheprovider \
	  >/dev/null 2>&1 & warm=$$!; \
	  rc=0; $(VENV)/bin/ruff check . && $(VENV)/bin/lint-imports || rc=$$?; \
	  wait $$warm; exit $$rc
	@# The project's modules byte-compiled once: the suite starts ~1,200 Python processes that
	@# import them, and where PYTHONDONTWRITEBYTECODE is set (CI images often set it) each
	@# compiled them again (0.05-0.2 s of CPU a process).
	@$(PY) -m compileall -q -j 0 agent benchmarks contract device_profiles exporters fleet \
	  hpc_core registry scripts tests >/dev/null
	@# --dist loadfile: a file's tests share one process, so a module's fixture (the demo's
	@# whole run, say) is set up once; --no-loadscope-reorder: files go out in the order
	@# tests/conftest.py puts them, the longest first; --durations lists the slowest 25.
	@rc=0; $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder --durations=25 || rc=$$?; \
	  echo "make test: $$(( $$(date +%s) - $(MAKE_START) )) s wall, set-up included (exit $$rc)"; \
	  exit $$rc

# On a GPU host: the CUDA paths that `make test` skips without one (fp16/bf16 training, a real
# out-of-memory, deterministic resume, batch-find and the fine-tune's memory plan on CUDA), then
# the trainer's and the finders' suites, which take CUDA by themselves where one is visible.
test-gpu: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/hpc_core/test_cuda.py tests/agent/finetune/test_cuda.py
	$(PY) -m pytest -q -p no:cacheprovider tests/hpc_core/test_trainer.py tests/hpc_core/test_finders.py

# One script per target in the issues; each prints its figures beside its baseline and ends
# with a "verdict:" line (its ratio beside its target). Every benchmarks/*.py but the helpers
# (tests/benchmarks/quick.py lists them too), so a new script is never left out. All of them
# run; the exit status says whether one failed (fleet.py also fails on a missed target).
BENCH_HELPERS := benchmarks/detection_device.py benchmarks/fleet_tier.py benchmarks/harness.py benchmarks/oip_threaded.py
BENCHES := $(filter-out $(BENCH_HELPERS),$(sort $(wildcard benchmarks/*.py)))

bench: setup services
	@rc=0; for b in $(BENCHES); do echo "== $$b"; $(PY) $$b || rc=1; done; exit $$rc

# The same scripts with --quick: tiny sizes, the same code paths, each its verdict line; it
# proves they run (the figures mean nothing). tests/benchmarks runs the same in the suite.
bench-quick: setup services
	@rc=0; for b in $(BENCHES); do echo "== $$b --quick"; \
	  $(PY) $$b --quick || { echo "FAILED: $$b --quick"; rc=1; }; done; exit $$rc

lint: setup
	$(VENV)/bin/ruff check .

# The documentation site into site/ (mkdocs.yml; the reference pages are generated from the
# code at build time). tests/docs builds it the same way on every `make test`.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf runs .pytest_cache site
