package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"

	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/tensorrpc/tensorrpc/internal/callhint"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// size is the bytes of every case's request or reply tensor (-size).
var size = 4 << 10

const (
	tensorKey  = "weights"
	echoMethod = "echo"
)

// A caseDef opens a case: call makes one call, close ends what open
// started.
type caseDef struct {
	name string
	what string
	open func(ctx context.Context) (call func() error, close func() error, err error)
}

// streamable are the cases whose call may be made from several
// goroutines at once (-streams): a Fetch from one Client is safe from
// any number of them. The Call and Send cases each send one tensor they
// made, and the ping-pongs share one connection.
var streamable = map[string]bool{
	"fetch-tcp": true, "fetch-shm": true, "fetch-tcp-locked": true, "fetch-shm-locked": true, "fetch-tcp-traced": true,
}

var allCases = []caseDef{
	{"fetch-tcp", "rpc Fetch of a published tensor, tcp data plane", openFetch(rpc.TransportTCP)},
	{"fetch-shm", "rpc Fetch of a published tensor, shm data plane", openFetch(rpc.TransportSHM)},
	{"fetch-tcp-locked", "fetch-tcp from a goroutine locked to its thread, as a call through the C ABI (Python) is", locked(openFetch(rpc.TransportTCP))},
	{"fetch-shm-locked", "fetch-shm from a goroutine locked to its thread, as a call through the C ABI (Python) is", locked(openFetch(rpc.TransportSHM))},
	{"fetch-tcp-traced", "fetch-tcp with inline interceptors on both sides, the client's sending a W3C traceparent in the call's metadata, the server's reading it (what a tracing interceptor adds to the path)", openFetch(rpc.TransportTCP, traced()...)},
	{"call-tcp", "rpc Call, a tensor in, the handler echoes it, tcp data plane", openCall(rpc.TransportTCP, false)},
	{"call-shm", "rpc Call, a tensor in, the handler echoes it, shm data plane", openCall(rpc.TransportSHM, false)},
	{"call-inline-tcp", "call-tcp with the handler registered rpc.Inline", openCall(rpc.TransportTCP, true)},
	{"call-inline-shm", "call-shm with the handler registered rpc.Inline", openCall(rpc.TransportSHM, true)},
	{"call-goroutine-tcp", "call-tcp on a server given rpc.WithHandlerGoroutines (a goroutine per call)", openCall(rpc.TransportTCP, false, rpc.WithHandlerGoroutines())},
	{"send-tcp", "rpc Send of a tensor, which the server publishes, tcp data plane", openSend(rpc.TransportTCP)},
	{"send-shm", "rpc Send of a tensor, which the server publishes, shm data plane", openSend(rpc.TransportSHM)},
	{"send-goroutine-tcp", "send-tcp on a server given rpc.WithHandlerGoroutines (a goroutine per Send)", openSend(rpc.TransportTCP, rpc.WithHandlerGoroutines())},
	{"pingpong-tcp", "raw loopback TCP: request and reply of -size bytes, one goroutine each side", openPingPong("tcp")},
	{"pingpong-unix", "raw unix socket: request and reply of -size bytes, one goroutine each side", openPingPong("unix")},
}

// pair is a server and a client of one data plane (and the gRPC fallback,
// which both sides offer as the cases do) in this process.
type pair struct {
	server *rpc.Server
	client *rpc.Client
}

func openPair(ctx context.Context, plane string, setup func(*rpc.Server) error, opts ...rpc.Option) (*pair, error) {
	return openPairWith(ctx, plane, setup, serverOpts(opts), dialOpts(opts))
}

// openPairServer is openPair with options for the server only.
func openPairServer(ctx context.Context, plane string, setup func(*rpc.Server) error, so []rpc.ServerOption) (*pair, error) {
	return openPairWith(ctx, plane, setup, so, nil)
}

func openPairWith(ctx context.Context, plane string, setup func(*rpc.Server) error, so []rpc.ServerOption, do []rpc.DialOption) (*pair, error) {
	transports := rpc.WithTransports(plane, rpc.TransportGRPC)
	p := &pair{}
	var err error
	if p.server, err = rpc.NewServer(append([]rpc.ServerOption{transports}, so...)...); err != nil {
		return nil, err
	}
	if err := setup(p.server); err != nil {
		p.server.Close()
		return nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		p.server.Close()
		return nil, err
	}
	go p.server.Serve(lis)
	if p.client, err = rpc.Dial(ctx, lis.Addr().String(), append([]rpc.DialOption{transports, rpc.WithTransportCredentials(insecure.NewCredentials())}, do...)...); err != nil {
		p.server.Stop()
		return nil, err
	}
	if got := p.client.Transport(); got != plane {
		p.close()
		return nil, fmt.Errorf("negotiated %s, not %s (%v)", got, plane, p.client.Rejections())
	}
	return p, nil
}

func (p *pair) close() error {
	err := p.client.Close()
	p.server.Stop()
	return err
}

// locked makes a case's calls as the C ABI makes them for a foreign
// thread (a Python caller's): from a goroutine locked to its thread
// (runtime.LockOSThread), with the context marked callhint.Locked. Parking
// such a goroutine parks its thread, and waking it is an OS-level wake-up.
func locked(open func(context.Context) (func() error, func() error, error)) func(context.Context) (func() error, func() error, error) {
	return func(ctx context.Context) (func() error, func() error, error) {
		call, closeCase, err := open(callhint.Locked(ctx))
		if err != nil {
			return nil, nil, err
		}
		return func() error {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			return call()
		}, closeCase, nil
	}
}

func serverOpts(opts []rpc.Option) []rpc.ServerOption {
	out := make([]rpc.ServerOption, len(opts))
	for i, o := range opts {
		out[i] = o
	}
	return out
}

func dialOpts(opts []rpc.Option) []rpc.DialOption {
	out := make([]rpc.DialOption, len(opts))
	for i, o := range opts {
		out[i] = o
	}
	return out
}

// traced is the options of fetch-tcp-traced: inline interceptors that
// carry a W3C traceparent from the client to the server, as a tracing
// interceptor does, without a tracing SDK's own cost.
func traced() []rpc.Option {
	return []rpc.Option{rpc.WithInlineInterceptors(func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		if info.Client {
			ctx = metadata.AppendToOutgoingContext(ctx, "traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
		} else if len(metadata.ValueFromIncomingContext(ctx, "traceparent")) != 1 {
			return errors.New("handoffs: the call carried no traceparent")
		}
		return next(ctx)
	})}
}

func openFetch(plane string, opts ...rpc.Option) func(context.Context) (func() error, func() error, error) {
	return func(ctx context.Context) (func() error, func() error, error) {
		p, err := openPair(ctx, plane, func(s *rpc.Server) error {
			t, err := s.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
			if err != nil {
				return err
			}
			defer t.Release()
			return s.Publish(ctx, tensorKey, t)
		}, opts...)
		if err != nil {
			return nil, nil, err
		}
		call := func() error {
			t, err := p.client.Fetch(ctx, tensorKey)
			if err != nil {
				return err
			}
			defer t.Release()
			if n := len(t.Bytes()); n != size {
				return fmt.Errorf("fetched %d bytes, want %d", n, size)
			}
			return nil
		}
		return call, p.close, nil
	}
}

// echo returns the request's tensor as the reply (tensorrpc releases it
// once the client has it).
func echo(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
	if len(req.Tensors) != 1 {
		return nil, fmt.Errorf("echo: %d tensors, want 1", len(req.Tensors))
	}
	return &rpc.Message{Tensors: req.Tensors}, nil
}

func openCall(plane string, inline bool, opts ...rpc.ServerOption) func(context.Context) (func() error, func() error, error) {
	return func(ctx context.Context) (func() error, func() error, error) {
		p, t, err := openWithTensor(ctx, plane, func(s *rpc.Server) error {
			if inline {
				s.Handle(echoMethod, echo, rpc.Inline())
			} else {
				s.Handle(echoMethod, echo)
			}
			return nil
		}, opts)
		if err != nil {
			return nil, nil, err
		}
		req := &rpc.Message{Tensors: []*rpc.Tensor{t}}
		call := func() error {
			reply, err := p.client.Call(ctx, echoMethod, req)
			if err != nil {
				return err
			}
			defer reply.Release()
			if len(reply.Tensors) != 1 || len(reply.Tensors[0].Bytes()) != size {
				return fmt.Errorf("reply of %d tensors, want one of %d bytes", len(reply.Tensors), size)
			}
			return nil
		}
		closeAll := func() error {
			req.Release()
			return p.close()
		}
		return call, closeAll, nil
	}
}

// openWithTensor opens a pair (the server's options so) and a client
// tensor of -size bytes for its calls.
func openWithTensor(ctx context.Context, plane string, setup func(*rpc.Server) error, so []rpc.ServerOption) (*pair, *rpc.Tensor, error) {
	p, err := openPairServer(ctx, plane, setup, so)
	if err != nil {
		return nil, nil, err
	}
	t, err := p.client.NewTensor(ctx, zerocopy.Uint8, []int64{int64(size)})
	if err != nil {
		p.close()
		return nil, nil, err
	}
	return p, t, nil
}

// openSend Sends a tensor to the same key again and again; the server
// publishes each in place of the last.
func openSend(plane string, opts ...rpc.ServerOption) func(context.Context) (func() error, func() error, error) {
	return func(ctx context.Context) (func() error, func() error, error) {
		p, t, err := openWithTensor(ctx, plane, func(*rpc.Server) error { return nil }, opts)
		if err != nil {
			return nil, nil, err
		}
		call := func() error { return p.client.Send(ctx, tensorKey, t) }
		closeAll := func() error {
			t.Release()
			return p.close()
		}
		return call, closeAll, nil
	}
}

// openPingPong is the ceiling: one connection, a goroutine that reads a
// request and writes the reply, and the caller's goroutine that writes the
// request and reads the reply.
func openPingPong(network string) func(context.Context) (func() error, func() error, error) {
	return func(ctx context.Context) (func() error, func() error, error) {
		addr, cleanup := "127.0.0.1:0", func() {}
		if network == "unix" {
			dir, err := os.MkdirTemp("", "handoffs")
			if err != nil {
				return nil, nil, err
			}
			addr, cleanup = filepath.Join(dir, "s"), func() { os.RemoveAll(dir) }
		}
		lis, err := net.Listen(network, addr)
		if err != nil {
			cleanup()
			return nil, nil, err
		}
		conns := make(chan net.Conn, 1)
		go func() {
			c, err := lis.Accept()
			if err != nil {
				close(conns)
				return
			}
			conns <- c
		}()
		client, err := net.Dial(network, lis.Addr().String())
		if err != nil {
			lis.Close() // ends the Accept
		}
		server, accepted := <-conns
		lis.Close()
		cleanup()
		switch {
		case err != nil:
			if accepted {
				server.Close()
			}
			return nil, nil, err
		case !accepted:
			client.Close()
			return nil, nil, fmt.Errorf("%s ping-pong: the listener accepted no connection", network)
		}
		served := make(chan error, 1)
		go func() {
			buf := make([]byte, size)
			for {
				if _, err := io.ReadFull(server, buf); err != nil {
					server.Close()
					if errors.Is(err, io.EOF) {
						err = nil
					}
					served <- err
					return
				}
				if _, err := server.Write(buf); err != nil {
					server.Close()
					served <- err
					return
				}
			}
		}()
		req, reply := make([]byte, size), make([]byte, size)
		call := func() error {
			if _, err := client.Write(req); err != nil {
				return err
			}
			_, err := io.ReadFull(client, reply)
			return err
		}
		closeAll := func() error {
			err := client.Close()
			return errors.Join(err, <-served)
		}
		return call, closeAll, nil
	}
}
