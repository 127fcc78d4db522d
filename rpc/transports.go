package rpc

import (
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"

	"github.com/tensorrpc/tensorrpc/mempool"
	pb "github.com/tensorrpc/tensorrpc/proto/tensorrpcpb"
	"github.com/tensorrpc/tensorrpc/rpc/internal/engine"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/ibv"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// Transport names, in priority order: a session uses the first one both
// sides can use.
const (
	TransportIBV  = "ibv"
	TransportSHM  = "shm"
	TransportTCP  = "tcp"
	TransportGRPC = "grpc"
)

// allTransports is the default set, in priority order.
var allTransports = []string{TransportIBV, TransportSHM, TransportTCP, TransportGRPC}

// defaultProvider makes the provider of a data plane when no WithProvider
// option gave one.
func defaultProvider(name string, log *slog.Logger) verbs.Provider {
	switch name {
	case TransportIBV:
		return ibv.New()
	case TransportSHM:
		return shm.New()
	case TransportTCP:
		return tcp.New(tcp.WithLogger(log))
	}
	return nil
}

// priority orders transports: lower is preferred.
func priority(name string) int {
	if i := slices.Index(allTransports, name); i >= 0 {
		return i
	}
	return len(allTransports)
}

// Rejection says why a data plane is not used, and what would make it
// work.
type Rejection struct {
	Transport string
	// Side is "client" or "server": where the reason arose.
	Side   string
	Reason string
	// Fix suggests what to change, when there is a likely remedy.
	Fix string
}

func (r Rejection) String() string {
	s := fmt.Sprintf("%s (%s): %s", r.Transport, r.Side, r.Reason)
	if r.Fix != "" {
		s += " (fix: " + r.Fix + ")"
	}
	return s
}

// newRejection makes a Rejection with the remedy that fits its transport
// and reason.
func newRejection(transport, side, reason string) Rejection {
	return Rejection{Transport: transport, Side: side, Reason: reason, Fix: rejectionFix(transport, reason)}
}

func rejectionFix(transport, reason string) string {
	switch {
	case strings.Contains(reason, "not enabled"):
		return "enable it with rpc.WithTransports on both sides"
	case transport == TransportTCP && (strings.Contains(reason, "connect") || strings.Contains(reason, "verifying")):
		return "the client must reach the server's data address (by default the address the client dialled for gRPC, on a port chosen by the server): open the port range in firewalls, or choose the address with rpc.WithDataAddress or TENSORRPC_SOCKET_IFNAME / TENSORRPC_TCP_ADDR on the server"
	case transport == TransportTCP && strings.Contains(reason, "loopback"):
		return "give the server a data address the client can reach: rpc.WithDataAddress or TENSORRPC_SOCKET_IFNAME"
	case transport == TransportSHM && (strings.Contains(reason, "connect") || strings.Contains(reason, "host")):
		return "shm works only between processes on one host that share /dev/shm and abstract unix sockets (one network namespace); across hosts tcp is used"
	case transport == TransportIBV && strings.Contains(reason, "no RDMA"):
		return "install an RDMA NIC and its driver (rdma-core), and build with -tags rdma"
	}
	return ""
}

// openDomains opens every enabled verbs transport (its provider's
// protection domain, the pools registered). It returns them and, for
// each that did not open, the reason.
// unavailableLogged holds the data planes, with their reasons, that this
// process has logged as unavailable.
var unavailableLogged sync.Map

func openDomains(o *options, pool, ctl *mempool.Pool, log *slog.Logger) (map[string]*engine.Domain, map[string]string) {
	domains := map[string]*engine.Domain{}
	missing := map[string]string{}
	for _, name := range o.transports {
		if name == TransportGRPC {
			continue
		}
		p := o.providers[name]
		if p == nil && name == TransportTCP && o.dataAddress != "" {
			p = tcp.New(tcp.WithListenAddress(withPort(o.dataAddress)), tcp.WithLogger(log))
		}
		if p == nil {
			p = defaultProvider(name, log)
		}
		if p == nil {
			missing[name] = "unknown transport"
			continue
		}
		d, err := engine.OpenDomain(p, pool, ctl)
		if err != nil {
			missing[name] = err.Error()
			// Once per process and reason: a program with a Server and a
			// Client (or several) would say the same thing for each.
			if _, said := unavailableLogged.LoadOrStore(name+"\x00"+err.Error(), true); !said {
				log.Info("tensorrpc: data plane unavailable", "transport", name, "reason", err)
			}
			continue
		}
		domains[name] = d
	}
	return domains, missing
}

func enabled(o *options, name string) bool { return slices.Contains(o.transports, name) }

// withPort adds port 0 (any free port) to a host without one.
func withPort(addr string) string {
	if _, _, err := net.SplitHostPort(addr); err == nil {
		return addr
	}
	return net.JoinHostPort(strings.Trim(addr, "[]"), "0")
}

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
