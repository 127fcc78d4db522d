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

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
)

// The ceilings: what the machine can do with no framework at all. memcpy
// bounds every same-host copy (shm): it copies as the data planes do
// (internal/memcopy, faster than the built-in copy from 1 MiB on some
// CPUs; TENSORRPC_COPY=runtime makes both the built-in); a raw loopback socket bounds every
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
	memcopy.Copy(s.dst, s.src)
	return nil
}

func (s *memcpyStream) received() []byte { return s.dst }
func (s *memcpyStream) close() error     { return nil }

// memcpyEchoSession copies the request into a buffer of the stream's own
// and from it into the stream's reply buffer: the two copies a call over
// shared memory makes, 2n bytes moved.
type memcpyEchoSession struct{ src []byte }

func openMemcpyEcho(_ context.Context, env *caseEnv) (session, error) {
	return &memcpyEchoSession{src: env.data}, nil
}

func (s *memcpyEchoSession) transport() string { return "memory" }
func (s *memcpyEchoSession) close() error      { return nil }

func (s *memcpyEchoSession) newStream() (stream, error) {
	mid, dst := make([]byte, len(s.src)), make([]byte, len(s.src))
	copy(mid, s.src) // fault the pages in before timing
	copy(dst, mid)
	return &memcpyEchoStream{src: s.src, mid: mid, dst: dst}, nil
}

type memcpyEchoStream struct{ src, mid, dst []byte }

func (s *memcpyEchoStream) do(context.Context) error {
	memcopy.Copy(s.mid, s.src)
	memcopy.Copy(s.dst, s.mid)
	return nil
}

func (s *memcpyEchoStream) received() []byte { return s.dst }
func (s *memcpyEchoStream) close() error     { return nil }

// socketSession is a server that answers each 8-byte request (a length)
// with that many bytes of the payload, on one connection per stream: the
// least any request/response protocol over a socket can do. With echo, the
// request is the 8-byte length and that many bytes, and the reply those
// bytes back: the least a call moving n bytes each way can do.
type socketSession struct {
	network string
	echo    bool
	data    []byte
	lis     net.Listener
	dir     string
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
}

func openSocket(network string) func(context.Context, *caseEnv) (session, error) {
	return openSocketSession(network, false)
}

func openSocketEcho(network string) func(context.Context, *caseEnv) (session, error) {
	return openSocketSession(network, true)
}

func openSocketSession(network string, echo bool) func(context.Context, *caseEnv) (session, error) {
	return func(_ context.Context, env *caseEnv) (session, error) {
		s := &socketSession{network: network, echo: echo, data: env.data}
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

func (s *socketSession) transport() string {
	if s.echo {
		return s.network + "+echo"
	}
	return s.network
}

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
	var buf []byte
	if s.echo {
		buf = make([]byte, len(s.data))
	}
	for {
		if _, err := io.ReadFull(conn, req[:]); err != nil {
			return
		}
		n := binary.LittleEndian.Uint64(req[:])
		if n > uint64(len(s.data)) {
			return
		}
		reply := s.data[:n]
		if s.echo {
			if _, err := io.ReadFull(conn, buf[:n]); err != nil {
				return
			}
			reply = buf[:n]
		}
		if _, err := conn.Write(reply); err != nil {
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
	st := &socketStream{conn: conn, dst: make([]byte, len(s.data))}
	if s.echo {
		st.req = s.data
	}
	return st, nil
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
	req      []byte // with echo, the bytes sent after the header
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
	if s.req == nil {
		if _, err := s.conn.Write(req[:]); err != nil {
			return err
		}
	} else {
		bufs := net.Buffers{req[:], s.req}
		if _, err := bufs.WriteTo(s.conn); err != nil {
			return err
		}
	}
	if _, err := io.ReadFull(s.conn, s.dst); err != nil {
		return fmt.Errorf("read %d bytes: %w", len(s.dst), err)
	}
	return nil
}

func (s *socketStream) received() []byte { return s.dst }
func (s *socketStream) close() error     { return s.conn.Close() }
