package rpc

import (
	"fmt"
	"log/slog"
	"slices"

	"github.com/tensorrpc/tensorrpc/mempool"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/ibv"
	"github.com/tensorrpc/tensorrpc/verbs/shm"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// defaultProvider makes the provider of a data plane when no WithProvider
// option gave one.
func defaultProvider(name string) verbs.Provider {
	switch name {
	case TransportIBV:
		return ibv.New()
	case TransportSHM:
		return shm.New()
	case TransportTCP:
		return tcp.New()
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

// Rejection says why a data plane is not used.
type Rejection struct {
	Transport string
	// Side is "client" or "server": where the reason arose.
	Side   string
	Reason string
}

func (r Rejection) String() string { return fmt.Sprintf("%s (%s): %s", r.Transport, r.Side, r.Reason) }

// openDevices opens the device of every enabled verbs data plane. It
// returns the opened devices and, for each that did not open, the reason.
func openDevices(o *options, pool *mempool.Pool, log *slog.Logger) (map[string]*device, map[string]string) {
	devices := map[string]*device{}
	missing := map[string]string{}
	for _, name := range o.transports {
		if name == TransportGRPC {
			continue
		}
		p := o.providers[name]
		if p == nil {
			p = defaultProvider(name)
		}
		if p == nil {
			missing[name] = "unknown transport"
			continue
		}
		d, err := openDevice(p, pool)
		if err != nil {
			missing[name] = err.Error()
			log.Info("tensorrpc: data plane unavailable", "transport", name, "reason", err)
			continue
		}
		devices[name] = d
	}
	return devices, missing
}

func enabled(o *options, name string) bool { return slices.Contains(o.transports, name) }
