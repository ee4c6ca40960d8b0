# cryobox: everything a fresh Debian 12 machine needs, and the jobs that use it.
#   make demo   installs what is missing, builds the guest image, boots a sandbox and uses it
#   make test   the same installs, then lint, types and the whole test suite (real VMs)
# Both are idempotent: packages, the virtualenv and the image are only made when missing.

VENV      ?= .venv
PYTHON    := $(VENV)/bin/python
CRYOBOX   := $(VENV)/bin/cryobox
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Host tools: QEMU (without its GUI), the image build chain (gcc and jansson compile the
# guest agent's front, src/cryobox/guest/front.c; libfuse3 its volume mount, volume.c, and
# pkg-config with it the host's pyfuse3, which serves RAM arriving from the store).
# The sandbox network: namespaces and veth links (iproute2), nsenter (util-linux), nftables.
# PostgreSQL: the tests of the multi-host server start one in a temporary folder.
# Chromium: the web console's browser test drives it (Playwright, from PyPI).
# Templates from container images (cryobox.image.oci): skopeo reads the archive, umoci
# unpacks its layers, patchelf points the runtime cryobox carries into them at its own libraries.
# libnss-myhostname: names under localhost resolve to the loopback, as on a systemd
# machine (E2B's SDKs given E2B_DOMAIN=e2b.localhost:PORT, tests/compat/test_e2b_domain.py).
APT_PACKAGES := qemu-system-x86 qemu-utils e2fsprogs kmod cpio busybox-static ca-certificates conntrack \
                gcc libc6-dev libjansson-dev libfuse3-dev pkg-config clang-format skopeo umoci patchelf \
                iproute2 util-linux nftables postgresql chromium libnss-myhostname
APT_STAMP := $(VENV)/.apt-done
PIP_STAMP := $(VENV)/.pip-done
# The web console's browser libraries (xterm.js), pinned by console/package-lock.json.
CONSOLE_VENDOR := src/cryobox/server/console/vendor
XTERM := console/node_modules/@xterm
# E2B's JavaScript SDK for tests/compat/test_e2b_js.py, pinned by its lock file.
JS_E2B := tests/compat/js

.PHONY: setup image demo test lint unit bench bench-smoke bench-fleet bench-processes torture soak clean

setup: $(APT_STAMP) $(PIP_STAMP) $(CONSOLE_VENDOR)/.done $(JS_E2B)/node_modules/.done
	@# Bytecode for our own modules (an editable install has none, and a shell with
	@# PYTHONDONTWRITEBYTECODE never writes it): each supervisor's start, one per sandbox,
	@# would compile them again. Checked against the sources' times: never stale.
	@$(PYTHON) -m compileall -q src/cryobox

$(APT_STAMP): Makefile
	@# (installed, not merely known: a package removed keeps its configuration and dpkg -s)
	@missing=""; for p in $(APT_PACKAGES) mmdebstrap; do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || \
	    missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	    echo "installing Debian packages:$$missing"; \
	    $(SUDO) apt-get update -qq && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_PACKAGES) && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap; \
	fi
	@apt-cache policy linux-image-amd64 | grep -q 'Candidate: [0-9]' || $(SUDO) apt-get update -qq
	@# libnss-myhostname adds itself to nsswitch.conf; a hosts line kept by hand may lack it.
	@grep -qE '^hosts:.*[[:space:]]myhostname' /etc/nsswitch.conf || \
	    $(SUDO) sed -i -E 's/^(hosts:[[:space:]]+files)/\1 myhostname/' /etc/nsswitch.conf
	@mkdir -p $(VENV) && touch $@

$(PIP_STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q -e '.[dev]'
	@touch $@

$(CONSOLE_VENDOR)/.done: console/package-lock.json
	@command -v npm >/dev/null || $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm
	cd console && npm ci --no-audit --no-fund --silent
	mkdir -p $(CONSOLE_VENDOR)
	cp $(XTERM)/xterm/lib/xterm.js $(XTERM)/xterm/css/xterm.css $(XTERM)/addon-fit/lib/addon-fit.js $(CONSOLE_VENDOR)/
	cp $(XTERM)/xterm/LICENSE $(CONSOLE_VENDOR)/LICENSE.xterm
	@touch $@

$(JS_E2B)/node_modules/.done: $(JS_E2B)/package-lock.json
	@command -v npm >/dev/null || $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm
	cd $(JS_E2B) && npm ci --no-audit --no-fund --silent
	@touch $@

image: setup
	$(CRYOBOX) image build

demo: image
	$(PYTHON) examples/demo.py

lint: setup
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	clang-format --dry-run --Werror src/cryobox/guest/front.c src/cryobox/guest/init.c src/cryobox/guest/volume.c

unit: setup
	$(VENV)/bin/pytest -q tests/unit

# Two pytest-xdist workers: the VM tests in order on one, the unit tests beside them on the
# other (tests/conftest.py, pytest_xdist_make_scheduler). A short folder of the run's own for
# the tests' temporary folders: a sandbox's unix sockets under them must stay within 107
# bytes. Kept when a test failed, to look into.
test: image lint
	@temp=$$(mktemp -d /tmp/cbt-XXXXXX) && \
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --basetemp=$$temp --durations=25 tests; \
	status=$$?; [ $$status -ne 0 ] || rm -rf $$temp; exit $$status

bench: image
	$(PYTHON) -m pip install -q -e ".[dev,bench]"
	$(CRYOBOX) bench --json bench.json --plot docs/bench.png --markdown docs/BENCHMARKS.md

# Every benchmark scenario once, with small counts (never judged on timing): that they run.
bench-smoke: image
	$(PYTHON) -m pip install -q -e ".[dev,bench]"
	$(CRYOBOX) bench --quick

# Three servers on one PostgreSQL and one store: a resume on another host against one on
# the same host, and placement (docs/BENCHMARKS.md).
bench-fleet: image
	$(PYTHON) tests/run_fleet_bench.py

# A process checkpoint (CRIU in the guest) of a Python process holding 200 MB, against a
# whole-machine checkpoint of the same sandbox (docs/BENCHMARKS.md).
bench-processes: image
	$(PYTHON) tests/run_process_bench.py

# Several processes on one store and on the server's database (SQLite, PostgreSQL), killed
# at random with -9, for minutes; nothing acknowledged may be lost (docs/BENCHMARKS.md).
TORTURE_SECONDS ?= 300
torture: setup
	TORTURE_SECONDS=$(TORTURE_SECONDS) $(PYTHON) tests/run_torture.py

# Hours of pause/resume, rollback and fork cycles, beside a server under load whose
# supervisors are killed with -9 (docs/BENCHMARKS.md has a 30-minute run).
SOAK_MINUTES ?= 30
soak: image
	$(CRYOBOX) soak --minutes $(SOAK_MINUTES) --json soak.json

clean:
	rm -rf $(VENV) build src/*.egg-info
