#!/usr/bin/env bash
# Installs the Debian 12 packages the Go example needs, only those missing (apt-get; root or sudo).
# Used by `make go-check` and .ci/run. Exits non-zero when they cannot be installed.
set -euo pipefail
packages=(
	golang-go                             # go 1.19
	protobuf-compiler                     # protoc 3.21
	protoc-gen-go                         # protoc-gen-go 1.28 (messages)
	protoc-gen-go-grpc                    # protoc-gen-go-grpc (services; from the grpc-go 1.33 source)
	golang-google-grpc-dev                # google.golang.org/grpc 1.33 under /usr/share/gocode
	golang-github-golang-protobuf-1-5-dev # github.com/golang/protobuf 1.5 + google.golang.org/protobuf
	golang-google-genproto-dev            # google.golang.org/genproto/googleapis/rpc/errdetails
)
missing=()
for package in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]} == 0)); then
	exit 0
fi
if ! command -v apt-get >/dev/null; then
	echo "install-deps: no apt-get here; install the equivalents of: ${missing[*]}" >&2
	exit 1
fi
sudo=()
if [[ $(id -u) != 0 ]]; then
	command -v sudo >/dev/null || { echo "install-deps: need root or sudo for apt-get" >&2; exit 1; }
	sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
