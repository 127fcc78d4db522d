package suite

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/tensorrpc/tensorrpc/benchmarks/internal/compressors"
	"github.com/tensorrpc/tensorrpc/rpc"
)

// Kinds of case.
const (
	KindCeiling    = "ceiling"
	KindGRPC       = "grpc"
	KindCompressed = "grpc-compressed"
	KindTensorRPC  = "tensorrpc"
)

// A Case is one way of moving a tensor from a server to a client, or, for
// a call case, from a client to a server and back.
type Case struct {
	Name string
	Kind string
	// Ceiling names the case that bounds this one: the medium its bytes
	// cross, with nothing on top.
	Ceiling string
	// Baseline names the case that does the same work the way one would
	// without tensorrpc (plain gRPC); like the ceiling, it runs alongside.
	Baseline string
	About    string
	// Call is true for a call case: each transfer sends a tensor of the
	// size and receives one of the same size back, and its GB/s count the
	// bytes moved both ways (2× the size per transfer).
	Call bool
	// Rate is true for the small-message rate case: a call case measured
	// at Config.RateSize with Config.RateCallers concurrent callers, in
	// calls per second against its baseline, apart from the sizes and
	// concurrencies of the transfers.
	Rate bool
	// Rows is true for a rows case: Fetches of Config.Rows scattered rows
	// of a published table of Config.RowsOf rows of Config.RowBytes, with
	// rpc.Rows and rpc.Into, on the data plane rowsPlane, apart from the
	// sizes of the transfers; against one Fetch per row and one Fetch of
	// the same bytes back to back on the same plane, in alternating reps
	// (see rowcases.go).
	Rows      bool
	rowsPlane string
	// Content is true when the case's speed depends on the bytes
	// (compression); other cases never read them and run on the first
	// payload only, unless -all-payloads.
	Content bool
	// Quick cases run in -quick mode.
	Quick bool
	// Compressor is the gRPC compressor of a compressed case.
	Compressor string
	open       func(ctx context.Context, env *caseEnv) (session, error)
}

// caseEnv is what a case is opened with.
type caseEnv struct {
	payload Payload
	data    []byte // the payload, exactly one transfer long
	maxConc int    // the most streams that will be opened at once
}

// Cases returns every case, in the order a run measures them at each size:
// ceilings first, so that the others can be compared as they finish.
func Cases() []Case {
	cs := []Case{
		{Name: "memcpy", Kind: KindCeiling, About: "memcopy.Copy (the data planes' copy) into a buffer of the stream's own", Quick: true, open: openMemcpy},
		{Name: "tcp-socket", Kind: KindCeiling, About: "raw loopback TCP: 8-byte request, n-byte reply, one connection per stream", Quick: true, open: openSocket("tcp")},
		{Name: "unix-socket", Kind: KindCeiling, About: "the same over a unix socket", Quick: true, open: openSocket("unix")},
		{Name: "memcpy-echo", Kind: KindCeiling, Call: true, About: "memcopy.Copy of the request into a buffer and from it into the stream's reply buffer: the two copies of a call over shared memory", open: openMemcpyEcho},
		{Name: "tcp-socket-echo", Kind: KindCeiling, Call: true, About: "raw loopback TCP: an 8-byte header and n bytes of request, the n bytes back as the reply, one connection per stream", open: openSocketEcho("tcp")},

		{Name: "grpc-proto", Kind: KindGRPC, Ceiling: "tcp-socket", About: "unary call, reply in a protobuf bytes field; default settings (receive limit raised)", Quick: true, open: openGRPC(grpcSettings{})},
		{Name: "grpc-proto-tuned", Kind: KindGRPC, Ceiling: "tcp-socket", About: "the same with 64 MiB stream / 256 MiB connection windows and 1 MiB read/write buffers", Quick: true, open: openGRPC(grpcSettings{tuned: true})},
		{Name: "grpc-flatbuffers", Kind: KindGRPC, Ceiling: "tcp-socket", About: "tuned, reply a FlatBuffers tensor through a zero-copy []byte codec", Quick: true, open: openGRPC(grpcSettings{tuned: true, flatbuf: true})},
	}
	quickCompressors := []string{compressors.ZstdFastest, compressors.S2}
	for _, c := range compressors.All() {
		name := "grpc-" + strings.TrimPrefix(c.Name(), "tb-")
		cs = append(cs, Case{
			Name: name, Kind: KindCompressed, Ceiling: "tcp-socket", Content: true,
			About:      "grpc-proto-tuned with " + strings.TrimPrefix(c.Name(), "tb-") + " compression (klauspost/compress, one goroutine)",
			Quick:      slices.Contains(quickCompressors, c.Name()),
			Compressor: c.Name(),
			open:       openGRPC(grpcSettings{tuned: true, compressor: c.Name()}),
		})
	}
	cs = append(cs,
		Case{Name: "trpc-grpc", Kind: KindTensorRPC, Ceiling: "tcp-socket", About: "tensorrpc Fetch, plain-gRPC fallback plane", Quick: true, open: openTensorRPC(rpc.TransportGRPC, false)},
		Case{Name: "trpc-tcp", Kind: KindTensorRPC, Ceiling: "tcp-socket", About: "tensorrpc Fetch, tcp data plane", Quick: true, open: openTensorRPC(rpc.TransportTCP, false)},
		Case{Name: "trpc-shm", Kind: KindTensorRPC, Ceiling: "memcpy", About: "tensorrpc Fetch, shm data plane (one copy into the client's pool)", Quick: true, open: openTensorRPC(rpc.TransportSHM, false)},
		Case{Name: "trpc-shm-lease", Kind: KindTensorRPC, Ceiling: "memcpy", About: "tensorrpc Fetch with Lease, shm data plane (no copy)", Quick: true, open: openTensorRPC(rpc.TransportSHM, true)},
		Case{Name: "trpc-ibv", Kind: KindTensorRPC, Ceiling: "tcp-socket", About: "tensorrpc Fetch, ibv data plane (RDMA NIC)", Quick: true, open: openTensorRPC(rpc.TransportIBV, false)},

		Case{Name: "grpc-proto-call", Kind: KindGRPC, Ceiling: "tcp-socket-echo", Call: true, About: "unary call, request and reply each a protobuf bytes field of n bytes; the handler replies with the request's bytes; default settings (message limits raised)", open: openGRPC(grpcSettings{echo: true})},
		Case{Name: "trpc-grpc-call", Kind: KindTensorRPC, Ceiling: "tcp-socket-echo", Baseline: "grpc-proto-call", Call: true, About: "tensorrpc Call, plain-gRPC fallback plane" + callAbout, open: openTensorRPCCall(rpc.TransportGRPC, false)},
		Case{Name: "trpc-tcp-call", Kind: KindTensorRPC, Ceiling: "tcp-socket-echo", Baseline: "grpc-proto-call", Call: true, Quick: true, About: "tensorrpc Call, tcp data plane" + callAbout, open: openTensorRPCCall(rpc.TransportTCP, false)},
		Case{Name: "trpc-shm-call", Kind: KindTensorRPC, Ceiling: "memcpy-echo", Baseline: "grpc-proto-call", Call: true, About: "tensorrpc Call, shm data plane" + callAbout, open: openTensorRPCCall(rpc.TransportSHM, false)},
		Case{Name: "trpc-tcp-call-inline", Kind: KindTensorRPC, Ceiling: "tcp-socket-echo", Baseline: "grpc-proto-call", Call: true, About: "trpc-tcp-call with the handler registered rpc.Inline (run where the frame is read, when the request came in it)", open: openTensorRPCCall(rpc.TransportTCP, true)},
		Case{Name: "trpc-shm-call-inline", Kind: KindTensorRPC, Ceiling: "memcpy-echo", Baseline: "grpc-proto-call", Call: true, About: "trpc-shm-call with the handler registered rpc.Inline (run where the frame is read, when the request came in it)", open: openTensorRPCCall(rpc.TransportSHM, true)},
		Case{Name: "call-rate", Kind: KindTensorRPC, Baseline: "grpc-proto-call", Call: true, Rate: true, Quick: true,
			About: "4 KiB tensorrpc Calls per second, tcp data plane (4 KiB is under the 16 KiB eager threshold, so request and reply ride inline, in the call's request and response frames on the data plane), the callers sharing one Client; against grpc-proto-call with as many callers sharing one ClientConn",
			open:  openTensorRPCCall(rpc.TransportTCP, false)},
		Case{Name: "call-rate-inline", Kind: KindTensorRPC, Baseline: "grpc-proto-call", Call: true, Rate: true,
			About: "call-rate with the handler registered rpc.Inline",
			open:  openTensorRPCCall(rpc.TransportTCP, true)},

		Case{Name: "trpc-tcp-rows", Kind: KindTensorRPC, Rows: true, rowsPlane: rpc.TransportTCP, Quick: true,
			About: "tensorrpc Fetch of scattered rows (rpc.Rows, rpc.Into), tcp data plane" + rowsReads + rowsAbout},
		Case{Name: "trpc-shm-rows", Kind: KindTensorRPC, Rows: true, rowsPlane: rpc.TransportSHM, Quick: true,
			About: "tensorrpc Fetch of scattered rows (rpc.Rows, rpc.Into), shm data plane" + rowsReads + rowsAbout},
		Case{Name: "trpc-grpc-rows", Kind: KindTensorRPC, Rows: true, rowsPlane: rpc.TransportGRPC,
			About: "tensorrpc Fetch of scattered rows (rpc.Rows, rpc.Into), plain-gRPC fallback plane: the server gathers the rows into one tensor (a copy) and streams it" + rowsAbout},
	)
	return cs
}

// callAbout says what every tensorrpc call case does.
const callAbout = ": the stream sends one pool tensor of n bytes (filled once) and the handler returns the request tensor itself as the reply " +
	"(the same bytes, no copy in the handler), so one call moves 2n bytes; the reply's bytes are the ones checked"

// rowsAbout says what every rows case does.
const rowsAbout = "; each Fetch lands the rows in a tensor of the stream's own, against one Fetch per row " +
	"(of one-row tensors, each Into a one-row tensor) and one Fetch of the same rows back to back, on the same plane"

// rowsReads is how a data plane moves the rows.
const rowsReads = ": one request, then one batch of Reads of the server's table (consecutive rows merge into one Read)"

// caseByName returns the case named name; it panics for an unknown name,
// which only a mistake in Cases can produce.
func caseByName(name string) Case {
	for _, c := range Cases() {
		if c.Name == name {
			return c
		}
	}
	panic("suite: no case " + name)
}

// SelectCases returns the cases named by spec, a comma-separated list of
// case names and kinds; "" selects every case, or the quick ones if quick.
func SelectCases(spec string, quick bool) ([]Case, error) {
	all := Cases()
	if spec == "" {
		if !quick {
			return all, nil
		}
		return slices.DeleteFunc(all, func(c Case) bool { return !c.Quick }), nil
	}
	want := map[string]bool{}
	for _, w := range strings.Split(spec, ",") {
		w = strings.TrimSpace(w)
		found := false
		for _, c := range all {
			if c.Name == w || c.Kind == w {
				found = true
			}
		}
		if !found {
			return nil, fmt.Errorf("unknown case or kind %q (kinds: %s, %s, %s, %s)", w, KindCeiling, KindGRPC, KindCompressed, KindTensorRPC)
		}
		want[w] = true
	}
	return slices.DeleteFunc(all, func(c Case) bool { return !want[c.Name] && !want[c.Kind] }), nil
}
