package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// Negotiation is one side's part in negotiating one data plane of a
// session: steps 1 and 2 of the Session method in the .proto. Both sides
// run the same steps; Role sets who speaks first in step 2.
type Negotiation struct {
	// Role is the side: verbs.RoleDial for the client, which Sends the
	// verifying messages and hears the verdict last, verbs.RoleAccept for
	// the server, which echoes them and opens the session before it
	// reports its verdict.
	Role verbs.ConnectRole
	// Session is the session id, which the verifying round trip carries.
	Session   string
	Transport pb.Transport
	// Lanes are this side's links, frames enabled; Remotes the peer's
	// connection info for each.
	Lanes   []*Link
	Remotes [][]byte
	// Timeout bounds connecting, and again the verifying round trip.
	Timeout time.Duration
	// Send sends this side's connect result over the session's stream.
	Send func(*pb.ConnectResult) error
	// Recv reads the peer's next message and returns its connect result
	// (nil when it is another message). It stops reading when ctx ends.
	Recv func(ctx context.Context) (*pb.ConnectResult, error)
	// Open, on the accepting side, opens the session on Lanes once both
	// sides have verified them, before this side reports so: the peer may
	// call as soon as it hears. Its error rejects the plane. The dialling
	// side hears the verdict last and opens once Negotiate returns.
	Open func() error
}

// Outcome is how a data plane's negotiation ended: Reason is why the
// plane is not used ("" when the session is open on it); Theirs says the
// peer rejected it (Reason is then the peer's report), Peer names the
// peer ("client" or "server").
type Outcome struct {
	Reason string
	Theirs bool
	Peer   string
}

// String is Reason with whose it is: a reason from the peer starts with
// its name. It is what the accepting side reports as its verdict.
func (o Outcome) String() string {
	if o.Theirs {
		return o.Peer + ": " + o.Reason
	}
	return o.Reason
}

// Negotiate runs n: connect every lane and report (step 1), then, if both
// sides connected, the verifying round trip over each lane in n.Role's
// order and the exchange of verdicts (step 2). The wire messages and
// their order are the .proto's. It returns an error only when the session
// itself failed (its stream, or a peer that sent another message than the
// connect result expected); a plane either side rejected is an Outcome
// with a Reason.
func Negotiate(ctx context.Context, n Negotiation) (Outcome, error) {
	peer := peerName(n.Role)
	if peer == "" {
		return Outcome{}, fmt.Errorf("tensorrpc: negotiation in role %v", n.Role)
	}
	mine := func(reason string) Outcome { return Outcome{Reason: reason, Peer: peer} }
	theirs := func(reason string) Outcome { return Outcome{Reason: reason, Theirs: true, Peer: peer} }
	report := func(ok, verify bool, err error) error {
		r := &pb.ConnectResult{Transport: n.Transport, Ok: ok, Verify: verify}
		if err != nil {
			r.Error = err.Error()
		}
		return n.Send(r)
	}
	theirResult := func(ctx context.Context, verify bool) (*pb.ConnectResult, error) {
		r, err := n.Recv(ctx)
		if err != nil {
			return nil, err
		}
		if r == nil || r.Transport != n.Transport || r.Verify != verify {
			// The server answers a confused client's argument; to the
			// client, a server that says the unexpected is broken.
			code := codes.Internal
			if n.Role == verbs.RoleAccept {
				code = codes.InvalidArgument
			}
			return nil, status.Errorf(code, "tensorrpc: expected the %s's connect result", peer)
		}
		return r, nil
	}

	// Step 1: connect, report at once, and give up as soon as the peer
	// reports failure.
	connect := func(ctx context.Context) error { return ConnectLanes(ctx, n.Lanes, n.Remotes) }
	o, err := connectBoth(ctx, n.Timeout, connect,
		func(ok bool, err error) error { return report(ok, false, err) },
		func(ctx context.Context) (*pb.ConnectResult, error) { return theirResult(ctx, false) }, peer)
	if err != nil {
		return Outcome{}, err
	}
	switch {
	case o.Mine != nil && !o.Abandoned:
		return mine("connect: " + o.Mine.Error()), nil
	case !o.Theirs.Ok:
		return theirs("connect: " + o.Theirs.Error), nil
	}

	// Step 2: the round trip over every lane, then both verdicts: the
	// dialling side reports first; the accepting side hears it, opens the
	// session if both verified, and answers.
	vctx, vcancel := context.WithTimeout(ctx, n.Timeout)
	defer vcancel()
	verify := verifyDialling
	if n.Role == verbs.RoleAccept {
		verify = verifyAccepting
	}
	verr := verify(vctx, n.Session, n.Lanes, peer)
	if verr != nil {
		verr = fmt.Errorf("verifying round trip: %w", verr)
	}
	// hear reads the peer's verdict and weighs it with this side's.
	hear := func() (Outcome, error) {
		their, err := theirResult(ctx, true)
		switch {
		case err != nil:
			return Outcome{}, err
		case verr != nil:
			return mine(verr.Error()), nil
		case !their.Ok || !their.Verify:
			return theirs(their.Error), nil
		}
		return Outcome{Peer: peer}, nil
	}
	if n.Role == verbs.RoleDial {
		if err := report(verr == nil, true, verr); err != nil {
			return Outcome{}, err
		}
		out, err := hear()
		if err == nil && out.Reason == "" {
			for _, l := range n.Lanes {
				l.Verified.Store(true)
			}
		}
		return out, err
	}
	out, err := hear()
	if err != nil {
		return Outcome{}, err
	}
	if out.Reason == "" && n.Open != nil {
		if err := n.Open(); err != nil {
			out = mine(err.Error())
		}
	}
	var rerr error
	if out.Reason != "" {
		rerr = errors.New(out.String())
	}
	// If the session opened, whoever opened it closes it on this error.
	return out, report(out.Reason == "", true, rerr)
}

// peerName names the peer of a side in role ("" for no side).
func peerName(role verbs.ConnectRole) string {
	switch role {
	case verbs.RoleDial:
		return "server"
	case verbs.RoleAccept:
		return "client"
	}
	return ""
}

// verifyDialling is the dialling side's round trip: it Sends the
// verifying message on every lane, then checks every echo.
func verifyDialling(ctx context.Context, id string, lanes []*Link, peer string) error {
	for i, l := range lanes {
		if err := l.SendVerify(ctx, VerifyMessage(id, i)); err != nil {
			return onLane(i, lanes, err)
		}
	}
	for i, l := range lanes {
		echo, err := l.RecvVerify(ctx)
		if err == nil {
			err = checkVerify(echo, id, i, peer)
		}
		if err != nil {
			return onLane(i, lanes, err)
		}
	}
	return nil
}

// verifyAccepting is the accepting side's round trip: on each lane in
// turn it checks the peer's verifying message and echoes it. A lane whose
// message checked is Verified before the echo goes: from then on what
// arrives on it are frames.
func verifyAccepting(ctx context.Context, id string, lanes []*Link, peer string) error {
	for i, l := range lanes {
		msg, err := l.RecvVerify(ctx)
		if err == nil {
			err = checkVerify(msg, id, i, peer)
		}
		if err == nil {
			l.Verified.Store(true)
			err = l.SendVerify(ctx, msg)
		}
		if err != nil {
			return onLane(i, lanes, err)
		}
	}
	return nil
}

func checkVerify(msg []byte, id string, i int, peer string) error {
	if !bytes.Equal(msg, VerifyMessage(id, i)) {
		return fmt.Errorf("the %s's verifying message %q is not the session id", peer, msg)
	}
	return nil
}

// onLane names lane i in err when there are several.
func onLane(i int, lanes []*Link, err error) error {
	if len(lanes) > 1 {
		return fmt.Errorf("lane %d: %w", i, err)
	}
	return err
}

// VerifyMessage is what the verifying round trip carries on lane i: the
// session id, and on lanes after the first the lane's number, so lanes
// connected crosswise fail to verify.
func VerifyMessage(id string, i int) []byte {
	if i == 0 {
		return []byte(id)
	}
	return fmt.Appendf(nil, "%s/%d", id, i)
}

// connectOutcome is how step 1 of a data plane's negotiation ended on one
// side: its own error (nil when it connected; abandoned when it gave up
// because the peer had failed) and the peer's report.
type connectOutcome struct {
	Mine      error
	Abandoned bool
	Theirs    *pb.ConnectResult
}

// connectBoth runs step 1 of a data plane's negotiation, the same on both
// sides: connect (within timeout; connectLanes), report the outcome at once with
// report, and read the peer's report with theirResult; when the peer has
// failed, stop waiting for our own attempt. peer names the other side in
// the reason of an abandoned attempt. It returns an error only when the
// session itself failed. It leaves no goroutine behind: theirResult stops
// reading when its context ends, and connectBoth waits for it to return
// before it does, so no message of the session's stream is read after.
func connectBoth(ctx context.Context, timeout time.Duration, connect func(context.Context) error,
	report func(ok bool, err error) error, theirResult func(context.Context) (*pb.ConnectResult, error), peer string) (connectOutcome, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	mine := make(chan error, 1)
	go func() { mine <- connect(cctx) }()
	theirs := make(chan *pb.ConnectResult, 1)
	theirsErr := make(chan error, 1)
	rctx, stopReading := context.WithCancel(ctx)
	read := make(chan struct{})
	defer func() {
		stopReading()
		<-read
	}()
	go func() {
		defer close(read)
		r, err := theirResult(rctx)
		if err != nil {
			theirsErr <- err
			return
		}
		theirs <- r
	}()
	var out connectOutcome
	haveMine := false
	for !haveMine || out.Theirs == nil {
		select {
		case out.Mine = <-mine:
			haveMine = true
			if out.Theirs != nil && !out.Theirs.Ok && out.Mine != nil {
				out.Mine, out.Abandoned = fmt.Errorf("abandoned: the %s failed to connect", peer), true
			}
			if err := report(out.Mine == nil, out.Mine); err != nil {
				return out, err
			}
		case out.Theirs = <-theirs:
			if !out.Theirs.Ok {
				cancel() // the peer failed: stop waiting for our side
			}
		case err := <-theirsErr:
			cancel()
			if !haveMine {
				<-mine
			}
			return out, err
		}
	}
	return out, nil
}
