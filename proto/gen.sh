#!/usr/bin/env bash
# Regenerates the Go code of proto/ with pinned generator versions.
#
#   protoc              3.21.12  (Debian bookworm: apt-get install protobuf-compiler)
#   flatc               2.0.8    (Debian bookworm: apt-get install flatbuffers-compiler)
#   protoc-gen-go       v1.36.12 (installed here from the Go module proxy)
#   protoc-gen-go-grpc  v1.6.2   (installed here from the Go module proxy)
#
# The output depends only on these versions and the schemas, so CI runs this
# script and fails when the committed code differs.
set -euo pipefail
cd "$(dirname "$0")"

want_protoc="libprotoc 3.21.12"
want_flatc="flatc version 2.0.8"
PROTOC_GEN_GO=v1.36.12
PROTOC_GEN_GO_GRPC=v1.6.2

check() {
  local tool=$1 want=$2 pkg=$3 got
  command -v "$tool" >/dev/null || { echo "gen.sh: $tool not found; install Debian's $pkg" >&2; exit 1; }
  got=$("$tool" --version)
  [ "$got" = "$want" ] || { echo "gen.sh: need '$want', have '$got' (Debian bookworm's $pkg)" >&2; exit 1; }
}
check protoc "$want_protoc" protobuf-compiler
check flatc "$want_flatc" flatbuffers-compiler

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
GOBIN=$bin go install google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO
GOBIN=$bin go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC

rm -rf tensorrpcpb wirefb
mkdir -p tensorrpcpb
PATH=$bin:$PATH protoc -I . \
  --go_out=tensorrpcpb --go_opt=paths=source_relative \
  --go-grpc_out=tensorrpcpb --go-grpc_opt=paths=source_relative \
  tensorrpc.proto
flatc --go --go-namespace wirefb -o . header.fbs
gofmt -w tensorrpcpb wirefb
