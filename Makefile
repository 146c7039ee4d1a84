# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, build attnrnn, run the demo
#   make test   - create .venv, build attnrnn, run every test (Python, C++ ctest, CMake consumer)
PYTHON ?= python3
VENV ?= .venv
# torch for this machine kind: the CPU wheel on local disk. Override, e.g. TORCH_SPEC="torch==2.11.0".
TORCH_SPEC ?= torch==2.13.0
JOBS ?= $(shell nproc)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnrnn-deps
CPP_BUILD := build/cpp-tests
CONSUMER_BUILD := build/consumer

.PHONY: all install demo test test-python test-cpp test-consumer bench clean

all: install

# torch is installed only when the environment has none (an existing VENV keeps its own).
$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

install: $(STAMP)
	ATTNRNN_BUILD_JOBS=$(JOBS) $(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

demo: install
	$(PY) -m attnrnn.demo

test: test-python test-cpp test-consumer

test-python: install
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor-cache $(PY) -m pytest -q -p no:cacheprovider tests/python

# The torch-free library and its C++ tests, built without libtorch.
test-cpp: $(STAMP)
	$(VENV)/bin/cmake -S . -B $(CPP_BUILD) -G Ninja -DATTNRNN_BUILD_TORCH=OFF -DATTNRNN_BUILD_TESTS=ON -DATTNRNN_CUDA=OFF
	$(VENV)/bin/cmake --build $(CPP_BUILD) --parallel $(JOBS)
	$(VENV)/bin/ctest --test-dir $(CPP_BUILD) --output-on-failure

# A separate CMake project that find_package()s the installed attnrnn and runs one op.
test-consumer: install
	$(VENV)/bin/cmake -S tests/consumer -B $(CONSUMER_BUILD) -G Ninja \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import attnrnn, torch; print(attnrnn.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path)')"
	$(VENV)/bin/cmake --build $(CONSUMER_BUILD) --parallel $(JOBS)
	$(VENV)/bin/ctest --test-dir $(CONSUMER_BUILD) --output-on-failure

bench: install
	$(PY) -m bench --device cpu

clean:
	rm -rf build $(VENV) python/attnrnn/lib python/attnrnn/include python/attnrnn/_C*.so
