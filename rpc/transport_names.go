package rpc

import pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"

// transportOf and transportName convert between transport names and the
// control plane's enum.
func transportOf(name string) pb.Transport {
	switch name {
	case TransportIBV:
		return pb.Transport_TRANSPORT_IBV
	case TransportSHM:
		return pb.Transport_TRANSPORT_SHM
	case TransportTCP:
		return pb.Transport_TRANSPORT_TCP
	case TransportGRPC:
		return pb.Transport_TRANSPORT_GRPC
	}
	return pb.Transport_TRANSPORT_UNSPECIFIED
}

func transportName(t pb.Transport) string {
	switch t {
	case pb.Transport_TRANSPORT_IBV:
		return TransportIBV
	case pb.Transport_TRANSPORT_SHM:
		return TransportSHM
	case pb.Transport_TRANSPORT_TCP:
		return TransportTCP
	case pb.Transport_TRANSPORT_GRPC:
		return TransportGRPC
	}
	return t.String()
}
