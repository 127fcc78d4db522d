//go:build !(linux && cgo)

package gpudirect

import (
	"fmt"
	"runtime"
)

// builtWithCUDALoader is true when LoadCUDA can dlopen a driver.
const builtWithCUDALoader = false

// openCUDA always fails: the CUDA driver is reached through dlopen, which
// needs cgo on Linux.
func openCUDA(path string) (cudaAPI, error) {
	if runtime.GOOS != "linux" {
		return nil, fmt.Errorf("%w: CUDA support is built for Linux only; using host staging", ErrUnavailable)
	}
	return nil, fmt.Errorf("%w: built without cgo: CUDA (%s) cannot be loaded; using host staging", ErrUnavailable, path)
}
