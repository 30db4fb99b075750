# torch-pagecomp: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# what the install reads (_native.c: the editable install builds the C loops in place, once)
INSTALL_INPUTS := requirements-dev.txt setup.py pyproject.toml torch_pagecomp/_native.c
STAMP  := $(VENV)/.installed-$(shell cat $(INSTALL_INPUTS) | cksum | cut -d' ' -f1)

.PHONY: install demo test test-slow test-interpret test-gpu compile-check bench checkstyle clean

# pip compiles no bytecode at install (most of torch's modules are never imported here):
# Python writes each module's bytecode at its first import instead, also where the environment
# sets PYTHONDONTWRITEBYTECODE (cleared for make's commands), so later processes reuse it; the
# last step imports what the tests import once, so that parallel test workers do not each
# compile the same modules. It takes both cores: while one process imports torch and the
# package, another imports PRECOMPILE_SIDE, the other packages that the first will import (none
# of them imports torch), so that the first finds them compiled.
export PYTHONDONTWRITEBYTECODE =
PRECOMPILE_SIDE := sympy, numpy, triton.language, jinja2, transformers, huggingface_hub, xdist, \
	pygments, yaml, tqdm, filelock

# The environment comes without the pip that `venv` would copy in (ensurepip: 6 s); the caller's
# pip puts PIP_VERSION in (ensurepip and an upgrade where it cannot): it resolves the
# requirements in half the time of python3.11's (23.2, on PyPI's large index pages).
# torch and triton (1.7 GB unpacked, most of the install) unpack in one pip, with no
# dependencies, while a second resolves and installs the other requirements (none of which may
# need either: a requirement that does belongs in HEAVY); a last pip over every requirement
# adds torch's own dependencies and checks the whole set.
PIP_VERSION := 26.3
HEAVY := ^(torch|triton)([=<>!~ ;[]|$$)

$(STAMP): $(INSTALL_INPUTS)
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	$(PY) -m pip --version 2>/dev/null | grep -q "^pip $(PIP_VERSION) " || \
		$(PYTHON) -m pip --python $(PY) install -q --no-compile pip==$(PIP_VERSION) || \
		{ $(PY) -m ensurepip >/dev/null && $(PY) -m pip install -q --no-compile pip==$(PIP_VERSION); }
	grep -E '$(HEAVY)' requirements-dev.txt > $(VENV)/requirements-heavy.txt
	grep -vE '$(HEAVY)' requirements-dev.txt > $(VENV)/requirements-rest.txt
	$(PY) -m pip install -q --no-compile --no-deps -r $(VENV)/requirements-heavy.txt & \
		$(PY) -m pip install -q --no-compile -r $(VENV)/requirements-rest.txt; \
		rest=$$?; wait $$! && test $$rest = 0
	$(PY) -m pip install -q --no-compile -r requirements-dev.txt
	$(PY) -m pip install -q --no-compile --no-deps --no-build-isolation -e .
	$(PY) -c "import $(PRECOMPILE_SIDE)" & \
		$(PY) -c "import torch_pagecomp.integrations.transformers, torch_pagecomp.offload, xdist"; \
		main=$$?; wait $$! && test $$main = 0
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo

checkstyle: $(STAMP)
	$(PY) -m ruff check torch_pagecomp triton_kernels tests bench

# The transformers integration's tests also run at older releases (tests/compat/transformers-
# RELEASE.txt: the oldest supported, and the H200 machines' own): each release and the
# dependencies whose versions differ, installed without dependencies into a folder of its own,
# ahead of the environment on PYTHONPATH. PAGECOMP_TRANSFORMERS names the release each run must
# import (a test checks it).
COMPAT := $(patsubst tests/compat/transformers-%.txt,%,$(wildcard tests/compat/transformers-*.txt))
TRANSFORMERS_TESTS := tests/test_integrations.py tests/test_integrations_review.py \
	tests/test_hf_generate_bench.py
$(VENV)/transformers-%/.installed: tests/compat/transformers-%.txt | $(STAMP)
	rm -rf $(VENV)/transformers-$*
	$(PY) -m pip install -q --no-compile --no-deps --target $(VENV)/transformers-$* -r $<
	touch $@

# CPU suite: the lz4 reference path plus every Triton kernel under TRITON_INTERPRET=1, less the
# cases marked slow (larger interpreter cases whose code paths a default case also runs), on
# TEST_WORKERS processes (pytest-xdist; each worker runs torch on one thread, tests/conftest.py).
# worksteal: the interpreter cases take from under a second to a minute, so idle workers take
# queued tests from busy ones instead of waiting on a fixed split.
TEST_WORKERS ?= 2
test: $(STAMP) checkstyle $(foreach r,$(COMPAT),$(VENV)/transformers-$(r)/.installed)
	PAGECOMP_TRANSFORMERS=$$(sed -n 's/^transformers==//p' requirements-dev.txt) \
		$(PY) -m pytest -q tests -m "not slow" -n $(TEST_WORKERS) --dist worksteal --durations=15
	for r in $(COMPAT); do \
		PYTHONPATH=$(VENV)/transformers-$$r PAGECOMP_TRANSFORMERS=$$r $(PY) -m pytest -q \
			$(TRANSFORMERS_TESTS) -m "not slow" -n $(TEST_WORKERS) --dist worksteal || exit 1; \
	done

# The slow cases left out of `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -q tests -m slow

# On a CUDA machine: the whole suite on the GPU (interpreter-only tests skip themselves), then
# the marked stages: the million-page mutation fuzz and compute-sanitizer memcheck.
# deterministic cuBLAS for the tests that compare gradients bit for bit (tests/test_model_zoo.py)
test-gpu: $(STAMP)
	CUBLAS_WORKSPACE_CONFIG=$${CUBLAS_WORKSPACE_CONFIG:-:4096:8} $(PY) -m pytest -q tests -m "not fuzz"
	$(PY) -m pytest -q tests -m fuzz
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) -m pytest -q tests/test_triton_compress.py tests/test_triton_decompress.py -m "not fuzz" -k "round_trip or hostile"

# Without a GPU: every kernel the package launches, compiled for sm_90 (Hopper) down to a cubin
# with the ptxas Triton ships. The interpreter runs a kernel's Python, not its compilation, so
# code the compiler refuses passes `make test`; run this before a GPU run (~5 min on 2 cores).
compile-check: $(STAMP)
	$(PY) -m bench.dev_aot_compile --arch 90

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache torch_pagecomp/*.so
