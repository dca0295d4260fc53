# The two set-up commands of the README.  Each installs what it needs first (idempotent).
PY ?= python3

.PHONY: install demo test
install:
	bash scripts/install.sh

demo: install
	$(PY) -m moonep_ops

test: install
	$(PY) -m pytest -q tests
