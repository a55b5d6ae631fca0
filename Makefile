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

# HAProxy from Debian's packages, unpacked under .deps/haproxy (downloaded, not installed: no
# root), for the test of the front over gateway replicas (tests/control/test_gateway_front.py,
# docs/gateway-front.md).
HAPROXY := .deps/haproxy/usr/sbin/haproxy
HAPROXY_DEBS := haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1
$(HAPROXY):
	rm -rf .deps/debs && mkdir -p .deps/debs
	cd .deps/debs && (apt-get download $(HAPROXY_DEBS) || \
		($(SUDO) apt-get update -q && apt-get download $(HAPROXY_DEBS)))
	for deb in .deps/debs/*.deb; do dpkg-deb -x $$deb .deps/haproxy; done

test: $(STAMP) /usr/bin/chromedriver $(HAPROXY)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check flexpipe tests bench
	$(VENV)/bin/ruff format --check flexpipe tests bench
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
