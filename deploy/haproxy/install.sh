#!/usr/bin/env bash
# Installs Debian's haproxy (2.6 in Debian 12) where it is absent: the HAProxy fleet test needs it. Used by
# `make haproxy`, which `make test` runs first. Exits non-zero, saying why, when it cannot be installed.
set -euo pipefail
if command -v haproxy >/dev/null; then
	exit 0
fi
if ! command -v apt-get >/dev/null; then
	echo "make haproxy: no apt-get here; install HAProxy >= 2.4 (https://www.haproxy.org) and rerun" >&2
	exit 1
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
	command -v sudo >/dev/null || { echo "make haproxy: need root or sudo for apt-get install haproxy" >&2; exit 1; }
	sudo=(sudo)
fi
echo "make haproxy: installing Debian's haproxy"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends haproxy >/dev/null
