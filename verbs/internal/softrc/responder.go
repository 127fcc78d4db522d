package softrc

import (
	"errors"
	"fmt"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// This file holds the parts of RC's responder and requester rules that
// every soft wire applies the same way: whether a Send may land in a
// receive, what a responder's refusal means to the requester, and holding
// a request's local memory while its data moves.

// Fit checks that a message of n bytes may land in receive r: it fits
// (else StatusLocalLength, and the sender gets StatusRemoteInvalidRequest)
// and r's regions are live (else StatusLocalProtection, and the sender
// gets StatusRemoteOperation). As on RC, either failure fails the receive
// with local and the receiver's queue pair, and the sender's request with
// remote; cause says why. On success r's regions are held (Vec.Acquire)
// until the caller releases them.
func (r *RecvWR) Fit(n uint64) (local, remote verbs.Status, cause error) {
	if n > uint64(r.N) {
		return verbs.StatusLocalLength, verbs.StatusRemoteInvalidRequest, fmt.Errorf("a message of %d bytes does not fit the receive of %d bytes", n, r.N)
	}
	if bad, ok := r.Vec.Acquire(); !ok {
		return verbs.StatusLocalProtection, verbs.StatusRemoteOperation, fmt.Errorf("the receive's region %#x was deregistered", bad.LocalKey())
	}
	return verbs.StatusSuccess, verbs.StatusSuccess, nil
}

// Hold references the regions of v for a copy (Vec.Acquire): a
// deregistered one fails the request with StatusLocalProtection and the
// returned cause.
func (v Vec) Hold() (verbs.Status, error) {
	if bad, ok := v.Acquire(); !ok {
		return verbs.StatusLocalProtection, fmt.Errorf("local region %#x was deregistered", bad.LocalKey())
	}
	return verbs.StatusSuccess, nil
}

// Refused is what a responder's refusal means to the requester: the
// status its request completes with, and why. st is the status the
// responder sent (StatusRemoteAccess, StatusReceiverNotReady,
// StatusRemoteInvalidRequest, StatusRemoteOperation, or StatusTransport
// from a queue pair in ERR); anything else is a remote operation error.
// StatusSuccess is no refusal: (StatusSuccess, nil).
func Refused(st verbs.Status) (verbs.Status, error) {
	switch st {
	case verbs.StatusSuccess:
		return st, nil
	case verbs.StatusRemoteAccess:
		return st, errors.New("the peer refused the remote key, its rights or bounds")
	case verbs.StatusReceiverNotReady:
		return st, errors.New("no receive was posted at the peer within its RNR timeout")
	case verbs.StatusRemoteInvalidRequest:
		return st, errors.New("the message is larger than the peer's receive")
	case verbs.StatusRemoteOperation:
		return st, errors.New("the peer's receive is unusable (its region was deregistered)")
	case verbs.StatusTransport:
		return st, errors.New("the peer's queue pair is in the error state")
	}
	return verbs.StatusRemoteOperation, fmt.Errorf("the peer answered with status %v", st)
}
