# The README's commands. Each target does its own set-up on a fresh machine: a virtual
# environment, torch from the local CPU wheel, Debian packages when missing (as root), then an
# incremental build of the C++ core and an editable install of the Python package.
#
#   make demo    fuse a built-in population of models, check every member, print a speed table
#   make test    C++ tests (ctest) + Python tests (pytest)
#   make bench   benchmarks, JSON records under bench-results/ (PRESET=ci|quick|full)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BUILD  := build/cmake
APT_PACKAGES := cmake ninja-build g++ libgtest-dev ccache
# torch is pinned: the C++ core links against this exact LibTorch (see pyproject.toml).
TORCH_SPEC := torch==2.13.0
SOURCES := $(shell find csrc tests/cpp -name '*.cpp' -o -name '*.h' 2>/dev/null) CMakeLists.txt pyproject.toml python/wide_compiler/_C.c
# The editable install maps each module it found to its file: a module that becomes a package (a
# new __init__.py) needs the install made again, or `import wide_compiler.<it>` finds the old file.
PACKAGES := $(shell find python/wide_compiler -name '__init__.py' 2>/dev/null)

.PHONY: all setup build demo test test-cpp test-python lint bench clean distclean

all: build

$(VENV)/.stamp-apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "installing Debian packages:$$missing"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else echo "missing Debian packages:$$missing (run as root, or: sudo apt-get install$$missing)"; exit 1; fi; \
	fi
	@mkdir -p $(VENV) && touch $@

$(VENV)/.stamp-py: $(VENV)/.stamp-apt
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" numpy "scikit-build-core>=0.10" tqdm pytest hypothesis
	touch $@

setup: $(VENV)/.stamp-py

# Test-only dependencies: the real-model suite (tests/python/real_models.py) builds tiny models
# from transformers and diffusers; tests/python/test_ray.py runs Ray Tune (about 20 s to install);
# matplotlib draws the CLI's --plot files (the `plot` extra); import-linter checks the package's
# layers (`make lint`). Pinned, and installed with torch pinned so pip never swaps torch.
TEST_SPECS := "transformers==5.23.0" "diffusers==0.42.1" "ray[tune]==2.60.0" "matplotlib==3.11.2" "optuna==5.0.0" "lightning==2.6.6" "accelerate==1.15.0" "import-linter==2.17" "pytest-xdist==3.8.0"
$(VENV)/.stamp-test: $(VENV)/.stamp-py Makefile
	$(PIP) install -q "$(TORCH_SPEC)" $(TEST_SPECS)
	touch $@

# Rebuild the C++ core when a C++/build file changes; Python files are live (editable install),
# except a new package (see PACKAGES).
$(VENV)/.stamp-build: $(VENV)/.stamp-py $(SOURCES) $(PACKAGES)
	$(PIP) install -q --no-build-isolation --no-deps -e . \
	  -Cbuild-dir=$(BUILD) -Ccmake.define.WIDE_BUILD_TESTS=ON
	touch $@

build: $(VENV)/.stamp-build

demo: build
	$(PY) examples/demo.py

test: test-cpp test-python

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j2

# The Python package's layers, declared as import-linter contracts in .importlinter: no import
# cycles, the compiler (fx) below the API, config below fx, nn/functional below fx, the
# benchmarks, integrations and tests above the library.
lint: build $(VENV)/.stamp-test
	$(VENV)/bin/lint-imports --no-logo

# pytest-xdist runs the test files on PYTEST_WORKERS processes (a file stays on one worker: its
# module-scoped fixtures are built once), each on one intra-op thread so that the workers do not
# oversubscribe the cores; tests of thread counts set their own. PYTEST_WORKERS=0 runs in-process.
# The files go out in collection order (--no-loadscope-reorder), which tests/python/conftest.py
# makes longest first (HEAVY_FIRST), so that no long file runs alone at the end.
PYTEST_WORKERS ?= 2
test-python: build $(VENV)/.stamp-test lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 \
	  tests/python --doctest-modules python/wide_compiler

# Each target writes JSON records (DESIGN §10) under bench-results/; PRESET=full for the grids.
# The targets come from the benchmark registry (`benchmark --list`, run once the build is done);
# BENCH_TARGETS="linear conv" runs some of them.
PRESET ?= quick
BENCH_TARGETS ?= $$($(PY) -m wide_compiler benchmark --list)
bench: build
	@targets="$(BENCH_TARGETS)" && [ -n "$$targets" ] || { echo "make bench: no benchmark targets" >&2; exit 1; }; \
	for t in $$targets; do \
	  $(PY) -m wide_compiler benchmark $$t --preset $(PRESET) --json bench-results/$$t-$(PRESET).json || exit 1; \
	done

clean:
	rm -rf build $(VENV)/.stamp-build

distclean: clean
	rm -rf $(VENV)
