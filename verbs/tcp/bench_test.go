package tcp_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
	"github.com/tensorrpc/tensorrpc/verbs/verbstest"
)

var benchSizes = []struct {
	name string
	size int
}{
	{"64B", 64},
	{"4KiB", 4 << 10},
	{"1MiB", 1 << 20},
	{"16MiB", 16 << 20},
}

// benchPair is two connected queue pairs on one provider.
type benchPair struct {
	pdA, pdB   verbs.ProtectionDomain
	cqA, cqB   verbs.CompletionQueue
	qpA, qpB   verbs.QueuePair
	srcA, dstB verbs.MemoryRegion
	bufA, bufB verbs.MemoryRegion
	close      func()
}

func newBenchPair(tb testing.TB, size int) *benchPair {
	tb.Helper()
	p := tcp.New()
	bp := &benchPair{}
	var err error
	must := func(err error) {
		if err != nil {
			tb.Fatal(err)
		}
	}
	bp.pdA, err = p.Open("")
	must(err)
	bp.pdB, err = p.Open("")
	must(err)
	bp.cqA, err = bp.pdA.NewCompletionQueue(4096)
	must(err)
	bp.cqB, err = bp.pdB.NewCompletionQueue(4096)
	must(err)
	bp.qpA, err = bp.pdA.NewQueuePair(verbs.QueuePairConfig{SendCQ: bp.cqA, RecvCQ: bp.cqA})
	must(err)
	bp.qpB, err = bp.pdB.NewQueuePair(verbs.QueuePairConfig{SendCQ: bp.cqB, RecvCQ: bp.cqB})
	must(err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	must(verbstest.Connect(ctx, bp.qpA, bp.qpB))
	reg := func(pd verbs.ProtectionDomain, n int, a verbs.Access) verbs.MemoryRegion {
		mr, err := pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, n)}, a)
		must(err)
		return mr
	}
	bp.srcA = reg(bp.pdA, size, verbs.AccessLocalWrite)
	bp.dstB = reg(bp.pdB, size, verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead)
	bp.bufA = reg(bp.pdA, size, verbs.AccessLocalWrite)
	bp.bufB = reg(bp.pdB, size, verbs.AccessLocalWrite)
	bp.close = func() {
		bp.qpA.Close()
		bp.qpB.Close()
		bp.pdA.Close()
		bp.pdB.Close()
	}
	return bp
}

// waitOK waits for one successful completion.
func waitOK(tb testing.TB, cq verbs.CompletionQueue, out []verbs.Completion) int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	n, err := cq.Wait(ctx, out)
	if err != nil {
		tb.Fatal(err)
	}
	for _, c := range out[:n] {
		if c.Status != verbs.StatusSuccess {
			tb.Fatal(verbs.CompletionError(c))
		}
	}
	return n
}

// BenchmarkWrite measures Write throughput with up to 16 writes in flight.
func BenchmarkWrite(b *testing.B) {
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			bp := newBenchPair(b, s.size)
			defer bp.close()
			const depth = 16
			out := make([]verbs.Completion, depth)
			wr := verbs.SendRequest{Op: verbs.OpWrite,
				Local:  verbs.Local{Region: bp.srcA, Length: s.size},
				Remote: verbs.Remote{Addr: bp.dstB.Addr(), Key: bp.dstB.RemoteKey()}}
			b.SetBytes(int64(s.size))
			b.ResetTimer()
			posted, done := 0, 0
			for done < b.N {
				for posted < b.N && posted-done < depth {
					wr.ID = uint64(posted)
					if err := bp.qpA.PostSend(wr); err != nil {
						b.Fatal(err)
					}
					posted++
				}
				done += waitOK(b, bp.cqA, out)
			}
		})
	}
}

// BenchmarkRawTCP is BenchmarkWrite's ceiling: the same bytes copied over a
// plain loopback TCP socket into a sink that reads each message whole into
// a buffer of the message size.
func BenchmarkRawTCP(b *testing.B) {
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			w, r := rawPair(b)
			defer w.Close()
			defer r.Close()
			src := make([]byte, s.size)
			n := b.N
			sunk := make(chan error, 1)
			go func() {
				// Each message lands whole in the buffer, as a Write's
				// payload lands whole in its target region.
				buf := make([]byte, s.size)
				for range n {
					if _, err := io.ReadFull(r, buf); err != nil {
						sunk <- err
						return
					}
				}
				sunk <- nil
			}()
			b.SetBytes(int64(s.size))
			b.ResetTimer()
			for range b.N {
				if _, err := w.Write(src); err != nil {
					b.Fatal(err)
				}
			}
			if err := <-sunk; err != nil {
				b.Fatal(err)
			}
		})
	}
}

// BenchmarkSendLatency64B measures a 64-byte Send/Recv round trip.
func BenchmarkSendLatency64B(b *testing.B) {
	const size = 64
	bp := newBenchPair(b, size)
	defer bp.close()
	post := func(qp verbs.QueuePair, buf verbs.MemoryRegion) {
		if err := qp.PostRecv(verbs.RecvRequest{Local: verbs.Local{Region: buf, Length: size}}); err != nil {
			b.Fatal(err)
		}
	}
	post(bp.qpA, bp.bufA)
	post(bp.qpB, bp.bufB)
	echoed := make(chan error, 1)
	n := b.N
	go func() {
		out := make([]verbs.Completion, 4)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for i := 0; i < n; {
			k, err := bp.cqB.Wait(ctx, out)
			if err != nil {
				echoed <- err
				return
			}
			for _, c := range out[:k] {
				if c.Status != verbs.StatusSuccess {
					echoed <- verbs.CompletionError(c)
					return
				}
				if c.Op == verbs.OpRecv {
					i++
					if err := bp.qpB.PostRecv(verbs.RecvRequest{Local: verbs.Local{Region: bp.bufB, Length: size}}); err != nil {
						echoed <- err
						return
					}
					if err := bp.qpB.PostSend(verbs.SendRequest{Op: verbs.OpSend, Local: verbs.Local{Region: bp.bufB, Length: size}}); err != nil {
						echoed <- err
						return
					}
				}
			}
		}
		echoed <- nil
	}()
	out := make([]verbs.Completion, 4)
	b.ResetTimer()
	for range n {
		if err := bp.qpA.PostSend(verbs.SendRequest{Op: verbs.OpSend, Local: verbs.Local{Region: bp.srcA, Length: size}}); err != nil {
			b.Fatal(err)
		}
		for got := false; !got; {
			k := waitOK(b, bp.cqA, out)
			for _, c := range out[:k] {
				if c.Op == verbs.OpRecv {
					got = true
					post(bp.qpA, bp.bufA)
				}
			}
		}
	}
	b.StopTimer()
	if err := <-echoed; err != nil {
		b.Fatal(err)
	}
}

// BenchmarkRawTCPPingPong64B is the latency ceiling: a 64-byte round trip
// over a plain loopback socket.
func BenchmarkRawTCPPingPong64B(b *testing.B) {
	const size = 64
	c1, c2 := rawPair(b)
	defer c1.Close()
	defer c2.Close()
	n := b.N
	go func() {
		buf := make([]byte, size)
		for range n {
			if _, err := io.ReadFull(c2, buf); err != nil {
				return
			}
			if _, err := c2.Write(buf); err != nil {
				return
			}
		}
	}()
	buf := make([]byte, size)
	b.ResetTimer()
	for range n {
		if _, err := c1.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c1, buf); err != nil {
			b.Fatal(err)
		}
	}
}

// rawPair is a connected pair of loopback TCP sockets.
func rawPair(tb testing.TB) (net.Conn, net.Conn) {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
	}()
	c1, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		tb.Fatal(err)
	}
	c2 := <-accepted
	if c2 == nil {
		tb.Fatal(fmt.Errorf("accept failed"))
	}
	return c1, c2
}
