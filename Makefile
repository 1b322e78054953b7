# `make demo` and `make test` are all a fresh machine needs.
# torch: an existing torch (e.g. a GPU machine's) is kept; otherwise the CPU build is pinned,
# because an unpinned install pulls a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0

.PHONY: install demo test bench gpu clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(if $(shell $(PY) -c "import torch" 2>/dev/null && echo y),--system-site-packages,) $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_CPU)
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VPY) examples/demo.py

# Two pytest workers (pytest-xdist): the suite is single-core bound (user time ~ wall time), and CI has 2 cores.
PYTEST_WORKERS ?= 2

test: install
	$(VPY) -m ruff check autopipe passes tests benchmarks examples zoo
	$(VPY) -m pytest -n $(PYTEST_WORKERS)

bench: install
	$(VPY) benchmarks/partition.py
	$(VPY) benchmarks/overhead.py
	$(VPY) benchmarks/speedup.py

# On a lent GPU machine (no network; its python3's CUDA torch, pytest and transformers are kept): the CUDA tests and
# benchmarks/gpu.py, host_cost.py and gpu.py --slices, every result under OUT (the device machine sets it), in about
# 7 minutes on an H100 or H200 (estimated, .ci/gpu.sh).
gpu:
	@test -n "$(OUT)" || { echo "make gpu OUT=<folder>: the folder the results go to (the device machine sets OUT)"; exit 2; }
	bash .ci/gpu.sh "$(OUT)"

clean:
	rm -rf $(VENV) *.egg-info
