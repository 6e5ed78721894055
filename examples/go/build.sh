#!/usr/bin/env bash
# Generates Go stubs from protos/opentinker/v1/*.proto and builds the example, in GOPATH mode against
# Debian's Go packages (/usr/share/gocode): no module proxy, nothing downloaded. The stubs are build
# outputs (build/go/src), regenerated every time so that the example always compiles against the current
# contract. Result: build/go/bin/opentinker-go-example.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/build/go

missing=()
for tool in go protoc protoc-gen-go protoc-gen-go-grpc; do
	command -v "$tool" >/dev/null || missing+=("$tool")
done
for package in google.golang.org/grpc google.golang.org/genproto/googleapis/rpc/errdetails google.golang.org/protobuf; do
	[[ -d /usr/share/gocode/src/$package ]] || missing+=("$package")
done
if ((${#missing[@]})); then
	echo "missing: ${missing[*]}; install them with examples/go/install-deps.sh (Debian 12)" >&2
	exit 3
fi

gen=$out/src/github.com/opentinker/opentinker/gen/go/opentinker/v1
rm -rf "$gen"
mkdir -p "$gen" "$out/bin"
protoc -I"$root/protos" --go_out="$out/src" --go-grpc_out="$out/src" "$root"/protos/opentinker/v1/*.proto

export GO111MODULE=off GOPATH="$out:/usr/share/gocode" GOPROXY=off GOFLAGS=
# The user's build cache (shared by every checkout, so a fresh clone builds in seconds), else one in build/.
[[ -n ${GOCACHE:-} || -n ${XDG_CACHE_HOME:-} || -n ${HOME:-} ]] || export GOCACHE=$out/cache
cd "$root/examples/go"
go vet .
go test .
go build -o "$out/bin/opentinker-go-example" .
echo "built $out/bin/opentinker-go-example"
