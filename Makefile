# Every target works on a fresh machine by itself: it creates .venv when missing and
# re-installs only when pyproject.toml, a file in ci/ that pins the install, or one of
# the C extensions (compiled at install) changed.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
INSTALL_INPUTS := pyproject.toml ci/constraints.txt ci/sglang-cpu-requirements.txt \
	sglang_storage/storage/_pagehash.c sglang_storage/storage/_fileio.c
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k units -x"`.
PYTEST_ARGS ?=

.PHONY: setup test typecheck lint check clean apply-patches revert-patches bench demo

setup: $(STAMP)

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; the pinned SGLang and torch wheels need Python 3.11 (set PYTHON=...)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

# SGLang's full dependency set pulls CUDA-only kernels, so it is installed without deps
# next to the import set its storage modules need (ci/sglang-cpu-requirements.txt).
# Every step is constrained by SGLang's own pins (ci/constraints.txt, which also pins
# sglang itself), so torch never moves.
$(STAMP): $(INSTALL_INPUTS) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c ci/constraints.txt \
		-r ci/sglang-cpu-requirements.txt -e '.[dev,mooncake-cpu]'
	$(BIN)/python -m pip install --quiet -c ci/constraints.txt --no-deps sglang
	@touch $@

test: $(STAMP)
	$(BIN)/python -m pytest -n auto $(PYTEST_ARGS)

typecheck: $(STAMP)
	$(BIN)/mypy

# All three run even when one fails, so one run reports every problem.
lint: $(STAMP)
	@status=0; \
	echo "ruff check"; $(BIN)/ruff check . || status=1; \
	echo "ruff format --check"; $(BIN)/ruff format --check . || status=1; \
	echo "lint-imports"; $(BIN)/lint-imports --no-cache || status=1; \
	exit $$status

check: typecheck lint test

# Patch the SGLang in .venv (or SGLANG_DIR=<sglang package dir, or an SGLang git checkout>)
# with patches/sglang-0.5.23; both are idempotent and change nothing when a patch misfits.
SGLANG_DIR ?=
PATCH_ARGS = --patches-dir patches/sglang-0.5.23 $(if $(SGLANG_DIR),--sglang-dir "$(SGLANG_DIR)")

apply-patches: $(STAMP)
	$(BIN)/python -m sglang_storage_adapters.patching apply $(PATCH_ARGS)

revert-patches: $(STAMP)
	$(BIN)/python -m sglang_storage_adapters.patching revert $(PATCH_ARGS)

# The benchmark suite: the benchmarks/ scripts with their quick settings, then
# `sglang-storage bench` side by side with SGLang's HiCacheFile, writing
# $(BENCH_REPORT)/report.md with charts, results.json and every script's output. 2-5 minutes
# (file_backend.py and the bench wait for ext4 to settle after deletions). Progress goes to
# stderr: a line per step with the time elapsed, each script's own progress lines and the
# bench's (a script's whole stderr, library logs included, is kept in
# build/bench/NAME.txt.err). Results go to stdout, each script's also to
# build/bench/NAME.txt. The report goes to build/bench unless
# `make bench BENCH_REPORT=docs/bench` (the committed report).
BENCH_REPORT ?= build/bench
BENCH_ARGS ?= --compare sglang-file --repeats 5 --settle 120
BENCH_SCRIPTS = "host_pool.py --quick" "storage_pipeline.py --repeats 40" \
	"page_hash.py --quick" "hicache_interface.py --quick" \
	"mooncake_backend.py --quick" "file_backend.py --quick" "file_scale.py --quick"

bench: $(STAMP)
	@mkdir -p build/bench
	@set -e; set -- $(BENCH_SCRIPTS); total=$$(($$# + 1)); step=0; start=$$(date +%s); attach=; \
	for run in "$$@"; do \
		step=$$((step + 1)); log=build/bench/$${run%%.py*}.txt; attach="$$attach --attach $$log"; \
		echo "make bench: [$$step/$$total] benchmarks/$$run ($$(($$(date +%s) - start)) s elapsed)" >&2; \
		echo "$$ python benchmarks/$$run" > $$log; \
		{ rc=0; $(BIN)/python benchmarks/$$run 2>&1 >> $$log || rc=$$?; echo $$rc > $$log.rc; } \
			| tee $$log.err | grep --line-buffered -E '^[a-z_]+\.py: ' >&2 || true; \
		rc=$$(cat $$log.rc); rm -f $$log.rc; \
		if [ "$$rc" != 0 ]; then tail -n 20 $$log $$log.err >&2; \
			echo "error: benchmarks/$$run failed (exit $$rc); output in $$log(.err)" >&2; exit 1; fi; \
		cat $$log; \
	done; \
	echo "make bench: [$$total/$$total] sglang-storage bench ($$(($$(date +%s) - start)) s elapsed)" >&2; \
	echo "$$ sglang-storage bench $(BENCH_ARGS) --report $(BENCH_REPORT)"; \
	$(BIN)/sglang-storage bench $(BENCH_ARGS) --report $(BENCH_REPORT) $$attach; \
	echo "make bench: done in $$(($$(date +%s) - start)) s; report: $(BENCH_REPORT)/report.md" >&2

# The demo: a multi-turn workload through device, host and the file backend under
# ./.sglang-storage-demo (run it twice: the second run gets storage hits). DEMO_ARGS=...
# passes options, e.g. DEMO_ARGS=--fresh.
DEMO_ARGS ?=

demo: $(STAMP)
	$(BIN)/sglang-storage replay $(DEMO_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis .import_linter_cache
	rm -f sglang_storage/storage/_pagehash.*.so sglang_storage/storage/_fileio.*.so
