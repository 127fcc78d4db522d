package main

import (
	"bytes"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// TestSocket: the raw-socket ceiling moves the served bytes exactly, over
// one connection and over two (the last share the odd-sized rest), and
// refuses a request larger than what it serves.
func TestSocket(t *testing.T) {
	defer leakcheck.Check(t)
	const size = 1<<20 + 3
	raw := make([]byte, size)
	Pattern(raw, zerocopy.Uint8)
	s, err := serveSocket("127.0.0.1", raw)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, conns := range []int{1, 2} {
		c, err := dialSocket(s.lis.Addr().String(), conns, size)
		if err != nil {
			t.Fatal(err)
		}
		for range 3 {
			clear(c.dst)
			if err := c.fetch(); err != nil {
				t.Fatalf("%d connections: %v", conns, err)
			}
			if !bytes.Equal(c.dst, raw) {
				t.Fatalf("%d connections: the bytes differ", conns)
			}
		}
		c.Close()
	}
	big, err := dialSocket(s.lis.Addr().String(), 1, size+1)
	if err != nil {
		t.Fatal(err)
	}
	defer big.Close()
	if err := big.fetch(); err == nil {
		t.Fatal("a request past the served bytes succeeded")
	}
	if _, err := dialSocket(s.lis.Addr().String(), 3, 2); err == nil {
		t.Fatal("3 connections for 2 bytes accepted")
	}
}
