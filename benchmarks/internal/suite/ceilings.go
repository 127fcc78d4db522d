package suite

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// The ceilings: what the machine can do with no framework at all. memcpy
// bounds every same-host copy (shm); a raw loopback socket bounds every
// protocol over TCP (gRPC, tensorrpc's tcp plane) and a unix socket what a
// same-host socket could do.

// memcpySession copies the payload into each stream's own buffer.
type memcpySession struct{ src []byte }

func openMemcpy(_ context.Context, env *caseEnv) (session, error) {
	return &memcpySession{src: env.data}, nil
}

func (s *memcpySession) transport() string { return "memory" }
func (s *memcpySession) close() error      { return nil }

func (s *memcpySession) newStream() (stream, error) {
	dst := make([]byte, len(s.src))
	copy(dst, s.src) // fault the pages in before timing
	return &memcpyStream{src: s.src, dst: dst}, nil
}

type memcpyStream struct{ src, dst []byte }

func (s *memcpyStream) do(context.Context) error {
	copy(s.dst, s.src)
	return nil
}

func (s *memcpyStream) received() []byte { return s.dst }
func (s *memcpyStream) close() error     { return nil }

// socketSession is a server that answers each 8-byte request (a length)
// with that many bytes of the payload, on one connection per stream: the
// least any request/response protocol over a socket can do.
type socketSession struct {
	network string
	data    []byte
	lis     net.Listener
	dir     string
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
}

func openSocket(network string) func(context.Context, *caseEnv) (session, error) {
	return func(_ context.Context, env *caseEnv) (session, error) {
		s := &socketSession{network: network, data: env.data}
		addr := "127.0.0.1:0"
		if network == "unix" {
			dir, err := os.MkdirTemp("", "tensorbench-")
			if err != nil {
				return nil, err
			}
			s.dir = dir
			addr = filepath.Join(dir, "sock")
		}
		lis, err := net.Listen(network, addr)
		if err != nil {
			return nil, err
		}
		s.lis = lis
		s.wg.Go(s.accept)
		return s, nil
	}
}

func (s *socketSession) transport() string { return s.network }

func (s *socketSession) accept() {
	for {
		conn, err := s.lis.Accept()
		if err != nil {
			return
		}
		s.track(conn)
		s.wg.Go(func() { s.serve(conn) })
	}
}

func (s *socketSession) track(c net.Conn) {
	s.mu.Lock()
	s.conns = append(s.conns, c)
	s.mu.Unlock()
}

func (s *socketSession) serve(conn net.Conn) {
	defer conn.Close()
	var req [8]byte
	for {
		if _, err := io.ReadFull(conn, req[:]); err != nil {
			return
		}
		n := binary.LittleEndian.Uint64(req[:])
		if n > uint64(len(s.data)) {
			return
		}
		if _, err := conn.Write(s.data[:n]); err != nil {
			return
		}
	}
}

func (s *socketSession) newStream() (stream, error) {
	conn, err := net.Dial(s.network, s.lis.Addr().String())
	if err != nil {
		return nil, err
	}
	s.track(conn)
	return &socketStream{conn: conn, dst: make([]byte, len(s.data))}, nil
}

func (s *socketSession) close() error {
	err := s.lis.Close()
	s.mu.Lock()
	for _, c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
	return err
}

type socketStream struct {
	conn     net.Conn
	dst      []byte
	deadline time.Time
}

func (s *socketStream) do(ctx context.Context) error {
	if d, _ := ctx.Deadline(); !d.Equal(s.deadline) {
		s.deadline = d
		s.conn.SetDeadline(d)
	}
	var req [8]byte
	binary.LittleEndian.PutUint64(req[:], uint64(len(s.dst)))
	if _, err := s.conn.Write(req[:]); err != nil {
		return err
	}
	if _, err := io.ReadFull(s.conn, s.dst); err != nil {
		return fmt.Errorf("read %d bytes: %w", len(s.dst), err)
	}
	return nil
}

func (s *socketStream) received() []byte { return s.dst }
func (s *socketStream) close() error     { return s.conn.Close() }
