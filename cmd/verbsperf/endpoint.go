package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// endpoint is one end of a test: a domain, one completion queue for sends
// and receives, a queue pair and a registered buffer of the message size.
type endpoint struct {
	pd   verbs.ProtectionDomain
	cq   verbs.CompletionQueue
	qp   verbs.QueuePair
	mr   verbs.MemoryRegion
	free func()
}

// regionDesc names an endpoint's buffer for its peer.
type regionDesc struct {
	Addr uint64
	Key  uint32
	Len  int
}

func newEndpoint(spec providerSpec, host string, size, depth int) (_ *endpoint, err error) {
	e := &endpoint{}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	if e.pd, err = spec.new(host).Open(""); err != nil {
		return nil, fmt.Errorf("opening the device: %w", err)
	}
	queue := max(depth, 16)
	if e.cq, err = e.pd.NewCompletionQueue(2 * queue); err != nil {
		return nil, fmt.Errorf("making a completion queue: %w", err)
	}
	e.qp, err = e.pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: e.cq, RecvCQ: e.cq, MaxSend: queue, MaxRecv: queue})
	if err != nil {
		return nil, fmt.Errorf("making a queue pair: %w", err)
	}
	mem, free, err := spec.newMemory(max(size, 1))
	if err != nil {
		return nil, fmt.Errorf("allocating %d bytes: %w", size, err)
	}
	e.free = free
	e.mr, err = e.pd.RegisterMemory(mem, verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead)
	if err != nil {
		return nil, fmt.Errorf("registering %d bytes: %w", size, err)
	}
	return e, nil
}

func (e *endpoint) desc() regionDesc {
	return regionDesc{Addr: e.mr.Addr(), Key: e.mr.RemoteKey(), Len: e.mr.Len()}
}

// close releases everything, the queue pair first so that nothing uses the
// buffer when it is deregistered and freed.
func (e *endpoint) close() {
	if e.qp != nil {
		e.qp.Close()
		e.qp = nil
	}
	if e.mr != nil {
		e.mr.Deregister()
		e.mr = nil
	}
	if e.cq != nil {
		e.cq.Close()
		e.cq = nil
	}
	if e.pd != nil {
		e.pd.Close()
		e.pd = nil
	}
	if e.free != nil {
		e.free()
		e.free = nil
	}
}

// connectBoth connects two local endpoints to each other.
func connectBoth(ctx context.Context, a, b *endpoint) error {
	done := make(chan error, 1)
	go func() { done <- b.qp.Connect(ctx, a.qp.LocalInfo()) }()
	errA := a.qp.Connect(ctx, b.qp.LocalInfo())
	return errors.Join(errA, <-done)
}

// params describes one measurement.
type params struct {
	Test     string
	Size     int
	Iters    int
	Depth    int
	Duration time.Duration
}

// result is the outcome of one measurement.
type result struct {
	iters   int
	bytes   int64
	elapsed time.Duration
	lat     []time.Duration // half round trips, for latency tests
	// marks are the completions counted so far at times since the start,
	// after each poll of a bandwidth test: what its peak is taken from.
	marks []mark
}

type mark struct {
	at   time.Duration
	done int
}

var tests = map[string]struct {
	latency bool
	op      verbs.Opcode
}{
	"write_bw":  {false, verbs.OpWrite},
	"read_bw":   {false, verbs.OpRead},
	"write_lat": {true, verbs.OpWriteImm},
	"send_lat":  {true, verbs.OpSend},
}

// runActive runs the measuring side of a test against the peer's buffer.
func runActive(ctx context.Context, e *endpoint, remote regionDesc, p params) (result, error) {
	t := tests[p.Test]
	if t.latency {
		return latency(ctx, e, remote, p, t.op)
	}
	return bandwidth(ctx, e, remote, p, t.op)
}

// bandwidth keeps up to Depth requests in flight until Iters have
// completed or Duration has passed.
func bandwidth(ctx context.Context, e *endpoint, remote regionDesc, p params, op verbs.Opcode) (result, error) {
	wr := verbs.SendRequest{Op: op,
		Local:  verbs.Local{Region: e.mr, Length: p.Size},
		Remote: verbs.Remote{Addr: remote.Addr, Key: remote.Key}}
	out := make([]verbs.Completion, p.Depth)
	start := time.Now()
	deadline := start.Add(p.Duration)
	posted, done := 0, 0
	marks := make([]mark, 1, 1024)
	for {
		for posted < p.Iters && posted-done < p.Depth && time.Now().Before(deadline) {
			wr.ID = uint64(posted)
			if err := e.qp.PostSend(wr); err != nil {
				return result{}, fmt.Errorf("posting %v %d: %w", op, posted, err)
			}
			posted++
		}
		if done == posted {
			break
		}
		n, err := e.cq.Wait(ctx, out)
		if err != nil {
			return result{}, fmt.Errorf("waiting for completions (%d of %d done): %w", done, posted, err)
		}
		for _, c := range out[:n] {
			if err := verbs.CompletionError(c); err != nil {
				return result{}, err
			}
		}
		done += n
		marks = append(marks, mark{time.Since(start), done})
	}
	elapsed := time.Since(start)
	return result{iters: done, bytes: int64(done) * int64(p.Size), elapsed: elapsed, marks: marks}, nil
}

// latency sends one message (Send or WriteImm) at a time and waits for the
// peer's echo; each sample is half the round trip, as perftest reports.
func latency(ctx context.Context, e *endpoint, remote regionDesc, p params, op verbs.Opcode) (result, error) {
	recv := verbs.RecvRequest{Local: verbs.Local{Region: e.mr, Length: p.Size}}
	if err := e.qp.PostRecv(recv); err != nil {
		return result{}, fmt.Errorf("posting a receive: %w", err)
	}
	wr := verbs.SendRequest{Op: op, Local: verbs.Local{Region: e.mr, Length: p.Size},
		Remote: verbs.Remote{Addr: remote.Addr, Key: remote.Key}}
	out := make([]verbs.Completion, 16)
	res := result{lat: make([]time.Duration, 0, min(p.Iters, 1<<16))}
	start := time.Now()
	deadline := start.Add(p.Duration)
	for i := 0; i < p.Iters && time.Now().Before(deadline); i++ {
		t0 := time.Now()
		wr.ID = uint64(i)
		if err := e.qp.PostSend(wr); err != nil {
			return result{}, fmt.Errorf("posting %v %d: %w", op, i, err)
		}
		if err := waitReceive(ctx, e, out); err != nil {
			return result{}, fmt.Errorf("round trip %d: %w", i, err)
		}
		res.lat = append(res.lat, time.Since(t0)/2)
		if err := e.qp.PostRecv(recv); err != nil {
			return result{}, fmt.Errorf("posting a receive: %w", err)
		}
	}
	res.elapsed = time.Since(start)
	res.iters = len(res.lat)
	res.bytes = int64(res.iters) * int64(p.Size)
	return res, nil
}

// waitReceive polls the completion queue until a receive completes; send
// completions are consumed on the way.
func waitReceive(ctx context.Context, e *endpoint, out []verbs.Completion) error {
	for {
		n, err := e.cq.Wait(ctx, out)
		if err != nil {
			return err
		}
		got := false
		for _, c := range out[:n] {
			if err := verbs.CompletionError(c); err != nil {
				return err
			}
			got = got || c.Op == verbs.OpRecv || c.Op == verbs.OpRecvImm
		}
		if got {
			return nil
		}
	}
}

// runPassive serves the peer's test: for latency tests it echoes every
// message it receives, up to Iters, until ctx ends.
func runPassive(ctx context.Context, e *endpoint, remote regionDesc, p params) error {
	t := tests[p.Test]
	if !t.latency {
		<-ctx.Done()
		return nil
	}
	recv := verbs.RecvRequest{Local: verbs.Local{Region: e.mr, Length: p.Size}}
	if err := e.qp.PostRecv(recv); err != nil {
		return fmt.Errorf("posting a receive: %w", err)
	}
	wr := verbs.SendRequest{Op: t.op, Local: verbs.Local{Region: e.mr, Length: p.Size},
		Remote: verbs.Remote{Addr: remote.Addr, Key: remote.Key}}
	out := make([]verbs.Completion, 16)
	for i := 0; i < p.Iters; i++ {
		if err := waitReceive(ctx, e, out); err != nil {
			if ctx.Err() != nil {
				return nil // the active side stopped early
			}
			return fmt.Errorf("echo %d: %w", i, err)
		}
		if err := e.qp.PostRecv(recv); err != nil {
			return fmt.Errorf("posting a receive: %w", err)
		}
		if err := e.qp.PostSend(wr); err != nil {
			return fmt.Errorf("posting echo %d: %w", i, err)
		}
	}
	<-ctx.Done()
	return nil
}
