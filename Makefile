# The two commands of the README's quick start. Each creates or refreshes .venv first, so both work
# on a fresh machine. The constraints file pins the CPU build of torch (pyproject keeps a range).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONSTRAINTS ?= constraints/cpu.txt

.PHONY: test verify venv clean bench

venv: $(STAMP)

# Re-install when the project's requirements or the pins change.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c $(CONSTRAINTS) -e '.[test]'
	@# pip compiles the bytecode of the ~14,000 installed modules one at a time (about 50 s of CPU:
	@# torch, ray, ...); compileall -j 0 does the same on every core. A file that does not compile
	@# (a package's Python 2 template) is skipped, as pip skips it.
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

# Two pytest workers (pytest-xdist), each test module on one of them (its module-scoped worlds are
# made once): while one worker's test waits (a timeout it provokes, a subprocess starting), the
# other's runs. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

verify: $(STAMP)
	$(VENV)/bin/vcga verify

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
