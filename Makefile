# morph: the two commands of the README, plus benchmarks.
#   make test                              install deps, configure, build, run every test
#   make test SANITIZE=address,undefined   the same under ASan+UBSan (separate build folder)
#   make demo                              the elastic GPT example under a scripted scheduler
#   make demo-torch                        the same for the PyTorch example (examples/torch)
#   make test MORPH_TORCH=2.11             the Python package against torch 2.11 (default 2.15)
SHELL := /bin/bash
SANITIZE ?=
JOBS ?= $(shell nproc)
ifeq ($(SANITIZE),)
BUILD_DIR ?= build
CMAKE_ARGS ?=
else
BUILD_DIR ?= build-$(subst $(comma),-,$(SANITIZE))
CMAKE_ARGS ?= -DMORPH_SANITIZE=$(SANITIZE) -DCMAKE_BUILD_TYPE=RelWithDebInfo
endif
comma := ,
# The torch of the venv and the Python package (scripts/python-venv.sh, docs/torch.md
# "Building"): given here or in the environment it is passed to configure, which keeps it in the
# build folder's cache; `MORPH_TORCH=` returns a folder to the default.
TORCH_ARG := $(if $(filter-out undefined,$(origin MORPH_TORCH)),-DMORPH_TORCH=$(MORPH_TORCH))
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo Ninja || echo "Unix Makefiles")

.PHONY: deps configure build test bench-collectives

deps:
	@bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G "$(GENERATOR)" $(CMAKE_ARGS) $(TORCH_ARG)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 900

# Reshard benchmarks: one JSON object per line on stdout. Extend the list with new binaries;
# binaries that this build does not make (pack_gpu_bench without CUDA) are skipped.
BENCH_RESHARD_BINS := bench/projection_bench bench/plan_bench bench/executor_bench bench/checkpoint_bench bench/pack_gpu_bench \
                      bench/reshard_multiproc_bench
.PHONY: bench-reshard
bench-reshard: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)
	@set -e; for b in $(BENCH_RESHARD_BINS); do \
	  if [ -x $(BUILD_DIR)/$$b ]; then $(BUILD_DIR)/$$b; \
	  else echo "bench-reshard: $$b not built here, skipped" >&2; fi; \
	done

# Collectives: communicator build and abort times (forked ranks), then the Gloo communicator
# next to Open MPI (allreduce, send/recv) under mpirun with 2 and 4 ranks. JSON lines.
MPIRUN ?= mpirun --allow-run-as-root --oversubscribe
.PHONY: bench-collectives
bench-collectives: build
	$(BUILD_DIR)/bench/collectives_build_bench
	$(MPIRUN) -np 2 $(BUILD_DIR)/bench/collectives_mpi_bench
	$(MPIRUN) -np 4 $(BUILD_DIR)/bench/collectives_mpi_bench

# libFuzzer (clang-14) on the store's wire format, the control channel's frames and the
# scheduler API's requests, FUZZ_SECONDS each; ctest runs each 60 s (label fuzz).
FUZZ_SECONDS ?= 600
.PHONY: fuzz
fuzz: deps
	bash scripts/fuzz.sh $(FUZZ_SECONDS) $(BUILD_DIR)

# Store soak: 1,024 rendezvous clients + 4,096 idle connections, with and without 50 hostile
# clients. JSON lines.
.PHONY: bench-store
bench-store: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target store_soak_bench
	$(BUILD_DIR)/bench/store_soak_bench

# Peers of the end-to-end reconfiguration benchmark (issue 9): the C++ restart baseline and
# PyTorch DCP (torch from PyPI into $(BUILD_DIR)/peers-venv on first use), for dp4to2 dp2to4
# tp2to1 pp2to1 at PEERS_BYTES (default 1GiB; PEERS_BYTES=48MiB for a smoke run). JSON lines.
PEERS_BYTES ?= 1GiB
.PHONY: bench-runtime-peers
bench-runtime-peers: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target restart_baseline_bench
	BUILD_DIR=$(BUILD_DIR) PEERS_BYTES=$(PEERS_BYTES) bash bench/peers/run_peers.sh

# Coordinator at scale: 4,096 simulated workers register and heartbeat; time to decide and
# announce a change (GPT-like manifest, tp 8, pp 4, exact assignment). JSON lines.
.PHONY: bench-coordinator
bench-coordinator: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target coordinator_bench
	$(BUILD_DIR)/bench/coordinator_bench

# End-to-end reconfiguration (issue 9): morph's runtime next to the C++ restart baseline and
# PyTorch DCP in one session, then the cost of BeginStep + EndStep. RUNTIME_BYTES (default 1GiB),
# RUNTIME_CHANGES, RUNTIME_PEERS=0 for morph alone. JSON lines.
RUNTIME_BYTES ?= 1GiB
.PHONY: bench-runtime
bench-runtime: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target runtime_bench restart_baseline_bench
	BUILD_DIR=$(BUILD_DIR) RUNTIME_BYTES=$(RUNTIME_BYTES) bash bench/peers/run_runtime_bench.sh

# The Python package (issue 24): 1 GiB of unique state, dp 4->2, tp 2->1, pp 2->1, morph's Python
# workers next to its C++ workers and to a torchrun-style DCP restart (same torch), medians of
# TORCH_BENCH_REPEATS rounds; then the step loop's per-step cost (bench/torch/run_torch_bench.sh).
TORCH_BENCH_BYTES ?= 1GiB
.PHONY: bench-torch
bench-torch: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target runtime_bench restart_baseline_bench morphrun morph_python
	BUILD_DIR=$(BUILD_DIR) TORCH_BENCH_BYTES=$(TORCH_BENCH_BYTES) bash bench/torch/run_torch_bench.sh

# Coordinator failover on etcd (issue 26): fenced state write latency by job size, succession
# after a resign, then HA_RUNS kills of the leading morphd under training (succession, the
# survivors' longest stall, a resize right after). Private etcd clusters on loopback. JSON lines.
HA_RUNS ?= 3
.PHONY: bench-ha
bench-ha: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target ha_bench coordinator_failover_test
	$(BUILD_DIR)/bench/ha_bench
	$(BUILD_DIR)/tests/runtime/coordinator_failover_test \
	  --gtest_filter='*LeaderKilled*' --gtest_repeat=$(HA_RUNS) | grep '^{'
	MORPH_TEST_ETCD_OUTAGE_S=30 $(BUILD_DIR)/tests/runtime/coordinator_failover_test \
	  --gtest_filter='*FrozenLeader*:*EtcdOutage*' --gtest_repeat=$(HA_RUNS) | grep '^{'

# Recovery redundancy (runtime/recovery/): per-step cost of periodic checkpoints and buddy
# snapshots next to plain 100 ms steps, copy and exchange rates, snapshot memory. JSON lines.
.PHONY: bench-recovery
bench-recovery: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target recovery_bench
	$(BUILD_DIR)/bench/recovery_bench

# Failures (issue 10): SIGKILL of one of 4 workers, the survivors' recovery by phase (hybrid ZeRO,
# buddy snapshot), stall, a joiner's heal, the consistency mechanism's per-step cost; next to the
# checkpoint-restart baselines (C++ restart, PyTorch DCP) and TorchFT (torchft 0.2.0 installed into
# $(BUILD_DIR)/peers-venv on first use) in one session. FAILURES_BYTES (default 1GiB),
# FAILURES_CASES, FAILURES_PEERS=0 / FAILURES_TORCHFT=0 for morph alone. JSON lines.
FAILURES_BYTES ?= 1GiB
.PHONY: bench-failures
bench-failures: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target failures_bench restart_baseline_bench
	BUILD_DIR=$(BUILD_DIR) FAILURES_BYTES=$(FAILURES_BYTES) bash bench/peers/run_failures_bench.sh

# The elastic GPT example (examples/gpt) under morphrun while a scripted scheduler grows,
# shrinks, preempts and kills workers; a summary table and $(BUILD_DIR)/demo/loss.png.
# DEMO_SHORT=1: the CI form (gpt_demo_test).
.PHONY: demo
demo: configure
	BUILD_DIR=$(BUILD_DIR) JOBS=$(JOBS) bash scripts/demo.sh

# The same for the PyTorch example (examples/torch/handwritten.py; the venv of scripts/python-venv.sh,
# the package pip-installed against the installed morph), 6 workers: results in $(BUILD_DIR)/demo-torch.
.PHONY: demo-torch
demo-torch: configure
	BUILD_DIR=$(BUILD_DIR) JOBS=$(JOBS) OUT=$(BUILD_DIR)/demo-torch DEMO_PROGRAM=torch bash scripts/demo.sh

# Failure soak (issue 10): failure_test's seeded SIGKILL trials for SOAK_TRIALS seeds (default
# 200, from SOAK_FIRST_SEED), one process per seed with a timeout; the failing seeds' logs in
# $(BUILD_DIR)/soak/, a summary and one JSON line at the end. Not part of `make test`.
SOAK_TRIALS ?= 200
.PHONY: soak
soak: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target failure_test elastic_worker
	SOAK_TRIALS=$(SOAK_TRIALS) bash scripts/soak.sh $(BUILD_DIR)
