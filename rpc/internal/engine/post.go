package engine

import (
	"sync"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// One-request arrays for PostSend and PostRecv: passing one request to a
// variadic method of an interface moves a new one-element slice to the
// heap on every post (a frame's send and the receive slot it frees: two
// allocations a frame each way). Providers keep no reference to the
// requests once the post returns (verbs.QueuePair.PostSend).
var (
	oneSend = sync.Pool{New: func() any { return new([1]verbs.SendRequest) }}
	oneRecv = sync.Pool{New: func() any { return new([1]verbs.RecvRequest) }}
)

// postSend posts wr alone on qp.
func postSend(qp verbs.QueuePair, wr *verbs.SendRequest) error {
	a := oneSend.Get().(*[1]verbs.SendRequest)
	a[0] = *wr
	err := qp.PostSend(a[:]...)
	a[0] = verbs.SendRequest{} // no references to memory kept in the pool
	oneSend.Put(a)
	return err
}

// postRecv posts wr alone on qp.
func postRecv(qp verbs.QueuePair, wr verbs.RecvRequest) error {
	a := oneRecv.Get().(*[1]verbs.RecvRequest)
	a[0] = wr
	err := qp.PostRecv(a[:]...)
	a[0] = verbs.RecvRequest{}
	oneRecv.Put(a)
	return err
}
