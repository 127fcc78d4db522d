//go:build cgo

// Command capi is tensorrpc's C ABI. Build it with
//
//	go build -buildmode=c-shared -o libtensorrpc.so ./shim/capi
//
// which also writes libtensorrpc.h, the declarations of the functions below;
// tensorrpc.h (in this directory) holds the types. shim/README.md documents
// the functions and the ownership rules.
//
// cgo's pointer rules shape the design: C never holds a Go pointer. Servers,
// clients, tensors and handler replies are named by integer handles into
// tables (handles.go); received tensors are handed out as DLManagedTensors
// allocated with C.malloc whose data points into the pool's mmap'd memory
// (not Go heap memory) and whose deleter drops the handle's reference. Go
// reads the caller's tensor memory only during the call that passes it.
//
// The C ABI needs cgo: with CGO_ENABLED=0 this package has no files, and the
// library packages (rpc, zerocopy, mempool, verbs) build without it.
package main

// main is required by -buildmode=c-shared and never runs.
func main() {}
