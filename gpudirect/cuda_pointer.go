package gpudirect

// CUDAPointer returns the device address of b's first byte and its
// device's ordinal when b is a buffer of a CUDAAllocator, so that a caller
// can hand the memory to another CUDA user (a DLPack kDLCUDA tensor, say).
// ok is false for other buffers and for a freed one.
func CUDAPointer(b DeviceBuffer) (ordinal int, ptr uint64, ok bool) {
	cb, isCUDA := b.(*cudaBuffer)
	if !isCUDA || cb.freed.Load() {
		return 0, 0, false
	}
	return cb.alloc.dev.Ordinal, cb.alloc.base + uint64(cb.off), true
}
