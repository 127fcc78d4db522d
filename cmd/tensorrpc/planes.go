package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// probeBytes is the size of the tensor each data plane must move: above
// the eager threshold, so it travels over the data plane itself.
const probeBytes = 256 << 10

var planeAdvice = map[string]string{
	rpc.TransportIBV: "see rdma-build and rdma-devices",
	rpc.TransportSHM: "see memfd and shm",
	rpc.TransportTCP: "on loopback the tcp data plane listens on 127.0.0.1, the address the gRPC connection arrived on, unless " +
		"TENSORRPC_TCP_ADDR or TENSORRPC_SOCKET_IFNAME choose another: check that loopback TCP connections are allowed " +
		"and that the address those variables choose is this host's",
	rpc.TransportGRPC: "the control plane itself failed on loopback: check that the process may listen on and connect to 127.0.0.1",
}

// checkDataPlanes starts a server on loopback and, for each data plane,
// opens a session restricted to it (with the gRPC fallback, so that the
// session reports why the plane was not used) and fetches a tensor.
func checkDataPlanes() []Check {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	planes := []string{rpc.TransportIBV, rpc.TransportSHM, rpc.TransportTCP, rpc.TransportGRPC}
	fail := func(err error) []Check {
		var out []Check
		for _, p := range planes {
			out = append(out, Check{Name: "data-plane " + p, Status: StatusUnavailable, Detail: "loopback server: " + err.Error(), Advice: planeAdvice[rpc.TransportGRPC]})
		}
		return out
	}
	small := rpc.WithPoolOptions(mempool.WithArenaSize(1<<20), mempool.WithLimit(16<<20))
	srv, err := rpc.NewServer(small)
	if err != nil {
		return fail(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Stop()
		return fail(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	defer func() {
		srv.Stop()
		<-served
	}()
	probe := make([]byte, probeBytes)
	for i := range probe {
		probe[i] = byte(i * 7)
	}
	zt, _ := zerocopy.New(zerocopy.Uint8, []int64{probeBytes}, probe)
	if err := srv.Publish(ctx, "doctor/probe", rpc.WrapTensor(zt)); err != nil {
		return fail(err)
	}
	var out []Check
	for _, p := range planes {
		out = append(out, probePlane(ctx, lis.Addr().String(), p, probe))
	}
	return out
}

func probePlane(ctx context.Context, addr, plane string, want []byte) Check {
	c := Check{Name: "data-plane " + plane, Status: StatusUnavailable, Advice: planeAdvice[plane]}
	transports := []string{plane}
	if plane != rpc.TransportGRPC {
		transports = append(transports, rpc.TransportGRPC)
	}
	client, err := rpc.Dial(ctx, addr, rpc.WithTransportCredentials(insecure.NewCredentials()), // loopback
		rpc.WithTransports(transports...), rpc.WithConnectTimeout(5*time.Second),
		rpc.WithPoolOptions(mempool.WithArenaSize(1<<20), mempool.WithLimit(16<<20)))
	if err != nil {
		c.Detail = "session: " + err.Error()
		return c
	}
	if client.Transport() != plane {
		var reasons, fixes []string
		for _, r := range client.Rejections() {
			if r.Transport == plane {
				reasons = append(reasons, fmt.Sprintf("%s side: %s", r.Side, r.Reason))
				if r.Fix != "" && !slices.Contains(fixes, r.Fix) {
					fixes = append(fixes, r.Fix)
				}
			}
		}
		if len(reasons) == 0 {
			reasons = append(reasons, "not negotiated, no reason given")
		}
		c.Detail = strings.Join(reasons, "; ")
		if len(fixes) > 0 {
			// The rejection's own suggestion first, then the general one.
			c.Advice = strings.Join(append(fixes, c.Advice), "; ")
		}
		if err := client.Close(); err != nil {
			c.Detail += "; closing the session: " + err.Error()
		}
		return c
	}
	got, err := client.Fetch(ctx, "doctor/probe")
	if err == nil && !bytes.Equal(got.Bytes(), want) {
		err = errors.New("the fetched bytes differ from the published ones")
	}
	got.Release()
	err = errors.Join(err, client.Close())
	if err != nil {
		c.Detail = "connected, but fetching a tensor failed: " + err.Error()
		c.Advice = "this is a bug in tensorrpc or the host; please report it with this output"
		return c
	}
	c.Status, c.Advice = StatusOK, ""
	c.Detail = fmt.Sprintf("a loopback session connects and fetched a %s tensor intact", formatBytes(probeBytes))
	return c
}
