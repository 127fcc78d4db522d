package rpc

import (
	"math"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
)

// TestIPCCheckHandle: a peer's DeviceHandle is checked against the
// tensor's size and the session's devices before anything opens it.
func TestIPCCheckHandle(t *testing.T) {
	dev := [16]byte{1}
	devices := map[[16]byte]bool{dev: true}
	good := func() *pb.DeviceHandle {
		return &pb.DeviceHandle{Handle: make([]byte, 64), Offset: 4096, Length: 100, DeviceUuid: dev[:]}
	}
	if h, err := checkHandle(good(), 100, devices); err != nil || h.Offset != 4096 || h.Len != 100 || h.UUID != dev {
		t.Fatalf("a good handle: %+v %v", h, err)
	}
	for name, forge := range map[string]func(*pb.DeviceHandle){
		"missing":         nil,
		"short handle":    func(d *pb.DeviceHandle) { d.Handle = d.Handle[:63] },
		"short uuid":      func(d *pb.DeviceHandle) { d.DeviceUuid = d.DeviceUuid[:15] },
		"other length":    func(d *pb.DeviceHandle) { d.Length = 99 },
		"huge offset":     func(d *pb.DeviceHandle) { d.Offset = math.MaxUint64 - 10 },
		"unshared device": func(d *pb.DeviceHandle) { d.DeviceUuid = make([]byte, 16) },
	} {
		var d *pb.DeviceHandle
		if forge != nil {
			d = good()
			forge(d)
		}
		if _, err := checkHandle(d, 100, devices); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
}
