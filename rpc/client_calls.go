package rpc

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tensorrpc/tensorrpc/internal/memcopy"
	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/proto/wire"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// FetchOption changes how Fetch moves a tensor.
type FetchOption func(*fetchOptions)

type fetchOptions struct {
	lease, wait bool
	rows        []int64 // Rows: nil for the whole tensor
	into        *Tensor // Into: nil for a new pool tensor
	// rowsOfSource: the answer grants the whole source, of sourceBytes,
	// whose rows the client reads (FetchResponse.rows_of_source).
	rowsOfSource bool
	sourceBytes  uint64
	// land: the request grants this landing (FetchRequest.landing).
	land *landing
}

// Rows fetches only these rows (indices along dimension 0, in this order;
// repeats allowed) of the published tensor, which must have at least one
// dimension: the result has shape [len(idx), shape[1:]...], the rows back
// to back. An index out of range fails with InvalidArgument and nothing
// moves. On a data plane this is one request, after which the client
// reads the rows from the server's memory in one batch of Reads (rows
// that follow each other are one Read); at most MaxRows rows.
func Rows(idx ...int64) FetchOption {
	rows := append([]int64{}, idx...)
	return func(o *fetchOptions) { o.rows = rows }
}

// Into lands the fetched tensor (or its Rows) in dst, which the caller
// owns, instead of a new pool tensor, and Fetch returns dst itself. dst's
// dtype and shape must be those of what arrives, else Fetch fails with
// InvalidArgument and nothing is written to dst. On tcp the bytes are read
// straight into dst, with no copy on this side; on shm likewise where the
// provider can register dst (see Stats.Copies); elsewhere, and for
// tensors small enough to come inline, they are copied in once. dst must
// not be used until Fetch returns; on an error its contents are
// undefined. Whatever the result, nothing writes dst once Fetch returns:
// Reads under way when it fails or its context ends are waited for (a
// peer that holds one past 5 s has the session ended). Lease is ignored
// with Into.
func Into(dst *Tensor) FetchOption { return func(o *fetchOptions) { o.into = dst } }

// Lease asks for a zero-copy shared-memory lease of the server's tensor
// instead of a copy: on the shm data plane the returned tensor is the
// server's memory, mapped read-only into this process, and the server keeps
// it until the tensor is released. On other data planes Fetch copies as
// usual. A leased tensor must not be written.
func Lease() FetchOption { return func(o *fetchOptions) { o.lease = true } }

// WaitForKey makes Fetch wait until the key is published (or ctx ends)
// instead of failing at once with NotFound, as gRPC's WaitForReady makes a
// call wait for a connection.
func WaitForKey() FetchOption { return func(o *fetchOptions) { o.wait = true } }

// Fetch returns the tensor the server has published under key (with
// Server.Publish, or a client's Send). A key that is not published fails
// with NotFound naming the key, unless WaitForKey is given. The tensor
// comes from the Client's pool; release it when done.
func (c *Client) Fetch(ctx context.Context, key string, opts ...FetchOption) (*Tensor, error) {
	var fo fetchOptions
	if len(opts) > 0 {
		// The options write through a pointer the compiler cannot follow:
		// to the heap only when there are any.
		p := new(fetchOptions)
		for _, o := range opts {
			o(p)
		}
		fo = *p
	}
	if err := fo.check(key); err != nil {
		return nil, err
	}
	s, err := c.start(ctx)
	if err != nil {
		return nil, err
	}
	defer c.leave()
	if len(c.opts.interceptors) == 0 {
		// Without the interceptors' closure, which would take fo and the
		// result to the heap.
		if ctx, err = clientCodec(ctx); err != nil {
			return nil, err
		}
		return s.calls.fetch(ctx, key, fo)
	}
	return c.fetchIntercepted(ctx, s, key, fo)
}

// fetchIntercepted is Fetch through the Client's interceptors.
func (c *Client) fetchIntercepted(ctx context.Context, s *clientSession, key string, fo fetchOptions) (*Tensor, error) {
	ctx, err := clientCodec(ctx)
	if err != nil {
		return nil, err
	}
	f := &interceptedFetch{s: s, key: key, fo: fo}
	err = c.interceptCall(ctx, s, &f.icall, OpFetch, key, 0, f)
	if err != nil && f.t != nil {
		f.t.Release() // an interceptor failed the call after it succeeded
		f.t = nil
	}
	return f.t, err
}

// interceptedFetch is a Fetch through interceptors, in one allocation.
type interceptedFetch struct {
	icall
	s   *clientSession
	key string
	fo  fetchOptions
	t   *Tensor // what came back
}

func (f *interceptedFetch) work(ctx context.Context, info *CallInfo) error {
	var err error
	f.t, err = f.s.calls.fetch(ctx, f.key, f.fo)
	if f.t != nil {
		info.setResponse(int64(len(f.t.Bytes())))
	}
	return err
}

// check checks the options before anything is asked for.
func (fo *fetchOptions) check(key string) error {
	if fo.rows != nil {
		if len(fo.rows) == 0 {
			return rowsErr("Fetch", key, "Rows names no row")
		}
		if len(fo.rows) > MaxRows {
			return rowsErr("Fetch", key, "%d rows, more than %d (MaxRows)", len(fo.rows), MaxRows)
		}
		for i, r := range fo.rows {
			if r < 0 {
				return rowsErr("Fetch", key, "row index %d (at %d) is negative", r, i)
			}
		}
	}
	if fo.into != nil {
		if err := checkOutgoing(fo.into, "Into's tensor"); err != nil {
			return err
		}
		if fo.into.Leased() {
			return status.Error(codes.InvalidArgument, "tensorrpc: Into's tensor is a read-only lease")
		}
		fo.lease = false
	}
	return nil
}

// matchInto checks that what meta describes fits dst.
func matchInto(meta *pb.TensorMeta, dst *Tensor) error {
	dtype, shape := shapeOf(meta)
	if dtype != dst.DType() || !slices.Equal(shape, dst.Shape()) {
		return status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q is %v%v, Into's tensor is %v%v", meta.Key, dtype, shape, dst.DType(), dst.Shape())
	}
	return nil
}

// intercept runs a call's work through the Client's interceptors. work
// sets what came back in info (nil, and nothing allocated, without
// interceptors).
func (c *Client) intercept(ctx context.Context, s *clientSession, op Operation, name string, reqBytes int64, work func(context.Context, *CallInfo) error) error {
	ctx, err := clientCodec(ctx)
	if err != nil {
		return err
	}
	if len(c.opts.interceptors) == 0 {
		return work(ctx, nil)
	}
	return c.interceptCall(ctx, s, &icall{}, op, name, reqBytes, workFunc(work))
}

// interceptCall is intercept, after clientCodec, for a Client that has
// interceptors, with the call's icall given (part of a larger allocation
// of the caller's) and its work w.
func (c *Client) interceptCall(ctx context.Context, s *clientSession, ic *icall, op Operation, name string, reqBytes int64, w callWork) error {
	ic.Context, ic.w = ctx, w
	ic.info = CallInfo{Op: op, Name: name, Client: true, Peer: c.cc.Target(), Session: s.id, Transport: s.transport, Path: s.path(), RequestBytes: reqBytes}
	err := intercept(ic, c.opts.interceptors, &ic.info, ic.next)
	ic.info.answered()
	return err
}

// receive materializes a tensor the server offered: inline bytes, or a
// transfer to read (or lease) and then release.
func (c *Client) receive(ctx context.Context, s *clientSession, l *engine.Link, meta *pb.TensorMeta, inline []byte, transferID uint64, fo fetchOptions) (*Tensor, error) {
	lease := fo.lease
	if err := checkMeta(meta, c.opts.maxTensorBytes); err != nil {
		c.releaseTransfer(s, transferID)
		return nil, err
	}
	if fo.into != nil {
		if err := matchInto(meta, fo.into); err != nil {
			c.releaseTransfer(s, transferID)
			return nil, err
		}
	}
	dtype, shape := shapeOf(meta)
	n := int(meta.ByteLength)
	loc := meta.Location
	if loc == nil {
		if len(inline) != n {
			return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: %d inline bytes for a %d-byte tensor", meta.Key, len(inline), n)
		}
		if err := verifySum(meta, inline); err != nil {
			return nil, err
		}
		explain(ctx, MovedInline, 0, min(n, 1))
		if fo.into != nil {
			copy(fo.into.Bytes(), inline)
			if n > 0 {
				c.stats.copied(n)
			}
			c.stats.transfers.Add(1)
			c.stats.inlineBytes.Add(int64(n))
			return fo.into, nil
		}
		buf, err := copyToPool(ctx, c.pool, inline, &c.stats)
		if err != nil {
			return nil, err
		}
		c.stats.transfers.Add(1)
		c.stats.inlineBytes.Add(int64(n))
		return newPoolTensor(dtype, shape, buf)
	}
	if l == nil || loc.Transport != transportOf(s.transport) || transferID == 0 {
		c.releaseTransfer(s, transferID)
		return nil, status.Errorf(codes.InvalidArgument, "tensorrpc: tensor %q: location on %s, session uses %s", meta.Key, loc.Transport, s.transport)
	}
	remote := verbs.Remote{Addr: loc.Address, Key: loc.RemoteKey}
	if fo.into != nil || fo.rowsOfSource {
		return c.receiveIn(ctx, s, l, meta, transferID, fo)
	}
	if lease {
		if m, ok := l.QP.(verbs.RemoteMapper); ok {
			mapping, err := m.MapRemote(remote, n)
			if err != nil {
				c.releaseTransfer(s, transferID)
				return nil, status.Errorf(codes.PermissionDenied, "tensorrpc: leasing tensor %q: %v", meta.Key, err)
			}
			zt, err := zerocopy.New(dtype, shape, mapping.Bytes())
			if err != nil {
				mapping.Release()
				c.releaseTransfer(s, transferID)
				return nil, status.Error(codes.InvalidArgument, err.Error())
			}
			if err := verifySum(meta, mapping.Bytes()); err != nil {
				mapping.Release()
				c.releaseTransfer(s, transferID)
				return nil, err
			}
			c.stats.transfers.Add(1)
			c.stats.leases.Add(1)
			c.stats.dataPlaneBytes.Add(int64(n))
			explain(ctx, MovedLeased, 0, 0)
			return &Tensor{Tensor: zt, lease: true, mapping: mapping, release: func() { c.releaseTransfer(s, transferID) }}, nil
		}
	}
	buf, err := allocBuffer(ctx, c.pool, n)
	if err != nil {
		c.releaseTransfer(s, transferID)
		return nil, err
	}
	if err := c.read(ctx, s, l, buf, remote, loc.Lanes, func() { c.releaseTransfer(s, transferID) }); err != nil {
		return nil, err
	}
	c.releaseTransfer(s, transferID)
	explain(ctx, MovedPulled, max(len(loc.Lanes), 1), 0)
	if err := verifySum(meta, buf.Bytes()); err != nil {
		buf.Release()
		return nil, err
	}
	return newPoolTensor(dtype, shape, buf)
}

// receiveIn reads a transfer into the caller's tensor (Into), and reads
// the rows asked for out of a granted source (rows_of_source): into dst
// in place where it can be registered (pool memory of this client, or
// caller memory the provider registers), else into pool memory, copied
// into dst once.
func (c *Client) receiveIn(ctx context.Context, s *clientSession, l *engine.Link, meta *pb.TensorMeta, transferID uint64, fo fetchOptions) (*Tensor, error) {
	n := int(meta.ByteLength)
	release := func() { c.releaseTransfer(s, transferID) }
	if n == 0 {
		release()
		c.stats.transfers.Add(1)
		if fo.into != nil {
			return fo.into, nil
		}
		buf, err := allocBuffer(ctx, c.pool, 0)
		if err != nil {
			return nil, err
		}
		return tensorOf(meta, buf)
	}
	var local verbs.Local
	var done func()
	var buf *mempool.Buffer
	if dst := fo.into; dst != nil {
		if dst.buf != nil {
			if lc, err := l.Domain.Reg.Local(dst.buf); err == nil {
				local, done = lc, func() {}
			}
		}
		if done == nil {
			if lc, d, err := l.Domain.CallerLocal(dst.Bytes(), verbs.AccessLocalWrite); err == nil {
				local, done = lc, d
			}
		}
	}
	if done == nil {
		b, err := allocBuffer(ctx, c.pool, n)
		if err != nil {
			release()
			return nil, err
		}
		lc, err := l.Domain.Reg.Local(b)
		if err != nil {
			b.Release()
			release()
			return nil, status.Error(codes.Internal, err.Error())
		}
		buf, local, done = b, lc, func() {}
	}
	local.Length = n
	ended := make(chan struct{}) // every Read has completed, after a failure
	failed := func() {
		done()
		if buf != nil {
			buf.Release()
		}
		release()
		close(ended)
	}
	var err error
	if fo.rowsOfSource {
		err = readRowsOfSource(ctx, l, s.lanes, local, meta, fo.sourceBytes, fo.rows, failed)
	} else {
		err = engine.ReadLanes(ctx, l, s.lanes, local, verbs.Remote{Addr: meta.Location.Address, Key: meta.Location.RemoteKey}, meta.Location.Lanes, failed)
	}
	if err != nil {
		if buf == nil {
			// Reads into the caller's memory: it is the caller's again
			// when Fetch returns, so none may still be under way.
			awaitReads(s, ended)
		}
		c.stats.errors.Add(1)
		return nil, err
	}
	done()
	release()
	c.stats.transfers.Add(1)
	c.stats.dataPlaneBytes.Add(int64(n))
	copies := 0
	if buf != nil && fo.into != nil {
		copies = 1 // read into the pool, then into Into's tensor
	}
	switch {
	case fo.rowsOfSource:
		explain(ctx, MovedRows, len(s.lanes), copies)
	case buf == nil:
		explain(ctx, MovedInPlace, max(len(meta.Location.Lanes), 1), 0)
	default:
		explain(ctx, MovedPulled, max(len(meta.Location.Lanes), 1), copies)
	}
	if dst := fo.into; dst != nil {
		if buf != nil {
			memcopy.Copy(dst.Bytes(), buf.Bytes()[:n])
			c.stats.copied(n)
			buf.Release()
		}
		if err := verifySum(meta, dst.Bytes()); err != nil {
			return nil, err
		}
		return dst, nil
	}
	if err := verifySum(meta, buf.Bytes()[:n]); err != nil {
		buf.Release()
		return nil, err
	}
	return tensorOf(meta, buf)
}

// readDrain bounds how long a Fetch into caller memory that failed or was
// given up waits for its Reads under way before it closes the lane, which
// ends them (and the session).
const readDrain = 5 * time.Second

// awaitReads waits until ended is closed: every Read of a failed transfer
// into caller memory has completed. A peer that holds one past readDrain
// has its lanes closed, which completes them (flushed).
func awaitReads(s *clientSession, ended <-chan struct{}) {
	select {
	case <-ended:
		return
	case <-time.After(readDrain):
	}
	s.end(fmt.Errorf("a Read into caller memory outlived its call by %v", readDrain))
	<-ended
}

// read reads len(buf) bytes from remote into buf over l, or striped over
// the session's lanes. On failure buf is released; if ctx ends while a
// Read is under way, buf and done run only once the Reads complete.
func (c *Client) read(ctx context.Context, s *clientSession, l *engine.Link, buf *mempool.Buffer, remote verbs.Remote, striped []*pb.LaneRemote, done func()) error {
	if buf.Len() == 0 {
		return nil
	}
	local, err := l.Domain.Reg.Local(buf)
	if err != nil {
		buf.Release()
		done()
		return status.Error(codes.Internal, err.Error())
	}
	err = engine.ReadLanes(ctx, l, s.lanes, local, remote, striped, func() {
		buf.Release()
		done()
	})
	if err != nil {
		c.stats.errors.Add(1)
		return err
	}
	c.stats.transfers.Add(1)
	c.stats.dataPlaneBytes.Add(int64(buf.Len()))
	return nil
}

// Send puts t into the server's rendezvous under key, where Server.Fetch
// and other clients' Fetch find it. t stays the caller's; a tensor over
// caller memory (WrapTensor) is copied into pool memory once first.
func (c *Client) Send(ctx context.Context, key string, t *Tensor) error {
	if err := checkOutgoing(t, "tensor"); err != nil {
		return err
	}
	s, err := c.start(ctx)
	if err != nil {
		return err
	}
	defer c.leave()
	if len(c.opts.interceptors) == 0 { // without the interceptors' closure
		if ctx, err = clientCodec(ctx); err != nil {
			return err
		}
		return s.calls.send(ctx, key, t)
	}
	return c.intercept(ctx, s, OpSend, key, int64(len(t.Bytes())), func(ctx context.Context, _ *CallInfo) error {
		return s.calls.send(ctx, key, t)
	})
}

// checkOutgoing checks a tensor the caller hands over.
func checkOutgoing(t *Tensor, what string) error {
	switch {
	case t == nil || !t.Valid():
		return status.Errorf(codes.InvalidArgument, "tensorrpc: %s is nil or invalid", what)
	case t.released.Load():
		return status.Errorf(codes.InvalidArgument, "tensorrpc: %s used after Release", what)
	}
	return nil
}

// Call invokes method on the server with req and returns its reply. The
// request's tensors stay the caller's; the reply's come from the Client's
// pool and are released with reply.Release.
func (c *Client) Call(ctx context.Context, method string, req *Message) (*Message, error) {
	if req == nil {
		req = &Message{}
	}
	for i, t := range req.Tensors {
		if checkOutgoing(t, "") != nil { // named only when it fails
			return nil, checkOutgoing(t, fmt.Sprintf("request tensor %d", i))
		}
	}
	s, err := c.start(ctx)
	if err != nil {
		return nil, err
	}
	defer c.leave()
	if len(c.opts.interceptors) == 0 {
		// Without the interceptors' closure, which would take the reply
		// to the heap.
		if ctx, err = clientCodec(ctx); err != nil {
			return nil, err
		}
		return s.calls.call(ctx, method, req)
	}
	return c.callIntercepted(ctx, s, method, req)
}

// callIntercepted is Call through the Client's interceptors.
func (c *Client) callIntercepted(ctx context.Context, s *clientSession, method string, req *Message) (*Message, error) {
	var reply *Message
	err := c.intercept(ctx, s, OpCall, method, tensorBytes(req.Tensors), func(ctx context.Context, info *CallInfo) error {
		var err error
		reply, err = s.calls.call(ctx, method, req)
		if reply != nil {
			info.setResponse(tensorBytes(reply.Tensors))
		}
		return err
	})
	if err != nil && reply != nil {
		reply.Release() // an interceptor failed the call after it succeeded
		reply = nil
	}
	return reply, err
}

func (c *Client) receiveReply(ctx context.Context, s *clientSession, l *engine.Link, metadata []byte, metas []*pb.TensorMeta, inline [][]byte, transfers []uint64, lands []*landing) (*Message, error) {
	reply := &Message{Metadata: metadata}
	next := 0
	fail := func(err error) (*Message, error) {
		reply.Release()
		for _, id := range transfers[min(next, len(transfers)):] {
			c.releaseTransfer(s, id)
		}
		return nil, err
	}
	for _, m := range metas {
		if m.LandingIndex != nil {
			t, err := c.landedReply(ctx, lands, m)
			if err != nil {
				return fail(err)
			}
			reply.Tensors = append(reply.Tensors, t)
			continue
		}
		var data []byte
		var id uint64
		switch {
		case m.InlineIndex != nil:
			i := int(*m.InlineIndex)
			if i >= len(inline) {
				return fail(status.Errorf(codes.InvalidArgument, "tensorrpc: reply tensor inline index %d out of range", i))
			}
			data = inline[i]
		case next < len(transfers):
			id = transfers[next]
			next++
		default:
			return fail(status.Error(codes.InvalidArgument, "tensorrpc: reply tensor without data"))
		}
		t, err := c.receive(ctx, s, l, m, data, id, fetchOptions{})
		if err != nil {
			return fail(err)
		}
		reply.Tensors = append(reply.Tensors, t)
	}
	return reply, nil
}

// sessionError turns a call's error into the error the caller sees: when
// the session ended under the call (the server restarted or the connection
// was lost), Unavailable, as gRPC reports calls cut off by a broken
// connection.
func sessionError(s *clientSession, err error) error {
	if serr := s.check(); serr != nil {
		if st, ok := status.FromError(err); ok && (st.Code() == codes.Canceled || st.Code() == codes.DeadlineExceeded) {
			return err
		}
		return serr
	}
	if status.Code(err) == codes.Unavailable && isSessionGone(err) {
		s.end(err)
	}
	return err
}

// isSessionGone reports whether the server said it does not know the
// session (it restarted, or ended the session).
func isSessionGone(err error) bool {
	st, _ := status.FromError(err)
	return strings.Contains(st.Message(), errSessionGone)
}

// roundTrip sends one request frame (raw, then msg) and waits for its
// response, its body decoded into what into returns. hold
// (if not nil) frees what the request granted the server: it runs once
// the server has answered or can no longer use it, which is later than
// roundTrip's return when ctx ends first (the call is then cancelled with
// a RELEASE of its ref). A body too large for a slot goes indirect. The
// caller's metadata and deadline (ctx) go before the body (frameHeaders);
// slots always have room for them and an indirect body's TensorMeta.
func (c *Client) roundTrip(ctx context.Context, s *clientSession, l *engine.Link, typ uint8, flags uint16, raw []byte, msg proto.Message, into func(uint16) proto.Message, hold func()) (engine.FrameReply, uint64, error) {
	if hold == nil {
		hold = func() {}
	}
	pre, err := callHeaders(ctx, len(raw))
	if err != nil {
		hold()
		return engine.FrameReply{}, 0, err
	}
	if wire.FrameHeaderLen+len(pre)+len(raw)+protoSize(msg) > l.Frames.SlotSize {
		meta, free, err := c.indirect(ctx, s, l, raw, msg)
		if err != nil {
			hold()
			return engine.FrameReply{}, 0, err
		}
		flags |= wire.FlagIndirect
		raw, msg = nil, meta
		held := hold
		hold = func() {
			free()
			held()
		}
	}
	if len(pre) > 0 {
		flags |= wire.FlagHeaders
		raw = append(pre, raw...)
	}
	ref := c.newRef()
	pc := l.Frames.Expect(ref, responseTo[typ], into)
	posted, err := l.PostFrame(ctx, typ, flags, ref, raw, msg, nil)
	if err != nil {
		if !posted {
			l.Frames.Forget(ref)
			hold()
		} else {
			l.Abandon(ref, pc, hold)
			c.releaseRef(s, ref)
		}
		return engine.FrameReply{}, ref, sessionError(s, err)
	}
	r, err := c.awaitReply(ctx, s, l, ref, pc, hold)
	return r, ref, err
}

// awaitReply waits for the answer pc awaits (to the request ref) and runs
// hold as roundTrip says.
func (c *Client) awaitReply(ctx context.Context, s *clientSession, l *engine.Link, ref uint64, pc *engine.PendingCall, hold func()) (engine.FrameReply, error) {
	if r, ok := l.AwaitAnswer(ctx, pc, c.opts.pollSpin, c.opts.pollSet); ok {
		hold()
		return r, nil
	}
	select {
	case <-pc.Ch:
		r := pc.Reply()
		hold()
		return r, nil
	case <-ctx.Done():
		l.Abandon(ref, pc, hold)
		c.releaseRef(s, ref) // cancels the server's call and frees what it made
		return engine.FrameReply{}, sessionError(s, status.FromContextError(ctx.Err()).Err())
	case <-l.Dead:
		// The receiver hands an answer over before it fails the link
		// for what followed it (a server that answered, then stopped):
		// an answer already here is the call's, whichever case select
		// picked.
		select {
		case <-pc.Ch:
			r := pc.Reply()
			hold()
			return r, nil
		default:
		}
		l.Abandon(ref, pc, hold) // runs when the link closes
		return engine.FrameReply{}, sessionError(s, engine.Unavailable(l.Failure))
	}
}

// protoSize is the length of m's encoding in a frame (0 for nil).
func protoSize(m proto.Message) int { return engine.MessageSize(m) }

// indirect puts a request body too large for a slot (raw, then msg) into
// a pool buffer and grants the server read access to it: the TensorMeta
// that an INDIRECT request frame carries instead, and what ends the grant
// and drops the buffer.
func (c *Client) indirect(ctx context.Context, s *clientSession, l *engine.Link, raw []byte, msg proto.Message) (*pb.TensorMeta, func(), error) {
	n := len(raw) + protoSize(msg)
	if n > MaxRecvMsgBytes {
		return nil, nil, status.Errorf(codes.ResourceExhausted, "tensorrpc: a request of %d bytes exceeds the %d bytes a server takes (MaxRecvMsgBytes)", n, MaxRecvMsgBytes)
	}
	buf, err := allocBuffer(ctx, c.pool, n)
	if err != nil {
		return nil, nil, err
	}
	b := append(buf.Bytes()[:0:n], raw...)
	if msg != nil {
		b, err = engine.AppendMessage(b, msg)
	}
	if err != nil || len(b) != n || &b[0] != &buf.Bytes()[0] {
		buf.Release()
		return nil, nil, status.Errorf(codes.Internal, "tensorrpc: encoding a request: %d of %d bytes: %v", len(b), n, err)
	}
	t, err := newPoolTensor(zerocopy.Uint8, []int64{int64(n)}, buf)
	if err != nil {
		return nil, nil, status.Error(codes.Internal, err.Error())
	}
	defer t.Release() // grantSource holds its own reference
	meta := metaOf("", t.Tensor, c.opts.checksums)
	loc, free, err := c.grantSource(ctx, s, l, outgoing{meta: meta, t: t})
	if err != nil {
		return nil, nil, err
	}
	meta.Location = loc
	return meta, free, nil
}

// answerOr is a pendingCall's into for a response whose body decodes into
// what m returns, or with frameIndirect into the TensorMeta naming it.
func answerOr(m func() proto.Message) func(uint16) proto.Message {
	return func(flags uint16) proto.Message {
		if flags&wire.FlagIndirect != 0 {
			return &pb.TensorMeta{}
		}
		return m()
	}
}

// answer is an OK response's message: its body, or for an INDIRECT one
// the transfer it names, read, released and decoded into a newMsg().
func (c *Client) answer(ctx context.Context, s *clientSession, l *engine.Link, ref uint64, r engine.FrameReply, newMsg func() proto.Message) (proto.Message, error) {
	if r.Flags&wire.FlagIndirect == 0 {
		return r.Msg, nil
	}
	meta := r.Msg.(*pb.TensorMeta)
	if meta.Dtype != pb.DType(zerocopy.Uint8) || meta.TransferId == 0 {
		c.releaseRef(s, ref)
		return nil, status.Error(codes.Internal, "tensorrpc: the server's indirect answer is not a byte transfer")
	}
	t, err := c.receive(ctx, s, l, meta, nil, meta.TransferId, fetchOptions{})
	if err != nil {
		c.releaseRef(s, ref)
		return nil, err
	}
	m := newMsg()
	err = proto.Unmarshal(t.Bytes(), m)
	t.Release()
	if err != nil {
		c.releaseRef(s, ref)
		return nil, status.Errorf(codes.Internal, "tensorrpc: the server's answer: %v", err)
	}
	return m, nil
}

// What an indirect answer decodes into (answer's newMsg): made only for
// one, not for every answer.
func newFetchResponse() proto.Message { return &pb.FetchResponse{} }
func newCallResponse() proto.Message  { return &pb.CallResponse{} }

// responseTo is the response type of each request type.
var responseTo = map[uint8]uint8{wire.FrameFetchReq: wire.FrameFetchResp, wire.FrameSendReq: wire.FrameSendResp, wire.FrameCallReq: wire.FrameCallResp}

// askFrame is a Fetch's request as a FETCH_REQ frame on the session's
// data plane, answered by a FETCH_RESP (see rpc/internal/engine/frame.go) on the lane l.
func (c *Client) askFrame(ctx context.Context, s *clientSession, l *engine.Link, key string, fo fetchOptions) (*pb.FetchResponse, error) {
	var flags uint16
	if fo.wait {
		flags |= wire.FlagWait
	}
	if fo.lease {
		flags |= wire.FlagLease
	}
	raw, msg := []byte(key), proto.Message(nil)
	var hold func()
	switch {
	case fo.rows != nil:
		flags |= wire.FlagRows
		raw, msg = nil, &pb.FetchRequest{Key: key, Rows: fo.rows}
	case fo.land != nil:
		flags |= wire.FlagLanding
		raw, msg, hold = nil, fo.land.request(key), fo.land.revoke
	}
	r, ref, err := c.roundTrip(ctx, s, l, wire.FrameFetchReq, flags, raw, msg, intoFetchAnswer, hold)
	if err != nil {
		return nil, err
	}
	if err := c.replyError(s, ref, r); err != nil {
		return nil, err
	}
	m, err := c.answer(ctx, s, l, ref, r, newFetchResponse)
	if err != nil {
		return nil, err
	}
	if a, ok := m.(*fetchAnswer); ok {
		return &a.FetchResponse, nil
	}
	return m.(*pb.FetchResponse), nil
}

// intoCallAnswer is what a Call's answer frame decodes into, by its
// flags.
func intoCallAnswer(flags uint16) proto.Message {
	if flags&wire.FlagIndirect != 0 {
		return &pb.TensorMeta{}
	}
	return &callAnswer{}
}

// intoFetchAnswer is what a Fetch's answer frame decodes into, by its
// flags (answerOr's for a FetchResponse, without a closure a call).
func intoFetchAnswer(flags uint16) proto.Message {
	if flags&wire.FlagIndirect != 0 {
		return &pb.TensorMeta{}
	}
	return &fetchAnswer{}
}

// replyError is the error a response frame carries: the server's status,
// or Internal when it broke the format (what the call made is freed).
func (c *Client) replyError(s *clientSession, ref uint64, r engine.FrameReply) error {
	if r.Bad != nil {
		c.releaseRef(s, ref)
		return status.Errorf(codes.Internal, "tensorrpc: the server's answer: %v", r.Bad)
	}
	if r.Status != nil {
		return sessionError(s, r.Status)
	}
	return nil
}

// crossMemory is a queue pair whose peer reaches memory of this process
// that is not shared only by cross-memory attach (shm.CrossMemory): CMA
// says whether it can.
type crossMemory interface{ CMA() error }

// peersReachCallerMemory reports whether the peer of every lane can read
// caller memory granted in place: always on planes that carry the bytes
// themselves (tcp, ibv), on shm only where cross-memory attach works
// between the two processes.
func peersReachCallerMemory(lanes []*engine.Link) bool {
	for _, l := range lanes {
		if cm, ok := l.QP.(crossMemory); ok && cm.CMA() != nil {
			return false
		}
	}
	return true
}

// ownPoolMemory reports whether t is memory of the Client's pool.
func (c *Client) ownPoolMemory(t *Tensor) bool {
	if t.buf == nil || t.buf.Len() == 0 {
		return false
	}
	a, _, ok := c.pool.Locate(t.buf.Addr())
	return ok && a == t.buf.Arena()
}

// grantSource makes out readable by the server for one request frame:
// a read-only grant on the lane l (and on every lane, for a striped
// transfer), described as a Location. A host tensor is granted from a
// pool buffer holding it (its own when it is pool memory). free ends the
// grants and drops the buffer.
//
// free is for what the peer has answered (or a request it never saw, or
// a link that closed): no read of the peer can be under way, so it does
// not wait for the peer to confirm the revocations (on shm a message
// each way, which a Send of 64 KiB waited for, one more wake-up of its
// caller), and the buffer goes back once they are complete.
func (c *Client) grantSource(ctx context.Context, s *clientSession, l *engine.Link, out outgoing) (loc *pb.Location, free func(), err error) {
	loc, f, _, err := c.grantSourceIn(ctx, s, l, out)
	if err != nil {
		return nil, nil, err
	}
	return loc, f.later, nil
}

// grantFree ends a grantSource's grants and drops its buffer, once:
// later, without waiting for the peer, or now, waiting until they are
// ended (also when later began it).
type grantFree struct {
	once    sync.Once
	ended   chan struct{}
	g       verbs.Grant
	extra   []verbs.Grant
	release func()
}

func (f *grantFree) start(wait bool) {
	f.once.Do(func() {
		fin := func() {
			f.release()
			close(f.ended)
		}
		if wait {
			f.g.Revoke()
			engine.RevokeAll(f.extra)
			fin()
			return
		}
		engine.RevokeThen(f.g, f.extra, fin)
	})
}

func (f *grantFree) later() { f.start(false) }

func (f *grantFree) now() {
	f.start(true)
	<-f.ended
}

// grantSourceIn is grantSource, and reports whether it granted caller
// memory in place: then free.now must run before the caller may reuse
// it, even when the call is given up (it ends the grants, and waits for
// a read of the peer under way).
func (c *Client) grantSourceIn(ctx context.Context, s *clientSession, l *engine.Link, out outgoing) (loc *pb.Location, free *grantFree, inPlace bool, err error) {
	n := out.len()
	grantOn := func(x *engine.Link) (verbs.Grant, error) {
		return x.QP.Grant(out.region, out.offset, n, verbs.AccessRemoteRead)
	}
	release := func() {}
	region := uint32(0)
	if out.t != nil && !c.noInPlace && !c.ownPoolMemory(out.t) && peersReachCallerMemory(s.lanes) {
		// Caller memory, granted in place where the provider registers it.
		if local, done, err := l.Domain.CallerLocal(out.t.Bytes()[:n], verbs.AccessRemoteRead); err == nil {
			grantOn = func(x *engine.Link) (verbs.Grant, error) {
				return x.QP.Grant(local.Region, local.Offset, n, verbs.AccessRemoteRead)
			}
			release = done
			out.t, inPlace = nil, true
		}
	}
	if out.t != nil {
		src, err := poolBuffer(ctx, c.pool, out.t, &c.stats)
		if err != nil {
			return nil, nil, false, err
		}
		grantOn = func(x *engine.Link) (verbs.Grant, error) { return x.Grant(src, n, verbs.AccessRemoteRead) }
		release = func() { src.Release() }
		region = src.Arena().ID()
	}
	g, err := grantOn(l)
	if err != nil {
		release()
		return nil, nil, false, engine.Unavailable(err)
	}
	extra, striped, err := engine.GrantLanes(s.lanes, l, g, n, grantOn)
	if err != nil {
		g.Revoke()
		release()
		return nil, nil, false, engine.Unavailable(err)
	}
	r := g.Remote()
	loc = &pb.Location{Transport: transportOf(s.transport), RegionId: region, RemoteKey: r.Key, Address: r.Addr, Length: uint64(n), Lanes: striped}
	return loc, &grantFree{ended: make(chan struct{}), g: g, extra: extra, release: release}, inPlace, nil
}

// sendFrame is Send as a SEND_REQ: the tensor inline, or granted to the
// server, which reads and publishes it before it answers.
func (c *Client) sendFrame(ctx context.Context, s *clientSession, out outgoing) (err error) {
	l := s.lane()
	req := &pb.SendRequest{Meta: out.meta, Rows: out.rows}
	n := out.len()
	var free *grantFree
	inPlace := false
	if out.t != nil && n <= engine.FrameInline(s.eager) {
		req.InlineData = out.t.Bytes()
	} else {
		if req.Meta.Location, free, inPlace, err = c.grantSourceIn(ctx, s, l, out); err != nil {
			out.finish()
			return err
		}
	}
	hold := func() {
		if free != nil {
			free.later() // answered, or never sent, or the link closed
		}
		out.finish()
	}
	r, ref, err := c.roundTrip(ctx, s, l, wire.FrameSendReq, 0, nil, sendRequestBody{req}, func(uint16) proto.Message { return &pb.SendResponse{} }, hold)
	if err == nil {
		err = c.replyError(s, ref, r)
	}
	if err != nil {
		if inPlace {
			free.now() // the caller's memory is the caller's again when Send returns
		}
		c.stats.errors.Add(1)
		return err
	}
	c.stats.transfers.Add(1)
	switch {
	case req.Meta.Location == nil:
		c.stats.inlineBytes.Add(int64(n))
		c.stats.copied(n) // into the frame
		explain(ctx, MovedInline, 0, min(n, 1))
	case inPlace:
		c.stats.dataPlaneBytes.Add(int64(n))
		explain(ctx, MovedInPlace, max(len(req.Meta.Location.Lanes), 1), 0)
	default:
		c.stats.dataPlaneBytes.Add(int64(n))
		copies := 0
		if out.t != nil && !c.ownPoolMemory(out.t) {
			copies = 1 // into the pool, for the server to read
		}
		explain(ctx, MovedPulled, max(len(req.Meta.Location.Lanes), 1), copies)
	}
	return nil
}

// runAll calls each of fs.
func runAll(fs []func()) {
	for _, f := range fs {
		f()
	}
}

// callFrame is Call as a CALL_REQ: tensors inline while they fit a slot,
// the rest granted to the server, which reads them all at once; one
// CALL_RESP answers.
func (c *Client) callFrame(ctx context.Context, s *clientSession, method string, req *Message) (*Message, error) {
	l := s.lane()
	creq := &pb.CallRequest{Method: method, Metadata: req.Metadata, Tensors: make([]*pb.TensorMeta, 0, len(req.Tensors))}
	// What roundTrip holds until the answer (the grants of the request's
	// tensors, the reply's landings): nil, no closure, when nothing.
	var frees []func()
	var hold func()
	budget := engine.FrameInline(s.eager)
	var idxs []uint32 // the inline indexes, one allocation for all
	for _, t := range req.Tensors {
		meta := metaOf("", t.Tensor, c.opts.checksums)
		if n := len(t.Bytes()); n <= budget {
			budget -= n
			if idxs == nil {
				idxs = make([]uint32, len(req.Tensors))
			}
			i := len(creq.InlineData)
			idxs[i] = uint32(i)
			meta.InlineIndex = &idxs[i]
			creq.InlineData = append(creq.InlineData, t.Bytes())
		} else {
			loc, free, err := c.grantSource(ctx, s, l, outgoing{meta: meta, t: t})
			if err != nil {
				runAll(frees)
				return nil, err
			}
			frees = append(frees, free)
			meta.Location = loc
		}
		creq.Tensors = append(creq.Tensors, meta)
	}
	if len(frees) > 0 {
		hold = func() { runAll(frees) }
	}
	lands := c.replyLandings(ctx, s, l, method)
	if len(lands) > 0 {
		creq.ReplyLandings = replyLocations(lands)
		held := hold
		hold = func() {
			revokeAll(lands)
			if held != nil {
				held()
			}
		}
		defer doneAll(lands)
	}
	r, ref, err := c.roundTrip(ctx, s, l, wire.FrameCallReq, 0, nil, callRequestBody{creq}, intoCallAnswer, hold)
	if err != nil {
		return nil, err
	}
	if err := c.replyError(s, ref, r); err != nil {
		return nil, err
	}
	m, err := c.answer(ctx, s, l, ref, r, newCallResponse)
	if err != nil {
		return nil, err
	}
	resp, ok := m.(*pb.CallResponse)
	if a, isA := m.(*callAnswer); isA {
		resp, ok = &a.CallResponse, true
	}
	if !ok {
		return nil, status.Errorf(codes.Internal, "tensorrpc: a Call's answer decoded as %T", m)
	}
	for _, t := range req.Tensors {
		c.stats.transfers.Add(1)
		if n := int64(len(t.Bytes())); n <= int64(engine.FrameInline(s.eager)) {
			c.stats.inlineBytes.Add(n)
		} else {
			c.stats.dataPlaneBytes.Add(n)
		}
	}
	reply, err := c.receiveReply(ctx, s, l, resp.Metadata, resp.Tensors, resp.InlineData, resp.TransferIds, lands)
	recycleInlines(resp.InlineData) // copied into the reply's tensors, or failed
	if err == nil && s.landing > 0 {
		var sizes []int
		for _, m := range resp.Tensors {
			if m.InlineIndex == nil {
				sizes = append(sizes, int(m.ByteLength))
			}
		}
		s.replyHints.put(method, sizes)
	}
	return reply, err
}
