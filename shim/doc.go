// Package shim is tensorrpc's integration with ML frameworks; it holds no
// Go API of its own. Its parts:
//
//   - capi: the C ABI. go build -buildmode=c-shared -o libtensorrpc.so
//     ./shim/capi builds libtensorrpc.so and libtensorrpc.h.
//   - python/tensorrpc: the Python package, a ctypes binding of the C ABI
//     that takes and returns NumPy arrays and PyTorch tensors without
//     copies (DLPack, __array_interface__), and CUDA tensors (DLPack
//     kDLCUDA; staged through host memory by the library).
//   - examples/ddp_train.py: PyTorch processes, launched by torchrun, training data-parallel
//     with gradients exchanged through tensorrpc (on the CPU, or on GPUs
//     with --device cuda).
//   - examples/kvcache.py: a paged KV cache between a prefill and a decode
//     process, its blocks fetched by rows into the decode side's arrays
//     and written back with send_rows.
//   - internal/gopeer: the Go peer of the cross-language tests and of the
//     Go-to-Go benchmark.
//
// shim_test.go builds the library, runs a C program against it and runs
// the Python tests (python/tests) with /usr/bin/python3; it skips, saying
// what is missing, when Python, NumPy or PyTorch is not installed. See
// README.md for the install command and the API.
package shim
