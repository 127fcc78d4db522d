//go:build !linux

package gpudirect

import "fmt"

func mapP2PFile(path string, size int) ([]byte, error) {
	return nil, fmt.Errorf("%w: p2pmem is a Linux interface", ErrUnavailable)
}

func unmapP2P(mem []byte) error { return nil }
