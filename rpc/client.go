package rpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// Client is a session with a Server: a gRPC connection for control and the
// best data plane both sides could connect. It is safe for concurrent use.
type Client struct {
	opts    options
	log     *slog.Logger
	pool    *mempool.Pool
	ownPool bool
	cc      *grpc.ClientConn
	ownConn bool
	api     pb.TensorRPCClient
	devices map[string]*device

	sessionID  string
	transport  string
	link       *link
	rejections []Rejection
	eager      int
	stats      counters
	topo       topology

	stream       pb.TensorRPC_SessionClient
	cancelStream context.CancelFunc
	streamDone   chan struct{}

	releases chan release
	nextRef  atomic.Uint64
	wg       sync.WaitGroup

	mu     sync.Mutex
	closed bool
	broken error // why the session ended, once it has
}

// Dial connects to the tensorrpc server at target (a gRPC target such as
// "host:port") and opens a session. Without WithGRPCDialOptions giving
// transport credentials it uses an insecure connection.
func Dial(ctx context.Context, target string, opts ...Option) (*Client, error) {
	o := buildOptions(opts)
	dialOpts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, o.grpcDialOpts...)
	cc, err := grpc.NewClient(target, dialOpts...)
	if err != nil {
		return nil, fmt.Errorf("tensorrpc: dialing %s: %w", target, err)
	}
	c, err := newClient(ctx, cc, o)
	if err != nil {
		cc.Close()
		return nil, err
	}
	c.ownConn = true
	return c, nil
}

// NewClient opens a session over an existing gRPC connection. Close does
// not close cc.
func NewClient(ctx context.Context, cc *grpc.ClientConn, opts ...Option) (*Client, error) {
	return newClient(ctx, cc, buildOptions(opts))
}

func newClient(ctx context.Context, cc *grpc.ClientConn, o options) (*Client, error) {
	c := &Client{opts: o, log: o.logger, cc: cc, api: pb.NewTensorRPCClient(cc), releases: make(chan release, 1024), streamDone: make(chan struct{})}
	if o.pool != nil {
		c.pool = o.pool
	} else {
		p, err := mempool.NewPool(o.poolOptions...)
		if err != nil {
			return nil, fmt.Errorf("tensorrpc: making the pool: %w", err)
		}
		c.pool, c.ownPool = p, true
	}
	var missing map[string]string
	c.devices, missing = openDevices(&c.opts, c.pool, c.log)
	for _, name := range o.transports {
		if reason, ok := missing[name]; ok {
			c.rejections = append(c.rejections, Rejection{Transport: name, Side: "client", Reason: reason})
		}
	}
	if err := c.negotiate(ctx); err != nil {
		c.teardown()
		return nil, err
	}
	c.wg.Add(1)
	go c.releaseLoop()
	c.log.Info("tensorrpc: session open", "session", c.sessionID, "transport", c.transport)
	return c, nil
}

// Transport is the data plane the session uses: TransportIBV,
// TransportSHM, TransportTCP or TransportGRPC.
func (c *Client) Transport() string { return c.transport }

// Rejections says why each enabled data plane other than the one in use was
// not used, on either side.
func (c *Client) Rejections() []Rejection { return append([]Rejection(nil), c.rejections...) }

// SessionID is the server's name for the session.
func (c *Client) SessionID() string { return c.sessionID }

// Pool is the pool received tensors come from.
func (c *Client) Pool() *mempool.Pool { return c.pool }

// Stats returns the session's counters.
func (c *Client) Stats() Stats { return c.stats.snapshot(c.transport) }

// NewTensor allocates a tensor from the Client's pool, waiting while the
// pool is full until ctx ends. Sending it costs no copy.
func (c *Client) NewTensor(ctx context.Context, dtype zerocopy.DType, shape []int64) (*Tensor, error) {
	return newTensor(ctx, c.pool, dtype, shape)
}

// negotiate opens the session stream, offers every opened data plane and
// connects the first the server chooses that both sides connect.
func (c *Client) negotiate(ctx context.Context) error {
	sctx, cancel := context.WithCancel(context.Background())
	c.cancelStream = cancel
	stop := context.AfterFunc(ctx, cancel) // ctx bounds the negotiation only
	defer stop()
	stream, err := c.api.Session(sctx)
	if err != nil {
		return negotiationError(ctx, err)
	}
	c.stream = stream

	links := map[pb.Transport]*link{}
	defer func() {
		for _, l := range links {
			if l != c.link {
				l.close(errors.New("not chosen"))
			}
		}
	}()
	hs := &pb.HandshakeRequest{ProtocolVersion: ProtocolVersion, ClientName: c.opts.name}
	for _, name := range c.opts.transports {
		if name == TransportGRPC {
			continue
		}
		dev := c.devices[name]
		if dev == nil {
			continue
		}
		l, err := newLink(ctx, dev, c.pool)
		if err != nil {
			c.rejections = append(c.rejections, Rejection{Transport: name, Side: "client", Reason: err.Error()})
			continue
		}
		links[transportOf(name)] = l
		hs.Offers = append(hs.Offers, &pb.TransportOffer{Transport: transportOf(name), Info: l.qp.LocalInfo(), Description: dev.name})
	}
	if err := stream.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_Handshake{Handshake: hs}}); err != nil {
		return negotiationError(ctx, err)
	}
	msg, err := stream.Recv()
	if err != nil {
		return negotiationError(ctx, err)
	}
	resp := msg.GetHandshake()
	if resp == nil {
		return status.Error(codes.Internal, "tensorrpc: server did not answer the handshake")
	}
	c.sessionID = resp.SessionId
	c.eager = int(resp.EagerThreshold)
	for _, r := range resp.Rejected {
		c.rejections = append(c.rejections, Rejection{Transport: transportName(r.Transport), Side: "server", Reason: r.Reason})
	}
	for {
		msg, err := stream.Recv()
		if err != nil {
			return negotiationError(ctx, err)
		}
		choice := msg.GetChoice()
		if choice == nil {
			return status.Error(codes.Internal, "tensorrpc: expected the server's choice of data plane")
		}
		if choice.Transport == pb.Transport_TRANSPORT_GRPC {
			if !enabled(&c.opts, TransportGRPC) {
				return status.Errorf(codes.FailedPrecondition, "tensorrpc: no data plane connected and the grpc fallback is disabled: %s", c.rejectionText())
			}
			c.transport = TransportGRPC
			break
		}
		l := links[choice.Transport]
		if l == nil {
			return status.Errorf(codes.Internal, "tensorrpc: server chose %s, which was not offered", choice.Transport)
		}
		name := transportName(choice.Transport)
		cctx, ccancel := context.WithTimeout(ctx, c.opts.connectTimeout)
		myErr := l.connect(cctx, choice.Info, nil)
		ccancel()
		result := &pb.ConnectResult{Transport: choice.Transport, Ok: myErr == nil}
		if myErr != nil {
			result.Error = myErr.Error()
		}
		if err := stream.Send(&pb.SessionRequest{Msg: &pb.SessionRequest_ConnectResult{ConnectResult: result}}); err != nil {
			return negotiationError(ctx, err)
		}
		msg, err = stream.Recv()
		if err != nil {
			return negotiationError(ctx, err)
		}
		theirs := msg.GetConnectResult()
		if theirs == nil {
			return status.Error(codes.Internal, "tensorrpc: expected the server's connect result")
		}
		if myErr == nil && theirs.Ok {
			c.link, c.transport = l, name
			break
		}
		reason, side := "", "client"
		if myErr != nil {
			reason = myErr.Error()
		} else {
			reason, side = theirs.Error, "server"
		}
		c.rejections = append(c.rejections, Rejection{Transport: name, Side: side, Reason: "connect: " + reason})
		delete(links, choice.Transport)
		l.close(errors.New("did not connect"))
	}
	// Watch the stream: its end is the session's end.
	go func() {
		defer close(c.streamDone)
		for {
			if _, err := stream.Recv(); err != nil {
				c.sessionEnded(err)
				return
			}
		}
	}()
	return nil
}

// rejectionText lists the rejections for error messages.
func (c *Client) rejectionText() string {
	if len(c.rejections) == 0 {
		return "no data plane was offered"
	}
	var parts []string
	for _, r := range c.rejections {
		parts = append(parts, r.String())
	}
	return strings.Join(parts, "; ")
}

func negotiationError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Errorf(codes.Unavailable, "tensorrpc: session: %v", err)
}

// sessionEnded marks the session broken: the server went away or ended it.
func (c *Client) sessionEnded(err error) {
	c.mu.Lock()
	if c.broken == nil {
		c.broken = fmt.Errorf("session ended: %w", err)
	}
	c.mu.Unlock()
	if c.link != nil {
		c.link.close(c.broken)
	}
}

// check returns an error when the client can no longer make calls.
func (c *Client) check() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return status.Error(codes.Canceled, "tensorrpc: client closed")
	}
	if c.broken != nil {
		return status.Errorf(codes.Unavailable, "tensorrpc: %v", c.broken)
	}
	return nil
}

// release names server-side buffers the client no longer needs: a transfer
// by id, or every transfer of a call by the call's client_ref.
type release struct{ id, ref uint64 }

// newRef names a call's transfers; see FetchRequest.client_ref.
func (c *Client) newRef() uint64 { return c.nextRef.Add(1) }

// releaseTransfer tells the server, in the background, that a transfer's
// buffer is no longer needed.
func (c *Client) releaseTransfer(id uint64) {
	if id != 0 {
		c.queueRelease(release{id: id})
	}
}

// releaseRef tells the server, in the background, to drop whatever a
// failed or cancelled call created.
func (c *Client) releaseRef(ref uint64) { c.queueRelease(release{ref: ref}) }

func (c *Client) queueRelease(r release) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return // the session's end releases it on the server
	}
	select {
	case c.releases <- r:
	default:
		// The queue is full: release synchronously rather than drop it.
		c.mu.Unlock()
		c.sendReleases([]release{r})
		c.mu.Lock()
	}
}

func (c *Client) releaseLoop() {
	defer c.wg.Done()
	for r := range c.releases {
		batch := []release{r}
	more:
		for {
			select {
			case r, ok := <-c.releases:
				if !ok {
					break more
				}
				batch = append(batch, r)
			default:
				break more
			}
		}
		c.sendReleases(batch)
	}
}

func (c *Client) sendReleases(batch []release) {
	req := &pb.ReleaseRequest{SessionId: c.sessionID}
	for _, r := range batch {
		if r.id != 0 {
			req.TransferIds = append(req.TransferIds, r.id)
		}
		if r.ref != 0 {
			req.ClientRefs = append(req.ClientRefs, r.ref)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.connectTimeout)
	defer cancel()
	if _, err := c.api.Release(ctx, req); err != nil {
		c.log.Debug("tensorrpc: release failed; the session's end frees the buffers", "err", err)
	}
}

// Close ends the session: the server releases what it holds for it, and
// the Client releases its data plane, its pool (unless WithPool) and its
// connection (when Dial made it). Tensors received from the Client must be
// released before Close; Close reports the pool's error when some are not.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.releases)
	c.mu.Unlock()
	c.wg.Wait() // pending releases are sent
	return c.teardown()
}

func (c *Client) teardown() error {
	if c.stream != nil {
		c.stream.CloseSend()
	}
	if c.cancelStream != nil {
		c.cancelStream()
	}
	if c.stream != nil {
		select {
		case <-c.streamDone:
		default:
			if c.transport != "" { // the watcher runs only after negotiation
				<-c.streamDone
			}
		}
	}
	if c.link != nil {
		c.link.close(errors.New("client closed"))
	}
	for _, d := range c.devices {
		d.close()
	}
	var err error
	if c.ownConn {
		c.cc.Close()
	}
	if c.ownPool {
		err = c.pool.Close()
	}
	return err
}
