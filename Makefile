# `make demo` and `make test` are all a fresh machine needs.
# torch: an existing torch (e.g. a GPU machine's) is kept; otherwise the CPU build is pinned,
# because an unpinned install pulls a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(if $(shell $(PY) -c "import torch" 2>/dev/null && echo y),--system-site-packages,) $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_CPU)
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VPY) examples/demo.py

test: install
	$(VPY) -m ruff check autopipe passes tests benchmarks examples zoo
	$(VPY) -m pytest

bench: install
	$(VPY) benchmarks/partition.py
	$(VPY) benchmarks/overhead.py
	$(VPY) benchmarks/speedup.py

clean:
	rm -rf $(VENV) *.egg-info
