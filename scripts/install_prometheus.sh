#!/usr/bin/env bash
# Unpack (once) Debian's `prometheus` package into .cache/prometheus/ for the live tests of the oea_* series
# (a real Prometheus server scrapes a test server; `promtool check rules` checks docs/prometheus/oea-alerts.yml).
# `apt-get download` + `dpkg-deb -x`: nothing is installed system-wide, no root needed beyond apt's own cache
# reads, no service is started. Idempotent: binaries that already run are kept.
#
# Result: .cache/prometheus/bin/{prometheus,promtool}. Usage: bash scripts/install_prometheus.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.cache/prometheus"
BIN="$DEST/bin"

if "$BIN/prometheus" --version >/dev/null 2>&1 && "$BIN/promtool" --version >/dev/null 2>&1; then
    echo "install_prometheus: $("$BIN/prometheus" --version 2>&1 | head -1) already in $BIN"
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "install_prometheus: apt-get and dpkg-deb are needed (a Debian or Ubuntu machine)" >&2
    exit 1
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# apt drops privileges to _apt for the download; a folder it can write into avoids its warning
chmod 777 "$WORK"
# The package lists of the machine's image may name a version the mirror no longer has (a Debian point release
# replaces it): then the lists are refreshed once, where this user may (root), and the download asked again.
if ! (cd "$WORK" && apt-get download prometheus); then
    if [ "$(id -u)" = 0 ]; then
        echo "install_prometheus: apt-get download failed with this machine's package lists; apt-get update, then again"
        apt-get update -qq
    fi
    (cd "$WORK" && apt-get download prometheus) || {
        echo "install_prometheus: apt-get download prometheus failed; run apt-get update (as root), or check the apt sources" >&2
        exit 1
    }
fi
dpkg-deb -x "$WORK"/prometheus_*.deb "$WORK/root"
mkdir -p "$BIN"
install -m 0755 "$WORK/root/usr/bin/prometheus" "$WORK/root/usr/bin/promtool" "$BIN/"
"$BIN/prometheus" --version 2>&1 | head -1
"$BIN/promtool" --version 2>&1 | head -1
echo "install_prometheus: binaries in $BIN"
