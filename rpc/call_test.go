package rpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// echoReverse answers with the request's tensors in reverse order and its
// metadata reversed.
func echoReverse(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
	out := &rpc.Message{Metadata: append([]byte(nil), req.Metadata...)}
	for i, j := 0, len(out.Metadata)-1; i < j; i, j = i+1, j-1 {
		out.Metadata[i], out.Metadata[j] = out.Metadata[j], out.Metadata[i]
	}
	for i := len(req.Tensors) - 1; i >= 0; i-- {
		in := req.Tensors[i]
		// Copy into a fresh tensor: request tensors are released when the
		// handler returns.
		t := rpc.WrapTensor(mustTensor(in.DType(), in.Shape(), append([]byte(nil), in.Bytes()...)))
		out.Tensors = append(out.Tensors, t)
	}
	return out, nil
}

func mustTensor(d zerocopy.DType, shape []int64, b []byte) zerocopy.Tensor {
	t, err := zerocopy.New(d, shape, b)
	if err != nil {
		panic(err)
	}
	return t
}

func TestCallEveryDTypeMultiTensor(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			s.Handle("reverse", echoReverse)
			s.Handle("fail", func(context.Context, *rpc.Message) (*rpc.Message, error) {
				return nil, status.Error(codes.FailedPrecondition, "nope")
			})
			ctx := ctxT(t)
			var req rpc.Message
			req.Metadata = []byte("metadata")
			for i, d := range zerocopy.DTypes() {
				// Alternate small (inline) and large (data plane) tensors.
				n := int64(3 + i)
				if i%2 == 1 {
					n = int64(100000/d.Size() + i)
				}
				b := make([]byte, n*int64(d.Size()))
				pattern(b, byte(i))
				if d == zerocopy.Bool {
					for j := range b {
						b[j] &= 1
					}
				}
				req.Tensors = append(req.Tensors, rpc.WrapTensor(mustTensor(d, []int64{n}, b)))
			}
			reply, err := c.Call(ctx, "reverse", &req)
			if err != nil {
				t.Fatal(err)
			}
			defer reply.Release()
			if string(reply.Metadata) != "atadatem" {
				t.Fatalf("metadata %q", reply.Metadata)
			}
			if len(reply.Tensors) != len(req.Tensors) {
				t.Fatalf("%d tensors back, want %d", len(reply.Tensors), len(req.Tensors))
			}
			for i, got := range reply.Tensors {
				want := req.Tensors[len(req.Tensors)-1-i]
				if got.DType() != want.DType() || fmt.Sprint(got.Shape()) != fmt.Sprint(want.Shape()) || !bytes.Equal(got.Bytes(), want.Bytes()) {
					t.Fatalf("tensor %d: got %v, want %v (or bytes differ)", i, got, want)
				}
			}
			if _, err := c.Call(ctx, "fail", nil); status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("failing handler: %v", err)
			}
			if _, err := c.Call(ctx, "missing", nil); status.Code(err) != codes.Unimplemented {
				t.Fatalf("missing handler: %v", err)
			}
		})
	}
}

func TestConcurrentCalls(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			s.Handle("reverse", echoReverse)
			ctx := ctxT(t)
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for i := range 64 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					n := 1000 + i*7919
					if i%3 == 0 {
						n = 300000 + i
					}
					in := wrapped(t, n, byte(i))
					key := fmt.Sprintf("c%d", i)
					switch i % 3 {
					case 0:
						reply, err := c.Call(ctx, "reverse", &rpc.Message{Tensors: []*rpc.Tensor{in, in}})
						if err != nil {
							errs <- err
							return
						}
						defer reply.Release()
						if !bytes.Equal(reply.Tensors[1].Bytes(), in.Bytes()) {
							errs <- fmt.Errorf("call %d: data differs", i)
						}
					case 1:
						if err := c.Send(ctx, key, in); err != nil {
							errs <- err
							return
						}
						got, err := s.Take(ctx, key)
						if err != nil {
							errs <- err
							return
						}
						defer got.Release()
						if !bytes.Equal(got.Bytes(), in.Bytes()) {
							errs <- fmt.Errorf("send %d: data differs", i)
						}
					case 2:
						if err := s.Publish(context.Background(), key, in); err != nil {
							errs <- err
							return
						}
						got, err := c.Fetch(ctx, key)
						if err != nil {
							errs <- err
							return
						}
						defer got.Release()
						s.Unpublish(key)
						if !bytes.Equal(got.Bytes(), in.Bytes()) {
							errs <- fmt.Errorf("fetch %d: data differs", i)
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}

func TestFetchWaitsForPublish(t *testing.T) {
	s, c := pair(t, rpc.TransportTCP, nil, nil)
	ctx := ctxT(t)
	got := make(chan error, 1)
	go func() {
		tn, err := c.Fetch(ctx, "later", rpc.WaitForKey())
		if err == nil {
			if len(tn.Bytes()) != 100000 {
				err = errors.New("wrong size")
			}
			tn.Release()
		}
		got <- err
	}()
	in := wrapped(t, 100000, 1)
	if err := s.Publish(context.Background(), "later", in); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 50e6)
	defer cancel()
	if _, err := c.Fetch(short, "never", rpc.WaitForKey()); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Fetch of a missing key with WaitForKey: %v, want DeadlineExceeded", err)
	}
	_, err := c.Fetch(ctx, "never")
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), `"never"`) {
		t.Fatalf("Fetch of a missing key: %v, want NotFound naming the key", err)
	}
}
