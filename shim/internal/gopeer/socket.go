package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// The raw-socket ceiling of bench-serve and bench-client: the kernel's
// speed for the same bytes between the same two processes, measured in
// the same run as the tcp plane (bench_latency.py's socket rows). A
// request is two 8-byte little-endian numbers, the offset and the count
// of the bytes wanted; the answer is those bytes of the served buffer,
// written at once.

// socketServer answers raw-socket requests from buf until its listener
// is closed.
type socketServer struct {
	lis    net.Listener
	buf    []byte
	wg     sync.WaitGroup
	mu     sync.Mutex
	cs     map[net.Conn]struct{}
	closed bool // guarded by mu: Close began; accept closes what comes after
}

// serveSocket listens on host (bench-serve's: 127.0.0.1, as its gRPC
// listener) and answers from buf.
func serveSocket(host string, buf []byte) (*socketServer, error) {
	lis, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, err
	}
	s := &socketServer{lis: lis, buf: buf, cs: map[net.Conn]struct{}{}}
	s.wg.Go(s.accept)
	return s, nil
}

func (s *socketServer) accept() {
	for {
		c, err := s.lis.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			continue // Accept fails next, on the closed listener
		}
		s.cs[c] = struct{}{}
		s.wg.Go(func() { s.answer(c) })
		s.mu.Unlock()
	}
}

func (s *socketServer) answer(c net.Conn) {
	defer func() {
		s.mu.Lock()
		delete(s.cs, c)
		s.mu.Unlock()
		c.Close()
	}()
	var h [16]byte
	for {
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return
		}
		off, n := binary.LittleEndian.Uint64(h[:8]), binary.LittleEndian.Uint64(h[8:])
		if off > uint64(len(s.buf)) || n > uint64(len(s.buf))-off {
			return
		}
		if _, err := c.Write(s.buf[off : off+n]); err != nil {
			return
		}
	}
}

// Close stops the listener and every connection, and waits for them.
func (s *socketServer) Close() {
	s.lis.Close()
	s.mu.Lock()
	s.closed = true
	for c := range s.cs {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// socketClient fetches size bytes from a socketServer over conns
// connections at once, each asking for its share (as a striped Fetch's
// lanes do), into one buffer.
type socketClient struct {
	cs  []net.Conn
	dst []byte
}

func dialSocket(addr string, conns, size int) (*socketClient, error) {
	if conns < 1 || size < conns {
		return nil, fmt.Errorf("socket: %d connections for %d bytes", conns, size)
	}
	c := &socketClient{dst: make([]byte, size)}
	for range conns {
		nc, err := net.Dial("tcp", addr)
		if err != nil {
			c.Close()
			return nil, err
		}
		c.cs = append(c.cs, nc)
	}
	return c, nil
}

// fetch asks every connection for its share and reads them all.
func (c *socketClient) fetch() error {
	n := len(c.cs)
	part := len(c.dst) / n
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, nc := range c.cs {
		lo, hi := i*part, (i+1)*part
		if i == n-1 {
			hi = len(c.dst)
		}
		get := func() {
			var h [16]byte
			binary.LittleEndian.PutUint64(h[:8], uint64(lo))
			binary.LittleEndian.PutUint64(h[8:], uint64(hi-lo))
			if _, err := nc.Write(h[:]); err != nil {
				errs[i] = err
				return
			}
			_, errs[i] = io.ReadFull(nc, c.dst[lo:hi])
		}
		if i == n-1 {
			get() // the last share on this goroutine, as a Fetch's caller reads one lane
			continue
		}
		wg.Go(get)
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (c *socketClient) Close() {
	for _, nc := range c.cs {
		nc.Close()
	}
}
