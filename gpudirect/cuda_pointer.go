package gpudirect

// CUDAPointer returns the device address of b's first byte and its
// device's ordinal when b is CUDA memory (an allocator's buffer, a wrapped
// or an opened IPC range), so that a caller can hand the memory to another
// CUDA user (a DLPack kDLCUDA tensor, say). ok is false for other buffers
// and for a freed one.
func CUDAPointer(b DeviceBuffer) (ordinal int, ptr uint64, ok bool) {
	m, isCUDA := b.(interface {
		devicePointer() (uint64, bool)
		Device() string
	})
	if !isCUDA {
		return 0, 0, false
	}
	p, live := m.devicePointer()
	if !live {
		return 0, 0, false
	}
	switch x := b.(type) {
	case *cudaAsyncBuffer:
		return x.dev, p, true
	case *cudaBuffer:
		return x.alloc.dev.Ordinal, p, true
	case *cudaRange:
		return x.dev.Ordinal, p, true
	}
	return 0, 0, false
}
