#!/usr/bin/env bash
# Installs Prometheus (the server and promtool) from Debian/Ubuntu's `prometheus` package,
# for tests/test_deploy.py. Idempotent: does nothing when both binaries are already on PATH.
# Does not leave a Prometheus daemon running: service start-up is blocked during the install.
set -euo pipefail

if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
  echo "prometheus: already installed ($(promtool --version 2>&1 | head -n1))"
  exit 0
fi

if ! command -v apt-get >/dev/null; then
  echo "prometheus: apt-get not found; install Prometheus (promtool and prometheus) by hand" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "prometheus: needs root (or sudo) to apt-get install" >&2
    exit 1
  fi
  SUDO="sudo"
fi

# NOTE: the package's post-install starts prometheus.service on :9090; a policy-rc.d that
# answers 101 ("action forbidden") keeps it from starting. An existing policy is left alone.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod +x "$POLICY"
  trap '$SUDO rm -f "$POLICY"' EXIT
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
echo "prometheus: installed ($(promtool --version 2>&1 | head -n1))"
