# Two commands for a newcomer: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= data/stdlib
RUN    ?= runs/demo
STDLIB  = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

.PHONY: setup demo test bench clean-demo

setup: $(VENV)/.installed

# uv (from PyPI, into the venv) installs what pip would, from the same index, 2x faster: torch's
# CUDA wheels are ~4 GB even on a CPU machine, and uv downloads and unpacks them in parallel
# (make setup here: 102 s from an empty uv cache; pip took 206-262 s in CI). It reads
# UV_DEFAULT_INDEX, not pip.conf (README). Pinned: the resolution it gives is checked against pip's.
# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (CI here), every process
# would otherwise compile torch's and transformers' sources again at import (2x the import's CPU).
$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check uv==0.13.9
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -r requirements-dev.txt
	# torch_xla 2.9's wheel holds a copy of torchax (0.0.6's code, which imports flax) in the same
	# directory as the torchax package: installed after it, torchax 0.0.7's files are the ones left
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps --reinstall torchax==0.0.7
	touch $@

# Prepare the local Python standard library as a corpus, train the demo model with the XLA
# trainer on the CPU (PJRT), print the validation loss and samples.
demo: setup
	@if [ -f $(DATA)/meta.json ]; then echo "$(DATA) exists: reusing it"; else \
	  $(BIN)/python prepare_data.py --input $(STDLIB) --glob '*.py' --exclude site-packages \
	    --vocab-size 2048 --val-fraction 0.01 --out $(DATA); fi
	PJRT_DEVICE=CPU $(BIN)/python train_xla.py configs/demo.yaml data.dir=$(DATA) checkpoint.dir=$(RUN)
	$(BIN)/python sample.py $(RUN) --prompt 'def ' --max-new-tokens 120 --num-samples 3

# pytest-xdist workers: most tests wait on one single-threaded subprocess (XLA compiles, torchrun),
# so two workers keep two cores busy (CI on 2 cores: 1,544 s -> 865 s). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

bench: setup
	$(BIN)/python bench/run.py

clean-demo:
	rm -rf $(DATA) $(RUN)
