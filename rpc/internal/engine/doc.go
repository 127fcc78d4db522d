// Package engine is the data-plane engine under package rpc: how a
// session's calls travel over a connected queue pair of a verbs provider.
// It never sees rpc.Tensor; it deals in pool buffers, grants and frames.
//
// It holds, from the bottom up:
//
//   - the Domain (one opened transport: its provider's protection domain
//     and the registration of the tensor and control pools) and the Link (one connected queue pair, its
//     completion handling (in the provider's receiver where it can, else
//     its polling goroutine), Post/PostWith/PostAsync and the send queue's room,
//     the verifying round trip of the negotiation), in link.go, and a
//     caller's polling for its answer where the provider allows it
//     (AwaitAnswer, verbs.Poller: shm), in poll.go;
//   - the framing of frames on a link (frames.go, frame.go): receive
//     slots and credits, SendFrame/TrySendFrame, the creditor and the
//     releaser, pending calls and their replies, over proto/wire's header;
//   - lanes (lanes.go): a session's several links, made (NewLanes) and
//     connected together, the least busy taken by each frame call (LeastBusy), watched
//     (AnyDead, OnDead, AwaitDead), flushed of their releases
//     (FlushLanes), striped reads (ReadLanes) and grants on every lane
//     (GrantLanes);
//   - a data plane's negotiation (negotiate.go): Negotiate runs steps 1
//     and 2 of the Session method in the .proto, one function for both
//     sides, parameterised by the side's role (verbs.RoleDial for the
//     client, verbs.RoleAccept for the server);
//   - the one reader of a session's gRPC stream (stream.go);
//   - the server's Session (session.go): its transfer table
//     (transfers.go: the Transfers it holds for the client until the
//     client releases them, by id or by the client_ref of their call),
//     the Reads of the client's memory under way, and the calls that
//     arrived as frames, each in its own goroutine (or, for an Inline
//     handler's, where the frame was read), bounded, cancelled by a
//     release of their ref and drained by a graceful stop (calls.go).
//     A released transfer is finished without blocking where its grants
//     can be revoked so (verbs.AsyncRevoker), else on a goroutine of the
//     session.
//
// Each side's policy in the negotiation (what it offers or chooses, the
// server's admission, rejections and their logs, opening the session),
// the session's policy (quotas, statistics, logs, which takes callbacks
// from the engine) and the server's and client's work per operation are
// in rpc. Some fields of Link and Framing
// (Mu, Credits, Unreturned, Outstanding, Pending, MaxAbandon, Cancel,
// Received, Indirect, ReleasedIn, Reads, NextID, Waiters, CtlPool) are
// exported only for rpc's white-box tests, which forge and withhold
// frames; they are not for rpc's own code.
package engine
