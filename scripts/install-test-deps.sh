#!/usr/bin/env bash
# Installs what the test suite needs beyond Python packages: Debian's `prometheus` (tests/deploy
# scrape a real server with it). Uses apt-get as root or through sudo; otherwise it says what to run
# and lets the rest of the suite go on.
set -euo pipefail
command -v prometheus >/dev/null 2>&1 && exit 0
if command -v apt-get >/dev/null 2>&1; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo="sudo"
        else
            echo "warning: tests/deploy need Prometheus: run 'sudo apt-get install prometheus' (those tests fail without it)" >&2
            exit 0
        fi
    fi
    echo "installing Debian's prometheus for tests/deploy" >&2
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
else
    echo "warning: tests/deploy need a 'prometheus' binary on PATH (https://prometheus.io/download/); they fail without it" >&2
    exit 0
fi
