package rpc

import (
	"bytes"
	"testing"
)

// TestSendCallerMemoryInPlace: a Send of caller memory (a wrapped Go slice)
// past the inline size is read by the server from that memory, with no
// copy into the pool on the client: on tcp always, on shm where the
// server's process reaches the client's memory (cross-memory attach).
func TestSendCallerMemoryInPlace(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportSHM} {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			if _, err := c.session(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			if !peersReachCallerMemory(c.last.lanes) {
				for _, l := range c.last.lanes {
					if cm, ok := l.QP.(crossMemory); ok && cm.CMA() != nil {
						t.Skipf("the server cannot reach this process's memory here: %v", cm.CMA())
					}
				}
			}
			w := wrapped(t, 1<<20, 9)
			copies := c.Stats().Copies
			if err := c.Send(ctxT(t), "k", w); err != nil {
				t.Fatal(err)
			}
			if d := c.Stats().Copies - copies; d != 0 {
				t.Fatalf("a 1 MiB Send of caller memory on %s copied %d times on the client", tr, d)
			}
			got, err := s.Fetch(ctxT(t), "k")
			if err != nil {
				t.Fatal(err)
			}
			defer got.Release()
			if !bytes.Equal(got.Bytes(), w.Bytes()) {
				t.Fatal("the server published other bytes")
			}
		})
	}
}
