// Package tensorfb is the FlatBuffers code generated from tensor.fbs: the
// tensor message of the benchmark suite's FlatBuffers baseline.
//
// Run `go generate ./benchmarks/internal/tensorfb` to regenerate it.
package tensorfb

//go:generate bash gen.sh
