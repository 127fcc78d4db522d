package suite

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// tensorrpc over one data plane: the server publishes the payload once, and
// each stream Fetches it, as a consumer of a parameter server would.

type trpcSession struct {
	plane  string
	lease  bool
	size   int
	server *rpc.Server
	client *rpc.Client
	// leased and copied count Fetches with Lease above the eager
	// threshold by what they returned.
	leased, copied atomic.Int64
}

// poolLimit sizes a pool for want bytes of tensors at once, with room for
// the allocator's rounding and arena growth.
func poolLimit(want int64) int64 {
	return max(1<<30, want+want/4+(64<<20))
}

// trpcOptions are the options of both sides of a case: the data plane,
// a pool for poolBytes of tensors at once, and room for tensors of size
// bytes (rpc's default limit is 1 GiB; -sizes may ask for more).
func trpcOptions(planes []string, size, poolBytes int64) []rpc.Option {
	return []rpc.Option{
		rpc.WithTransports(planes...),
		rpc.WithPoolOptions(mempool.WithLimit(poolLimit(poolBytes))),
		rpc.WithMaxTensorBytes(max(rpc.DefaultMaxTensorBytes, size)),
	}
}

func serverOptions(opts []rpc.Option) []rpc.ServerOption {
	out := make([]rpc.ServerOption, len(opts))
	for i, o := range opts {
		out[i] = o
	}
	return out
}

// dialOptions adds the credentials: the cases run over loopback, in
// plaintext.
func dialOptions(opts []rpc.Option) []rpc.DialOption {
	out := []rpc.DialOption{rpc.WithTransportCredentials(insecure.NewCredentials())}
	for _, o := range opts {
		out = append(out, o)
	}
	return out
}

func openTensorRPC(plane string, lease bool) func(context.Context, *caseEnv) (session, error) {
	return func(ctx context.Context, env *caseEnv) (session, error) {
		size := int64(len(env.data))
		s := &trpcSession{plane: plane, lease: lease, size: len(env.data)}
		var err error
		if s.server, err = rpc.NewServer(serverOptions(trpcOptions([]string{plane}, size, size))...); err != nil {
			return nil, err
		}
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			s.server.Close()
			return nil, err
		}
		go s.server.Serve(lis)
		fail := func(err error) (session, error) {
			if s.client != nil {
				s.client.Close()
			}
			s.server.Stop()
			return nil, err
		}
		t, err := s.server.NewTensor(ctx, env.payload.DType, shapeOf(len(env.data), env.payload.DType))
		if err != nil {
			return fail(err)
		}
		copy(t.Bytes(), env.data)
		err = s.server.Publish(ctx, tensorKey, t)
		t.Release()
		if err != nil {
			return fail(err)
		}
		// Each stream holds one fetched tensor at a time.
		if s.client, err = rpc.Dial(ctx, lis.Addr().String(), dialOptions(trpcOptions([]string{plane}, size, size*int64(env.maxConc)))...); err != nil {
			return fail(err)
		}
		if got := s.client.Transport(); got != plane {
			return fail(fmt.Errorf("negotiated %s, not %s: %s", got, plane, rejections(s.client)))
		}
		return s, nil
	}
}

func rejections(c *rpc.Client) string {
	var rs []string
	for _, r := range c.Rejections() {
		rs = append(rs, r.String())
	}
	if len(rs) == 0 {
		return "no reason given"
	}
	return strings.Join(rs, "; ")
}

func (s *trpcSession) transport() string {
	switch {
	case s.lease && s.copied.Load() > 0:
		return s.client.Transport() + "+copy(lease refused)"
	case s.lease && s.leased.Load() > 0:
		return s.client.Transport() + "+lease"
	}
	return s.client.Transport()
}

// note says what the reader must know about the measurement: a Lease that
// returned copies measured a copy, not a lease.
func (s *trpcSession) note() string {
	if s.lease && s.copied.Load() > 0 {
		return fmt.Sprintf("%s: Fetch with rpc.Lease() returned copies (Tensor.Leased() false) above the eager threshold, so this case measures a copy: "+
			"the %s queue pair does not implement verbs.RemoteMapper, which rpc needs to map the server's memory", s.plane+"-lease", s.plane)
	}
	return ""
}

func (s *trpcSession) close() error {
	err := s.client.Close()
	s.server.Unpublish(tensorKey)
	s.server.Stop()
	return err
}

func (s *trpcSession) newStream() (stream, error) {
	t := &trpcStream{s: s}
	if s.lease {
		t.opts = append(t.opts, rpc.Lease())
	}
	return t, nil
}

// trpcStream Fetches the tensor. It keeps the last tensor until its next
// Fetch, for the check, so that it holds at most one at a time, as a
// stream that released each tensor after reading it would.
type trpcStream struct {
	s    *trpcSession
	opts []rpc.FetchOption
	last *rpc.Tensor
}

func (t *trpcStream) release() {
	if t.last != nil {
		t.last.Release()
		t.last = nil
	}
}

func (t *trpcStream) do(ctx context.Context) error {
	t.release()
	s := t.s
	tensor, err := s.client.Fetch(ctx, tensorKey, t.opts...)
	if err != nil {
		return err
	}
	if got := len(tensor.Bytes()); got != s.size {
		tensor.Release()
		return fmt.Errorf("fetched %d bytes, want %d", got, s.size)
	}
	// Below the eager threshold the bytes ride in the control message
	// and there is nothing to lease.
	if s.lease && s.size > rpc.DefaultEagerThreshold {
		if tensor.Leased() {
			s.leased.Add(1)
		} else {
			s.copied.Add(1)
		}
	}
	t.last = tensor
	return nil
}

func (t *trpcStream) received() []byte {
	if t.last == nil {
		return nil
	}
	return t.last.Bytes()
}

func (t *trpcStream) close() error {
	t.release()
	return nil
}

// tensorrpc Calls over one data plane: each stream sends a tensor of the
// size, and the handler returns the request tensor itself as the reply,
// as a handler that works in place would; one call moves the size twice.

// callMethod is the method of the call cases.
const callMethod = "echo"

type trpcCallSession struct {
	plane  string
	size   int
	dtype  zerocopy.DType
	data   []byte
	server *rpc.Server
	client *rpc.Client
}

// echo returns the request's tensor: the reply's tensors pass to tensorrpc,
// which sends the request's pool buffer back without a copy and releases
// the tensor once (Release is idempotent; the request's release when the
// handler returns finds it released).
func echo(_ context.Context, req *rpc.Message) (*rpc.Message, error) {
	if len(req.Tensors) != 1 {
		return nil, fmt.Errorf("echo: %d tensors, want 1", len(req.Tensors))
	}
	return &rpc.Message{Tensors: req.Tensors}, nil
}

func openTensorRPCCall(plane string, inline bool) func(context.Context, *caseEnv) (session, error) {
	return func(ctx context.Context, env *caseEnv) (session, error) {
		size := int64(len(env.data))
		// Each stream has one request on the server and one reply
		// tensor and its request tensor on the client at a time.
		inflight := size * int64(env.maxConc)
		s := &trpcCallSession{plane: plane, size: len(env.data), dtype: env.payload.DType, data: env.data}
		var err error
		if s.server, err = rpc.NewServer(serverOptions(trpcOptions([]string{plane}, size, inflight))...); err != nil {
			return nil, err
		}
		if inline {
			s.server.Handle(callMethod, echo, rpc.Inline())
		} else {
			s.server.Handle(callMethod, echo)
		}
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			s.server.Close()
			return nil, err
		}
		go s.server.Serve(lis)
		if s.client, err = rpc.Dial(ctx, lis.Addr().String(), dialOptions(trpcOptions([]string{plane}, size, 2*inflight))...); err != nil {
			s.server.Stop()
			return nil, err
		}
		if got := s.client.Transport(); got != plane {
			err := fmt.Errorf("negotiated %s, not %s: %s", got, plane, rejections(s.client))
			s.client.Close()
			s.server.Stop()
			return nil, err
		}
		return s, nil
	}
}

func (s *trpcCallSession) transport() string { return s.client.Transport() }

func (s *trpcCallSession) close() error {
	err := s.client.Close()
	s.server.Stop()
	return err
}

// newStream allocates the stream's request tensor in the client's pool and
// fills it once, as a caller that computes into pool memory would.
func (s *trpcCallSession) newStream() (stream, error) {
	t, err := s.client.NewTensor(context.Background(), s.dtype, shapeOf(s.size, s.dtype))
	if err != nil {
		return nil, err
	}
	copy(t.Bytes(), s.data)
	return &trpcCallStream{s: s, req: &rpc.Message{Tensors: []*rpc.Tensor{t}}}, nil
}

// trpcCallStream keeps the last reply until its next call, for the check.
type trpcCallStream struct {
	s    *trpcCallSession
	req  *rpc.Message
	last *rpc.Message
}

func (t *trpcCallStream) do(ctx context.Context) error {
	t.last.Release()
	t.last = nil
	reply, err := t.s.client.Call(ctx, callMethod, t.req)
	if err != nil {
		return err
	}
	if len(reply.Tensors) != 1 || len(reply.Tensors[0].Bytes()) != t.s.size {
		reply.Release()
		return fmt.Errorf("reply of %d tensors, want one of %d bytes", len(reply.Tensors), t.s.size)
	}
	t.last = reply
	return nil
}

func (t *trpcCallStream) received() []byte {
	if t.last == nil {
		return nil
	}
	return t.last.Tensors[0].Bytes()
}

func (t *trpcCallStream) close() error {
	t.last.Release()
	t.last = nil
	t.req.Release()
	return nil
}

// probeIBV reports whether the ibv data plane negotiates on this machine,
// and if not, why.
func probeIBV(ctx context.Context) (ok bool, reason string) {
	srv, err := rpc.NewServer(rpc.WithTransports(rpc.TransportIBV, rpc.TransportGRPC))
	if err != nil {
		return false, err.Error()
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Close()
		return false, err.Error()
	}
	go srv.Serve(lis)
	defer srv.Stop()
	c, err := rpc.Dial(ctx, lis.Addr().String(), dialOptions([]rpc.Option{rpc.WithTransports(rpc.TransportIBV, rpc.TransportGRPC)})...)
	if err != nil {
		return false, err.Error()
	}
	defer c.Close()
	if c.Transport() == rpc.TransportIBV {
		return true, ""
	}
	return false, rejections(c)
}

// shapeOf is the shape of an n-byte tensor of dtype: rows of 1024 elements
// when they divide evenly, else one dimension.
func shapeOf(n int, dtype zerocopy.DType) []int64 {
	elems := int64(n / dtype.Size())
	if elems >= 1024 && elems%1024 == 0 {
		return []int64{elems / 1024, 1024}
	}
	return []int64{elems}
}

// tensorKey names the tensor every case moves.
const tensorKey = "layer.17.mlp.weight.grad"
