package shm

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/bytesize"
	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

var benchSizes = []int{64, 4 << 10, 1 << 20, 16 << 20}

func sizeName(n int) string { return strings.ReplaceAll(bytesize.Format(int64(n)), " ", "") }

// BenchmarkWrite posts one Write at a time into the peer's region and waits
// for its completion: the one copy plus the posting and completion path.
func BenchmarkWrite(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(sizeName(size), func(b *testing.B) {
			a, t, closeAll := connected(b, size)
			defer closeAll()
			pattern(a.mr.Bytes(), 1)
			benchOneAtATime(b, a, t, verbs.OpWrite, size)
		})
	}
}

// benchOneAtATime posts op of size bytes between a's and t's regions, one
// at a time, waiting for each completion, b.N times after one untimed post
// that maps the region and faults its pages in.
func benchOneAtATime(b *testing.B, a, t *end, op verbs.Opcode, size int) {
	b.Helper()
	wr := verbs.SendRequest{Op: op, Local: verbs.Local{Region: a.mr, Length: size}, Remote: verbs.Remote{Addr: t.mr.Addr(), Key: t.mr.RemoteKey()}}
	ctx := context.Background()
	cs := make([]verbs.Completion, 1)
	post := func() {
		if err := a.qp.PostSend(wr); err != nil {
			b.Fatal(err)
		}
		if _, err := a.cq.Wait(ctx, cs); err != nil {
			b.Fatal(err)
		}
		if cs[0].Status != verbs.StatusSuccess {
			b.Fatal(verbs.CompletionError(cs[0]))
		}
	}
	post()
	b.SetBytes(int64(size))
	b.ResetTimer()
	for range b.N {
		post()
	}
}

// BenchmarkMemcpy is the ceiling of BenchmarkWrite: a single-threaded copy
// of the same size between two buffers.
func BenchmarkMemcpy(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(sizeName(size), func(b *testing.B) {
			src, dst := make([]byte, size), make([]byte, size)
			pattern(src, 1)
			copy(dst, src)
			b.SetBytes(int64(size))
			b.ResetTimer()
			for range b.N {
				copy(dst, src)
			}
		})
	}
}

// BenchmarkMemcpyMemfd is BenchmarkMemcpy on the Write's own medium: from
// one sealed memfd mapping into a second mapping of another, as the
// initiator sees the peer's region. Without transparent huge pages for
// shmem these are 4 KiB pages, unlike the Go heap.
func BenchmarkMemcpyMemfd(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(sizeName(size), func(b *testing.B) {
			src := sealedMemory(b, size)
			dst := sealedMemory(b, size)
			mapping, view, err := mapFD(dst.FD, 0, uint64(size), true)
			if err != nil {
				b.Fatal(err)
			}
			defer unix.Munmap(mapping)
			pattern(src.Bytes, 1)
			copy(view, src.Bytes)
			b.SetBytes(int64(size))
			b.ResetTimer()
			for range b.N {
				copy(view, src.Bytes)
			}
		})
	}
}

// controlPaths are the ways control messages can travel, for benchmarks
// that compare them in one run: the shared rings (with the default spin, a
// shorter one and none) and the unix socket, as before the rings.
var controlPaths = []struct {
	name string
	opts []Option
}{
	{"ctl=ring", nil},
	{"ctl=ring-nospin", []Option{withRingSpin(0)}},
	{"ctl=ring-spin5us", []Option{withRingSpin(5 * time.Microsecond)}},
	{"ctl=socket", []Option{withSocketControl()}},
}

// BenchmarkSendRecvRoundTrip bounces a 64-byte Send between two queue
// pairs: one op is a Send there and a Send back.
func BenchmarkSendRecvRoundTrip(b *testing.B) {
	for _, cp := range controlPaths {
		b.Run(cp.name, func(b *testing.B) { benchSendRecvRoundTrip(b, cp.opts...) })
	}
}

func benchSendRecvRoundTrip(b *testing.B, opts ...Option) {
	const size = 64
	a, t, closeAll := connected(b, 4096, opts...)
	defer closeAll()
	send := func(e *end) error {
		return e.qp.PostSend(verbs.SendRequest{Op: verbs.OpSend, Local: verbs.Local{Region: e.mr, Length: size}})
	}
	recv := func(e *end) error {
		return e.qp.PostRecv(verbs.RecvRequest{Local: verbs.Local{Region: e.mr, Offset: 2048, Length: size}})
	}
	// waitRecv waits for e's next receive, reaping send completions.
	waitRecv := func(ctx context.Context, e *end) error {
		cs := make([]verbs.Completion, 4)
		for {
			n, err := e.cq.Wait(ctx, cs)
			if err != nil {
				return err
			}
			got := false
			for _, c := range cs[:n] {
				if err := verbs.CompletionError(c); err != nil {
					return err
				}
				got = got || c.Op == verbs.OpRecv
			}
			if got {
				return nil
			}
		}
	}
	for _, e := range []*end{a, t} {
		for range 4 {
			if err := recv(e); err != nil {
				b.Fatal(err)
			}
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	echoed := make(chan error, 1)
	go func() {
		for {
			if err := waitRecv(ctx, t); err != nil {
				echoed <- err
				return
			}
			if err := recv(t); err != nil {
				echoed <- err
				return
			}
			if err := send(t); err != nil {
				echoed <- err
				return
			}
		}
	}()
	defer func() {
		cancel()
		<-echoed
	}()
	b.ResetTimer()
	for range b.N {
		if err := send(a); err != nil {
			b.Fatal(err)
		}
		if err := waitRecv(ctx, a); err != nil {
			b.Fatal(err)
		}
		if err := recv(a); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkUnixSocketRoundTrip is the floor under BenchmarkSendRecvRoundTrip
// with ctl=socket on this machine: one control-message-sized datagram there
// and back over a unixpacket socket between two goroutines. A Send/Recv
// round trip costs two Sends, each a doorbell and an ack.
func BenchmarkUnixSocketRoundTrip(b *testing.B) {
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: "@tensorrpc-shm-bench-" + fmt.Sprint(time.Now().UnixNano()), Net: "unixpacket"})
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, messageSize)
		for {
			n, err := c.Read(buf)
			if err != nil || n == 0 {
				return
			}
			if _, err := c.Write(buf[:n]); err != nil {
				return
			}
		}
	}()
	c, err := net.DialUnix("unixpacket", nil, ln.Addr().(*net.UnixAddr))
	if err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, messageSize)
	b.ResetTimer()
	for range b.N {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := c.Read(buf); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	c.Close()
	<-done
}

// BenchmarkWriteImm posts one 64-byte WriteImm at a time and waits for its
// completion at the initiator, which comes with the target's ack: one op is
// a copy, a doorbell to the target, a Recv consumed there and an ack back.
// A goroutine at the target reaps its receive completions and reposts.
func BenchmarkWriteImm(b *testing.B) {
	for _, cp := range controlPaths {
		b.Run(cp.name, func(b *testing.B) { benchWriteImm(b, cp.opts...) })
	}
}

func benchWriteImm(b *testing.B, opts ...Option) {
	const size = 64
	a, t, closeAll := connected(b, 4096, opts...)
	defer closeAll()
	recv := func() error {
		return t.qp.PostRecv(verbs.RecvRequest{Local: verbs.Local{Region: t.mr, Length: 0}})
	}
	for range 64 {
		if err := recv(); err != nil {
			b.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	reaped := make(chan error, 1)
	go func() {
		cs := make([]verbs.Completion, 16)
		for {
			n, err := t.cq.Wait(ctx, cs)
			if err != nil {
				reaped <- err
				return
			}
			for _, c := range cs[:n] {
				if err := verbs.CompletionError(c); err != nil {
					reaped <- err
					return
				}
				if err := recv(); err != nil {
					reaped <- err
					return
				}
			}
		}
	}()
	defer func() {
		cancel()
		<-reaped
	}()
	wr := verbs.SendRequest{Op: verbs.OpWriteImm, Imm: 7, Local: verbs.Local{Region: a.mr, Length: size}, Remote: verbs.Remote{Addr: t.mr.Addr() + 1024, Key: t.mr.RemoteKey()}}
	cs := make([]verbs.Completion, 1)
	post := func() {
		if err := a.qp.PostSend(wr); err != nil {
			b.Fatal(err)
		}
		if _, err := a.cq.Wait(ctx, cs); err != nil {
			b.Fatal(err)
		}
		if err := verbs.CompletionError(cs[0]); err != nil {
			b.Fatal(err)
		}
	}
	post() // map the region
	b.ResetTimer()
	for range b.N {
		post()
	}
}

// BenchmarkCopyWorkers is BenchmarkWrite and a Read of the same sizes with
// one copy goroutine and with WithCopyWorkers' default (GOMAXPROCS): how
// much a second core buys one large transfer, to choose the threshold.
func BenchmarkCopyWorkers(b *testing.B) {
	for _, op := range []verbs.Opcode{verbs.OpWrite, verbs.OpRead} {
		for _, size := range []int{4 << 20, 8 << 20, 16 << 20, 64 << 20} {
			for _, workers := range []int{1, 0} {
				name := fmt.Sprintf("%v/%s/workers=%d", op, sizeName(size), workers)
				if workers == 0 {
					name = fmt.Sprintf("%v/%s/workers=default", op, sizeName(size))
				}
				b.Run(name, func(b *testing.B) {
					var opts []Option
					if workers > 0 {
						opts = append(opts, WithCopyWorkers(workers))
					}
					a, t, closeAll := connected(b, size, opts...)
					defer closeAll()
					benchOneAtATime(b, a, t, op, size)
				})
			}
		}
	}
}
