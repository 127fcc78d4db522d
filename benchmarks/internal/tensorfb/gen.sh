#!/usr/bin/env bash
# Regenerates the Go code of the benchmark's FlatBuffers schema with the
# flatc that proto/gen.sh pins (2.0.8, Debian bookworm's flatbuffers-compiler).
set -euo pipefail
cd "$(dirname "$0")"
want="flatc version 2.0.8"
got=$(flatc --version)
[ "$got" = "$want" ] || { echo "gen.sh: need '$want', have '$got'" >&2; exit 1; }
rm -f Tensor.go FetchRequest.go
flatc --go --go-namespace tensorfb -o .. tensor.fbs
gofmt -w Tensor.go FetchRequest.go
