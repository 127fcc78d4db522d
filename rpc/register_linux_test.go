package rpc_test

import (
	"bytes"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// remap maps n fresh bytes at addr (nil: anywhere), filled with seed's
// pattern.
func remap(t *testing.T, addr unsafe.Pointer, n int, seed byte) []byte {
	t.Helper()
	var b []byte
	if addr == nil {
		m, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		b = m
	} else {
		p, err := unix.MmapPtr(-1, 0, addr, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED)
		if err != nil {
			t.Fatal(err)
		}
		b = unsafe.Slice((*byte)(p), n)
	}
	pattern(b, seed)
	return b
}

// TestStaleRegistrationNeverUsed: memory sent (and fetched Into) once,
// then freed and mapped again at the same address with other contents,
// sends and receives its new contents: whatever a registration cache kept
// of the first mapping is not used. With and without Register.
func TestStaleRegistrationNeverUsed(t *testing.T) {
	for _, tr := range rowsPlanes {
		for _, explicit := range []bool{false, true} {
			t.Run(tr+map[bool]string{false: "/cached", true: "/registered"}[explicit], func(t *testing.T) {
				s, c := pair(t, tr, nil, nil)
				const n = 1 << 20
				b := remap(t, nil, n, 1)
				addr := unsafe.Pointer(&b[0])
				for round, seed := range []byte{1, 2} {
					if round > 0 {
						if err := unix.Munmap(b); err != nil {
							t.Fatal(err)
						}
						if b = remap(t, addr, n, seed); unsafe.Pointer(&b[0]) != addr {
							t.Fatalf("remapped at %p, not %p", &b[0], addr)
						}
					}
					w := rpc.WrapTensor(mustTensor(zerocopy.Uint8, []int64{n}, b))
					if explicit {
						if err := c.Register(w); err != nil {
							t.Fatal(err)
						}
					}
					if err := c.Send(ctxT(t), "k", w); err != nil {
						t.Fatalf("round %d: Send: %v", round, err)
					}
					got, err := s.Fetch(ctxT(t), "k")
					if err != nil {
						t.Fatal(err)
					}
					same := bytes.Equal(got.Bytes(), b)
					got.Release()
					if !same {
						t.Fatalf("round %d: the server got other bytes than the memory holds now", round)
					}
					// And into it: the server's tensor of the other pattern.
					other := publishBytes(t, s, "back", n, seed+10)
					if _, err := c.Fetch(ctxT(t), "back", rpc.Into(w)); err != nil {
						t.Fatalf("round %d: Fetch Into: %v", round, err)
					}
					if !bytes.Equal(b, other) {
						t.Fatalf("round %d: Fetch Into did not land in the memory mapped now", round)
					}
					if explicit {
						if err := c.Deregister(w); err != nil {
							t.Fatal(err)
						}
						if err := c.Deregister(w); status.Code(err) != codes.NotFound {
							t.Fatalf("a second Deregister: %v, want NotFound", err)
						}
					}
				}
				unix.Munmap(b)
			})
		}
	}
}
