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

# HAProxy and nginx from Debian's packages, unpacked under .deps/ (downloaded, not installed:
# no root), for the test of the fronts over gateway replicas (tests/control/test_gateway_front.py,
# docs/gateway-front.md).
HAPROXY := .deps/haproxy/usr/sbin/haproxy
NGINX := .deps/nginx/usr/sbin/nginx
# $(call unpack,NAME,PACKAGES): download PACKAGES and unpack them into .deps/NAME
unpack = rm -rf .deps/debs-$(1) && mkdir -p .deps/debs-$(1) && cd .deps/debs-$(1) && \
	(apt-get download $(2) || ($(SUDO) apt-get update -q && apt-get download $(2))) && \
	for deb in *.deb; do dpkg-deb -x $$deb ../$(1); done
$(HAPROXY):
	$(call unpack,haproxy,haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1)
$(NGINX):
	$(call unpack,nginx,nginx)

# Debian's redis-server, for the gateway replicas' tests (tests/gateway/test_gateway_replicas.py)
/usr/bin/redis-server:
	$(SUDO) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server

# Two pytest workers (most tests wait on real processes, not on the CPU), then the "solo" tests
# alone: wall-clock measurements whose bounds would not hold beside another test's processes.
TEST_WORKERS ?= 2
test: $(STAMP) /usr/bin/chromedriver /usr/bin/redis-server $(HAPROXY) $(NGINX)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not solo"
	$(PY) -m pytest -q -m solo

lint: $(STAMP)
	$(VENV)/bin/ruff check flexpipe tests bench
	$(VENV)/bin/ruff format --check flexpipe tests bench
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
