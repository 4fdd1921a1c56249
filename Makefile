# fabric-lab: every target is one command, the same one README.md shows. `make` lists them.
# Variables mirror the scripts' flags and are passed only when set, so each script's defaults stay
# the single source of truth (see `python fabric_lenet.py --help`, `python fabric_gpt.py --help`).

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
TB_HOST ?= 127.0.0.1
TB_PORT ?= 6006
RUNS    ?= runs
# one test worker more than cores: a worker waiting on a process start, a signal or a disk leaves its core to the
# next (the warm suite on 2 cores: 9-17% less time with 3 workers than with 2, in two sittings; docs/tests-log.md); and
# at most one per 2.5 GiB of available memory (the warm suite's 3 workers peaked at 6.3 GB above the 1.0 GB used
# before it), so that a laptop with 16 threads and 16 GB does not start 17. Cores as `nproc` counts them, without the
# OpenMP variables it also obeys (the suite sets OMP_NUM_THREADS in its workers, a SLURM job often in its shell)
MEMINFO ?= /proc/meminfo
TEST_WORKERS ?= $(shell workers=$$(( $$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1) + 1 )); \
	memory=$$(awk '/^MemAvailable:/ {print int($$2 / 2621440)}' $(MEMINFO) 2>/dev/null); \
	[ -n "$$memory" ] && [ "$$memory" -lt "$$workers" ] && workers=$$memory; echo $$(( workers > 1 ? workers : 1 )))

# RUNS: the folder every run, benchmark and gpu-check writes into, and report, tb, sample and export read.
# quote <value>: one shell word (a path with a space or an apostrophe); flag <NAME> <--flag>: "--flag 'value'" when
# the variable NAME is set, its value as typed (make would expand a $ in it)
quote = '$(subst ','\'',$(1))'
flag = $(if $(value $(1)),$(2) $(call quote,$(value $(1))))
FABRIC_FLAGS = --out-dir $(call quote,$(RUNS)) $(call flag,ACCELERATOR,--accelerator) $(call flag,DEVICES,--devices) $(call flag,NODES,--num-nodes) $(call flag,NODE_TIMEOUT,--node-timeout) \
	$(call flag,STRATEGY,--strategy) $(call flag,PRECISION,--precision) $(call flag,LR,--lr) \
	$(call flag,SEED,--seed) $(call flag,RUN,--run-name) $(call flag,RESUME,--resume) $(call flag,REQUEUE_SIGNAL,--requeue-signal) \
	$(if $(filter 1 yes true,$(COMPILE)),--compile,$(if $(filter 0 no false,$(COMPILE)),--no-compile))
LENET_FLAGS = $(FABRIC_FLAGS) $(call flag,EPOCHS,--epochs) $(call flag,BATCH,--batch-size) $(call flag,ACT,--activation) \
	$(call flag,DATA,--data) $(call flag,WORKERS,--num-workers) $(ARGS)
GPT_FLAGS = $(FABRIC_FLAGS) $(call flag,MODEL,--model) $(call flag,STEPS,--steps) $(call flag,MICRO_BATCH,--micro-batch-size) \
	$(call flag,ACCUM,--grad-accum) $(call flag,SAMPLES,--num-samples) $(call flag,SEQ,--seq-len) \
	$(if $(filter 1 yes true,$(CKPT)),--grad-checkpointing) $(call flag,NVME,--nvme-path) $(call flag,TP,--tp-size) \
	$(call flag,PP,--pp-size) $(call flag,PP_SCHEDULE,--pp-schedule) $(call flag,OPTIMIZER,--optimizer) \
	$(call flag,CLUSTER,--cluster) $(call flag,TOKENS,--tokens) $(call flag,PLAN_JSON,--plan-json) $(call flag,FRAMEWORK,--plan-framework) \
	$(if $(filter 1 yes true,$(SEARCH)),--search) $(if $(filter 1 yes true,$(COUNT_COMMS)),--count-comms) $(TEXT_FLAGS) $(ARGS)
TEXT_FLAGS = $(call flag,DATASET,--dataset) $(call flag,TEXT,--text) $(call flag,TOKENIZER,--tokenizer) $(call flag,VOCAB,--vocab-size) \
	$(call flag,DATA_DIR,--data-dir) $(call flag,EVAL_EVERY,--eval-every) $(call flag,EVAL_BATCHES,--eval-batches)
SAMPLE_FLAGS = $(if $(PROMPT),--prompt $(call quote,$(value PROMPT))) $(call flag,NEW_TOKENS,--max-new-tokens) $(call flag,TEMPERATURE,--temperature) \
	$(call flag,TOP_K,--top-k) $(call flag,SEED,--seed)

.DEFAULT_GOAL := help
.PHONY: help setup lab gpu-check data text sample lenet tb test test-fast gelu-check bench-gelu bench-lenet gpt gpt-command export plan gpt-plan plan-check bench-gpt bench-text report clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'
	@echo "  variables: EPOCHS BATCH LR ACT DATA WORKERS | MODEL STEPS MICRO_BATCH ACCUM SAMPLES SEQ CKPT=1 NVME TP PP PP_SCHEDULE OPTIMIZER |"
	@echo "             CLUSTER TOKENS SEARCH=1 PLAN_JSON FRAMEWORK COUNT_COMMS=1 (plan, gpt) |"
	@echo "             DATASET=text TEXT TOKENIZER VOCAB DATA_DIR EVAL_EVERY EVAL_BATCHES (text, gpt) | PROMPT NEW_TOKENS TEMPERATURE TOP_K (sample) |"
	@echo "             DEVICES NODES NODE_TIMEOUT STRATEGY PRECISION ACCELERATOR SEED RUN RESUME=auto REQUEUE_SIGNAL COMPILE=1|0 ARGS='--more flags' |"
	@echo "             FORCE=1 STAGES=a,b (lab) | CHECKS=a,b|all (gpu-check) | RUNS (the runs folder, default runs) | TEST_WORKERS (test)"

# The virtual environment is rebuilt only when requirements.txt changes. TORCH_INDEX: a wheel index for a torch
# build that matches the NVIDIA driver (e.g. https://download.pytorch.org/whl/cu126 for drivers 525-575).
# The set-up is a make of its own that runs its steps side by side (-j 3, unless the caller gave a -j): torch, ninja
# and DeepSpeed first (all that the builds below import), libaio and clang unpacked beside them, then the rest of
# requirements.txt beside the builds (docs/tests.md: a fresh clone's make setup 121-126 s instead of 152-159 s when
# pip still installed on one core; 94-120 s with uv instead of pip's 125-148 s).
SETUP := $(VENV)/.setup
GELU_SOURCES := gelu_ext/gelu.cpp gelu_ext/gelu_cuda.cu gelu_ext/gelu_checks.h gelu_ext/gelu_math.h
$(VENV)/.setup: requirements.txt $(GELU_SOURCES)
	@$(MAKE) --no-print-directory $(if $(filter -j%,$(MAKEFLAGS)),,-j 3) $(VENV)/.installed $(VENV)/.gelu $(VENV)/.ops
	@touch $@

# the venv itself, before any install: what only needs its folder (.libaio, .clang) starts beside torch's install.
# .base makes it again where its python has gone since (the Python it was made from removed)
$(VENV)/.made:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	touch $@

# uv installs in pip's place, with pip's settings (pip.conf, PIP_*), side by side and compiling the bytecode on every
# core; pip itself where uv is missing or cannot take a setting (core/host/installer.py)
$(VENV)/.base: requirements.txt | $(VENV)/.made
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip uv || $(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m core.host.installer --index-url $(TORCH_INDEX) torch)
	grep -E '^(torch|ninja|deepspeed)\b' requirements.txt > $(VENV)/base-requirements.txt
	$(PY) -m core.host.installer -r $(VENV)/base-requirements.txt
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m core.host.installer -r requirements.txt
	touch $@

# DeepSpeed's NVMe offload (--nvme-path) compiles against libaio. Without the system's libaio-dev, Debian's
# packages are unpacked into the venv (apt-get download needs no root); strategies.py points the build there.
$(VENV)/.libaio: | $(VENV)/.made
	if [ ! -e /usr/include/libaio.h ] && command -v apt-get >/dev/null; then \
	  rm -rf $(VENV)/libaio && mkdir -p $(VENV)/libaio && cd $(VENV)/libaio && \
	  { apt-get download -qq -o APT::Sandbox::User=root libaio-dev libaio1 || apt-get download -qq -o APT::Sandbox::User=root libaio-dev libaio1t64; } && \
	  for deb in *.deb; do dpkg-deb -x $$deb .; done; \
	fi || echo "note: libaio was not fetched; --nvme-path is refused until libaio-dev is installed"
	touch $@

# The ops' sources that include torch compile with clang where one is at hand, faster than GCC, with the ops' -fopenmp
# (core/host/extension_compiler.py). Without a system clang++ that finds OpenMP's header, Debian's clang and libomp
# headers are unpacked into the venv as libaio is.
$(VENV)/.clang: | $(VENV)/.made
	if ! echo '#include <omp.h>' | clang++ -fopenmp -x c++ -E - >/dev/null 2>&1 && command -v apt-get >/dev/null; then \
	  v=$$(apt-cache depends clang 2>/dev/null | sed -n 's/.*Depends: clang-\([0-9][0-9]*\)$$/\1/p' | head -n 1); \
	  rm -rf $(VENV)/clang && mkdir -p $(VENV)/clang && [ -n "$$v" ] && (cd $(VENV)/clang && \
	  apt-get download -qq -o APT::Sandbox::User=root clang-$$v libclang-cpp$$v libllvm$$v libclang-common-$$v-dev \
	    libomp-$$v-dev && for deb in *.deb; do dpkg-deb -x $$deb .; done && rm -f *.deb); \
	fi || { rm -rf $(VENV)/clang; echo "note: clang was not fetched; the ops compile with GCC alone"; }
	touch $@

# Compiled once here rather than inside the first run (or test) that needs them: the C++ GELU, its CUDA kernel only
# where a GPU is, and DeepSpeed's CPU ops (NVMe offload's are left to the first --nvme-path run); each recompiles by
# itself if its sources or torch change.
$(VENV)/.gelu: $(VENV)/.base $(GELU_SOURCES)
	$(PY) -c "from gelu_ext import load_cpp; load_cpp(); print('built the C++ GELU')"
	touch $@

$(VENV)/.ops: $(VENV)/.base $(VENV)/.libaio $(VENV)/.clang
	$(PY) -c "from core.gpt import strategies; strategies.build_cpu_ops()"
	touch $@

setup: $(SETUP) ## create .venv and install requirements.txt (libaio for NVMe offload, clang for faster op builds, where the system lacks them)

lab: $(SETUP) ## the whole lab, fresh clone to report/REPORT.md; finished stages are skipped (FORCE=1 redoes them)
	$(PY) -m lab --runs $(call quote,$(RUNS)) $(if $(filter 1 yes true,$(FORCE)),--force) $(call flag,STAGES,--stages)

gpu-check: $(SETUP) ## CUDA machines: the new GPU paths and their goals in ~7 min (CHECKS=all: every row), into runs/gpu-check/
	$(PY) -m lab.gpu_check --runs $(call quote,$(RUNS)) $(call flag,CHECKS,--checks)

data: $(SETUP) ## download and verify MNIST into data/mnist (MNIST_MIRROR=folder-or-URL when offline)
	$(PY) datasets_local.py --root data/mnist

text: $(SETUP) ## fetch and verify the Shakespeare corpus into data/text (TEXT_MIRROR offline; TOKENIZER=char|bpe prepares it)
	$(PY) -m core.gpt.text_corpus $(call flag,DATA_DIR,--data-dir) $(call flag,TEXT,--text) $(call flag,TOKENIZER,--tokenizer) $(call flag,VOCAB,--vocab-size)

sample: $(SETUP) ## print text generated by a text run's final weights (RUN=<run folder>, PROMPT, NEW_TOKENS, TEMPERATURE, TOP_K)
	$(if $(RUN),,$(error make sample needs RUN=<run folder name under $(RUNS)/>))
	$(PY) -m lab.sample --out-dir $(call quote,$(RUNS)) --run-name $(call quote,$(RUN)) $(SAMPLE_FLAGS) $(ARGS)

lenet: $(SETUP) ## train LeNet-5 on MNIST (ACT=gelu_cpp, DEVICES=2 STRATEGY=ddp, RESUME=auto, ...)
	$(PY) fabric_lenet.py $(LENET_FLAGS)

tb: $(SETUP) ## start TensorBoard on runs/ (TB_HOST, TB_PORT)
	@echo "TensorBoard: http://$(TB_HOST):$(TB_PORT)/"
	$(VENV)/bin/tensorboard --logdir $(call quote,$(RUNS)) --host $(TB_HOST) --port $(TB_PORT)

test: $(SETUP) ## run the test suite on CPU (real MNIST via MNIST_MIRROR, real DDP, DeepSpeed and C++ build)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist worksteal $(ARGS)

test-fast: $(SETUP) ## the tests not marked slow (no run in a process of its own, no DeepSpeed), for development
	$(PY) -m pytest tests -m "not slow" $(ARGS)

gelu-check: $(SETUP) ## compare the Python and C++ GELU with F.gelu, plus gradcheck
	$(PY) -m gelu_ext check --out $(call quote,$(RUNS)/gelu)

bench-gelu: $(SETUP) ## time forward+backward of F.gelu, the Python and the C++ GELU (16M floats)
	$(PY) -m gelu_ext bench --out $(call quote,$(RUNS)/gelu) $(ARGS)

bench-lenet: $(SETUP) ## LeNet-5 samples/s (DataLoader vs in-memory) and time to 99.0% test accuracy
	$(PY) -m lab.bench --out-dir $(call quote,$(RUNS)) lenet $(ARGS)

gpt: $(SETUP) ## train GPT-2 on random tokens or DATASET=text (MODEL, STRATEGY, DEVICES, PRECISION, ACCUM, CKPT=1, ...)
	$(PY) fabric_gpt.py $(GPT_FLAGS)

gpt-command: ## print the command `make gpt` runs, quoted for a shell (gpt.sbatch gives it to srun: each task is then Python)
	@echo $(call quote,$(strip $(PY) fabric_gpt.py $(GPT_FLAGS)))

export: $(SETUP) ## write runs/RUN/hf/, a Hugging Face model folder, from the run's newest checkpoint (any strategy)
	$(if $(RUN),,$(error make export needs RUN=<run folder name under $(RUNS)/>))
	$(PY) -m core.gpt.hf_export $(call quote,$(RUNS)/$(RUN)) $(ARGS)

plan: $(SETUP) ## predict memory, step time, traffic and days (MODEL STRATEGY DEVICES NODES CLUSTER TOKENS SEARCH=1 FRAMEWORK)
	$(PY) fabric_gpt.py --plan $(GPT_FLAGS)

gpt-plan: plan ## the same as make plan (its earlier name)

plan-check: $(SETUP) ## the plan against published GPU training runs: predicted, measured, ratio; median and worst error
	$(PY) -m lab.plan_check

bench-gpt: $(SETUP) ## sweep strategies and precisions on equal data; writes a Markdown table
	$(PY) -m lab.bench --out-dir $(call quote,$(RUNS)) gpt $(call flag,MODEL,--model) $(call flag,DEVICES,--devices) $(call flag,ACCELERATOR,--accelerator) $(ARGS)

bench-text: $(SETUP) ## nanoGPT's shakespeare_char CPU recipe: fabric_gpt.py (float32 and, with bf16 instructions, bf16; eager, compiled) against nanoGPT's loop
	$(PY) -m lab.bench --out-dir $(call quote,$(RUNS)) text $(call flag,STEPS,--steps) $(call flag,DATA_DIR,--data-dir) $(ARGS)

report: $(SETUP) ## write report/REPORT.md with figures from the runs under runs/
	$(PY) -m lab.report --runs $(call quote,$(RUNS)) --out report $(ARGS)

clean: ## remove runs/, report/ and the C++ build (keeps .venv and data/)
	rm -rf $(call quote,$(RUNS)) report gelu_ext/build
