package rpc_test

import (
	"testing"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// TestDefaultLanes pins the measured policy: half the cores, at least 2
// (1 on one core), at most 8, and one on grpc.
func TestDefaultLanes(t *testing.T) {
	for _, tc := range []struct {
		transport string
		cores     int
		want      int
	}{
		{rpc.TransportTCP, 1, 1},
		{rpc.TransportTCP, 2, 2},
		{rpc.TransportSHM, 3, 2},
		{rpc.TransportTCP, 4, 2},
		{rpc.TransportSHM, 6, 3},
		{rpc.TransportIBV, 8, 4},
		{rpc.TransportTCP, 16, 8},
		{rpc.TransportSHM, 16, 8},
		{rpc.TransportTCP, 96, 8},
		{rpc.TransportGRPC, 16, 1},
	} {
		if got := rpc.DefaultLanes(tc.transport, tc.cores); got != tc.want {
			t.Errorf("DefaultLanes(%s, %d) = %d, want %d", tc.transport, tc.cores, got, tc.want)
		}
	}
}
