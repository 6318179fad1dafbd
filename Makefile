# The two commands of the README's quick start. Each creates or refreshes .venv first, so both work
# on a fresh machine. The constraints file pins the CPU build of torch (pyproject keeps a range).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONSTRAINTS ?= constraints/cpu.txt

.PHONY: test verify lint venv wheel-venv clean bench

venv: $(STAMP)

# Re-install when the project's requirements or the pins change.
$(STAMP): pyproject.toml $(CONSTRAINTS) scripts/venv_install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# uv unpacks the wheels in parallel (pip one by one), with pip's settings; pip if uv cannot.
	$(PY) scripts/venv_install.py $(CONSTRAINTS)
	@# Neither installer compiled the bytecode (pip would, one module at a time: about 50 s of CPU for the ~14,000 modules of
	@# torch, ray, ...); compileall -j 0 does it on every core. A file that does not compile
	@# (a package's Python 2 template) is skipped, as pip skips it.
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

# A user's install, for benchmarks/startup.py's figure of record: the project built as a wheel and
# installed, not editable, into a venv of its own with the same pins, every module's bytecode written
# as pip writes it. Rebuilt from the checkout each time (the version does not change between commits).
WHEEL_VENV ?= .venv-wheel

wheel-venv: $(STAMP)
	rm -rf $(WHEEL_VENV)/dist build
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(WHEEL_VENV)/dist .
	test -x $(WHEEL_VENV)/bin/python || $(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip uninstall --quiet --yes vcga || true
	$(WHEEL_VENV)/bin/python scripts/venv_install.py $(CONSTRAINTS) $(WHEEL_VENV)/dist/vcga-*.whl
	$(WHEEL_VENV)/bin/python -m compileall -qq -j 0 $(WHEEL_VENV)/lib || true

# Two pytest workers (pytest-xdist), each test module on one of them (its module-scoped worlds are
# made once): while one worker's test waits (a timeout it provokes, a subprocess starting), the
# other's runs. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# ruff (style, bugs, import order) over the whole repository, as `ruff check .` sees it, and mypy
# (types) over the library; settings in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

verify: $(STAMP)
	$(VENV)/bin/vcga verify

clean:
	rm -rf $(VENV) $(WHEEL_VENV) build *.egg-info .pytest_cache
