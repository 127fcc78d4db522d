// Package zerocopy describes tensors as views over memory: element types
// (DType), shapes, typed views without copies, and CRC32C checksums.
//
// # Basics
//
// A Tensor is a dtype, a shape and a contiguous, row-major byte slice:
//
//	w := make([]float32, 6)
//	t, err := zerocopy.FromSlice(w, 2, 3) // float32[2 3] over w's memory
//	v, err := zerocopy.View[float32](t)  // the same memory as []float32
//
// Constructors validate everything that could make a later access unsafe:
// unknown dtypes, negative dimensions, more than MaxRank dimensions,
// element-count and byte-count overflow, and a byte length that does not
// match the shape. Each is an error (test with errors.Is), never a panic.
//
// DType numbers are the wire numbers of proto/header.fbs and
// proto/tensorrpc.proto; names follow NumPy and PyTorch ("float32",
// "bfloat16", "torch.half", "<f4").
//
// # Caveats
//
// A Tensor does not own its memory. It is valid only while the memory it
// views is: for a tensor received from tensorrpc that means until its
// buffer is released to the pool; after that, the bytes may be reused for
// another tensor.
//
// View reinterprets memory in place. Writes through a view change the
// tensor, and a view of a bool tensor is only meaningful when every byte is
// 0 or 1 (bytes received from a peer are not checked). Float16 and BFloat16
// elements are viewed as their raw uint16 bits.
//
// Tensor bytes are little-endian on the wire and in memory; big-endian
// hosts are not supported.
package zerocopy
