# The two set-up commands of the README.  Each installs what it needs first (idempotent).
PY ?= python3

.PHONY: install demo test web
install:
	bash scripts/install.sh

demo: install
	$(PY) -m apps.job

test: install
	$(PY) -m pytest -q tests

# the web demo (not a set-up command): http://127.0.0.1:8765/
web: install
	$(PY) apps/web/app.py
