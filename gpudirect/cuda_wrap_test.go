//go:build linux && cgo

package gpudirect

import (
	"bytes"
	"errors"
	"testing"
)

// TestCUDAWrap wraps device memory by address (here: a buffer of the
// library's own allocator, whose address CUDAPointer gives) and moves
// bytes through both descriptions of it, on the fake driver.
func TestCUDAWrap(t *testing.T) {
	c, err := LoadCUDA(WithCUDALibrary(buildFakeCUDA(t)))
	if err != nil {
		t.Fatal(err)
	}
	a, err := c.NewAllocator(0, 1<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := a.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	ordinal, ptr, ok := CUDAPointer(b)
	if !ok || ordinal != 0 || ptr == 0 {
		t.Fatalf("CUDAPointer: %d, %#x, %v", ordinal, ptr, ok)
	}
	hb, err := NewHostAllocator().Alloc(8)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := CUDAPointer(hb); ok {
		t.Error("CUDAPointer of a host-fake buffer")
	}
	hb.Free()
	w, err := c.Wrap(0, ptr+1024, 1000)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("wrap"), 250)
	if err := w.CopyFromHost(payload, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1000)
	if err := b.CopyToHost(got, 1024); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("read through the allocator's buffer: %v, equal %v", err, bytes.Equal(got, payload))
	}
	if err := w.CopyToHost(make([]byte, 8), 996); err == nil {
		t.Error("copy past the wrapped range")
	}
	if err := w.Free(); err != nil {
		t.Fatal(err)
	}
	if err := w.CopyToHost(got, 0); !errors.Is(err, ErrFreed) {
		t.Errorf("copy after Free: %v", err)
	}
	if _, err := c.Wrap(3, ptr, 8); err == nil {
		t.Error("Wrap on a missing device")
	}
	b.Free()
	if _, _, ok := CUDAPointer(b); ok {
		t.Error("CUDAPointer of a freed buffer")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}
