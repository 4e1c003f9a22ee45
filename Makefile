# Two commands for a newcomer: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= data/stdlib
RUN    ?= runs/demo
STDLIB  = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

.PHONY: setup demo test bench clean-demo

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	# torch_xla 2.9's wheel holds a copy of torchax (0.0.6's code, which imports flax) in the same
	# directory as the torchax package: installed after it, torchax 0.0.7's files are the ones left
	$(BIN)/pip install --quiet --no-deps --force-reinstall torchax==0.0.7
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
