//go:build !(linux && cgo && rdma)

package main

// builtWithRDMA reports whether verbs/ibv was compiled against libibverbs
// (the same constraint as its real provider); here it is the stub.
const builtWithRDMA = false
