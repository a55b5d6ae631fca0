# Every target sets up .venv by itself and is quick when nothing changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run demo test lint bench typecheck clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/flexpipe up

demo: $(STAMP)
	$(VENV)/bin/flexpipe up --demo

# Debian's chromium and its driver, for the dashboard's browser test (tests/ui/test_ui_browser.py);
# the driver is found at /usr/bin/chromedriver, so selenium downloads nothing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
/usr/bin/chromedriver:
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver

# Debian's redis-server, for the gateway replicas' tests (tests/gateway/test_gateway_replicas.py)
/usr/bin/redis-server:
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server

test: $(STAMP) /usr/bin/chromedriver /usr/bin/redis-server
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check flexpipe tests bench
	$(VENV)/bin/ruff format --check flexpipe tests bench
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
