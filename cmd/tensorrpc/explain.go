package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// explainSizes are the Fetches doctor -explain makes on each data plane.
var explainSizes = []int{4 << 10, 1 << 20, 64 << 20}

// Explained is how one Fetch moved, as its CallInfo says.
type Explained struct {
	Plane  string `json:"plane"`
	Bytes  int    `json:"bytes"`
	Path   string `json:"path,omitempty"`
	Moved  string `json:"moved,omitempty"`
	Lanes  int    `json:"lanes"`
	Copies int    `json:"copies"`
	Err    string `json:"error,omitempty"`
}

// explainPaths fetches a tensor of each of explainSizes over each data
// plane of a loopback server and reports how each moved: the path and the
// lanes a Fetch of that size takes on this host with the defaults
// (TENSORRPC_LANES and the rest of the environment apply).
func explainPaths(ctx context.Context) ([]Explained, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	srv, err := rpc.NewServer(rpc.WithPoolOptions(mempool.WithLimit(512 << 20)))
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Stop()
		return nil, err
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	defer func() {
		srv.Stop()
		<-served
	}()
	for _, n := range explainSizes {
		t, err := srv.NewTensor(ctx, zerocopy.Uint8, []int64{int64(n)})
		if err != nil {
			return nil, err
		}
		err = srv.Publish(ctx, explainKey(n), t)
		t.Release()
		if err != nil {
			return nil, err
		}
	}
	var out []Explained
	for _, plane := range []string{rpc.TransportIBV, rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC} {
		out = append(out, explainPlane(ctx, lis.Addr().String(), plane)...)
	}
	return out, nil
}

func explainKey(n int) string { return fmt.Sprint("doctor/explain/", n) }

func explainPlane(ctx context.Context, addr, plane string) []Explained {
	var last rpc.CallInfo
	record := func(ctx context.Context, info *rpc.CallInfo, next func(context.Context) error) error {
		err := next(ctx)
		last = *info
		return err
	}
	var out []Explained
	failAll := func(err error) []Explained {
		for _, n := range explainSizes {
			out = append(out, Explained{Plane: plane, Bytes: n, Err: err.Error()})
		}
		return out
	}
	c, err := rpc.Dial(ctx, addr, rpc.WithTransportCredentials(insecure.NewCredentials()), // loopback
		rpc.WithTransports(plane), rpc.WithConnectTimeout(5*time.Second), rpc.WithInterceptors(record))
	if err != nil {
		return failAll(err)
	}
	defer c.Close()
	for _, n := range explainSizes {
		e := Explained{Plane: plane, Bytes: n}
		t, err := c.Fetch(ctx, explainKey(n))
		if err != nil {
			e.Err = err.Error()
		} else {
			t.Release()
			e.Path, e.Moved, e.Lanes, e.Copies = last.Path, last.Moved, last.Lanes, last.Copies
		}
		out = append(out, e)
	}
	return out
}

func writeExplained(w io.Writer, es []Explained) error {
	fmt.Fprintln(w, "How a Fetch moves on this host, per data plane and size (loopback, this environment's settings):")
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "plane\tsize\tpath\tmoved\tlanes\tclient copies")
	var notes []string
	for _, e := range es {
		if e.Err != "" {
			note := fmt.Sprintf("%s: %s", e.Plane, e.Err)
			if !slices.Contains(notes, note) {
				notes = append(notes, note)
			}
			fmt.Fprintf(tw, "%s\t%s\tunavailable (below)\t\t\t\n", e.Plane, sizeName(e.Bytes))
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\n", e.Plane, sizeName(e.Bytes), e.Path, e.Moved, e.Lanes, e.Copies)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, n := range notes {
		fmt.Fprintln(w, "\n"+n)
	}
	fmt.Fprintln(w, "\nmoved: inline = in the answer frame; pulled = one-sided reads from the server's memory into the client's pool (over several lanes when striped);")
	fmt.Fprintln(w, "leased = the server's memory mapped, no copy (rpc.Lease, shm); stream = chunks on the gRPC fallback. TENSORRPC_LOG=debug logs this for every call.")
	return nil
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}
