package gpudirect

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

// TestHostStreams: copies on a host-fake stream complete later, in order,
// when their event says so; a read before the event sees the old bytes.
func TestHostStreams(t *testing.T) {
	defer leakcheck.Check(t)
	a := NewHostAllocator(HostCopyDelay(20 * time.Millisecond))
	z := mustAlloc(t, a, 0)
	var _ AsyncBuffer = z.(AsyncBuffer)
	b := mustAlloc(t, a, 4096).(AsyncBuffer)
	st, err := b.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	src := bytes.Repeat([]byte{7}, 4096)
	if err := st.CopyFromHost(b, 0, src); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, 4096)
	if err := st.CopyToHost(dst, b, 0); err != nil {
		t.Fatal(err)
	}
	ev, err := st.Record()
	if err != nil {
		t.Fatal(err)
	}
	if done, _ := ev.Done(); done {
		t.Fatal("a delayed copy completed at once")
	}
	if err := ev.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("copies on a stream did not run in order")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st.CopyToHost(dst, b, 0)
	ev2, _ := st.Record()
	if err := ev2.Wait(ctx); !errors.Is(err, context.Canceled) && err != nil {
		t.Fatalf("Wait on a cancelled context: %v", err)
	}
	if err := st.CopyToHost(make([]byte, 10), b, 4090); err == nil {
		t.Fatal("a copy past the buffer was enqueued")
	}
	if err := st.Sync(); err != nil {
		t.Fatal(err)
	}
	if s := a.Stats(); s.Streams != 1 || s.StreamCopies != 3 || s.CopiesToHost != 2 {
		t.Fatalf("stats %+v", s)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if err := st.CopyToHost(dst, b, 0); err == nil {
		t.Fatal("a closed stream took a copy")
	}
	// A copy into a buffer freed before it ran fails the stream.
	st, _ = b.NewStream()
	c := mustAlloc(t, a, 64)
	st.CopyFromHost(c, 0, make([]byte, 64))
	c.Free()
	if err := st.Sync(); !errors.Is(err, ErrFreed) {
		t.Fatalf("copy into a freed buffer: %v", err)
	}
	// The allocator's Close ends the streams left open.
	if err := a.Close(); !errors.Is(err, ErrOutstanding) {
		t.Fatalf("Close with a stream and buffers: %v", err)
	}
	b.Free()
	z.Free()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestHostRegistrar: the registrar fails as the driver does.
func TestHostRegistrar(t *testing.T) {
	a := NewHostAllocator()
	b := mustAlloc(t, a, 1)
	defer b.Free()
	r := b.(AsyncBuffer).HostRegistrar()
	mem := make([]byte, 8192)
	if err := r.RegisterHost(mem[:4096]); err != nil {
		t.Fatal(err)
	}
	if err := r.RegisterHost(mem[4095:]); !errors.Is(err, errFakeRegistered) {
		t.Fatalf("overlapping registration: %v", err)
	}
	if err := r.RegisterHost(mem[4096:]); err != nil {
		t.Fatal(err)
	}
	if err := r.RegisterHost(nil); !errors.Is(err, errFakeInvalid) {
		t.Fatalf("empty registration: %v", err)
	}
	if err := r.UnregisterHost(mem[1:]); !errors.Is(err, errFakeNotRegistered) {
		t.Fatalf("unregistering an unknown start: %v", err)
	}
	if s := a.Stats(); s.Registered != 2 || s.Registrations != 2 {
		t.Fatalf("stats %+v", s)
	}
	r.UnregisterHost(mem[:4096])
	r.UnregisterHost(mem[4096:])
	if err := r.UnregisterHost(mem); !errors.Is(err, errFakeNotRegistered) {
		t.Fatalf("unregistering twice: %v", err)
	}
	if s := a.Stats(); s.Registered != 0 || s.Unregistrations != 2 || r.Name() != "host-fake" {
		t.Fatalf("stats %+v", s)
	}
}

func mustAlloc(t *testing.T, a *HostAllocator, n int) DeviceBuffer {
	t.Helper()
	b, err := a.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
