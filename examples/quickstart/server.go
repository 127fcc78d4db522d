package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// checkRequest is the metadata of the "check" method: the key a client
// sent a tensor to, and the CRC-32C of the bytes it sent.
type checkRequest struct {
	Key    string `json:"key"`
	CRC32C uint32 `json:"crc32c"`
}

// serve runs the quickstart server on addr. It prints the address it
// listens on as the first line of out and serves until stop is closed.
// dataAddr, when not empty, is the address the tcp data plane listens on
// and advertises (rpc.WithDataAddress).
//
// Clients Send tensors into the server's rendezvous and Fetch them back
// from it; the "check" method then takes the tensor out of the rendezvous
// and verifies that the server received exactly what the client sent.
func serve(addr, dataAddr string, out io.Writer, stop <-chan struct{}, announce func(io.Writer, net.Addr)) error {
	var opts []rpc.ServerOption
	if dataAddr != "" {
		opts = append(opts, rpc.WithDataAddress(dataAddr))
	}
	srv, err := rpc.NewServer(opts...)
	if err != nil {
		return err
	}
	srv.Handle("check", func(ctx context.Context, req *rpc.Message) (*rpc.Message, error) {
		var cr checkRequest
		if err := json.Unmarshal(req.Metadata, &cr); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "check: %v", err)
		}
		t, err := srv.Take(ctx, cr.Key)
		if err != nil {
			return nil, err
		}
		defer t.Release()
		if got := zerocopy.Checksum(t.Bytes()); got != cr.CRC32C {
			return nil, status.Errorf(codes.DataLoss, "check: %q has CRC-32C %08x on the server, the client sent %08x", cr.Key, got, cr.CRC32C)
		}
		return nil, nil
	})
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		srv.Stop()
		return err
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	if announce != nil {
		announce(out, lis.Addr())
	} else {
		fmt.Fprintln(out, lis.Addr().String()) // the parent reads it (childproc)
	}
	select {
	case <-stop:
	case err = <-served:
	}
	srv.GracefulStop()
	if err == nil {
		err = <-served
	}
	if st := srv.Pool().Stats(); st.InUse != 0 && err == nil {
		err = fmt.Errorf("%d bytes of the server's pool still in use after it stopped", st.InUse)
	}
	return err
}
