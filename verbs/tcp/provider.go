package tcp

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// Name is the provider's name.
const Name = "tcp"

// New returns the tcp provider. It is safe for concurrent use; every domain
// it opens has its own listeners. New reads TENSORRPC_TCP_ADDR and
// TENSORRPC_SOCKET_IFNAME (see EnvAddr and EnvSocketIfname) once; an
// invalid value, or an interface list that matches no interface, makes
// Devices and Open fail with an error that names the variable.
//
// Its one device, "tcp", is described with where its queue pairs listen;
// Open's domain creates its listeners with the queue pairs that use them.
func New(opts ...Option) verbs.Provider {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	err := o.resolve(EnvSettings())
	return &softrc.Provider{
		ProviderName: Name,
		Describe: func() (string, error) {
			desc := "software RC queue pairs over TCP, listening on " + o.describeListen()
			if o.advertiseAddress != "" {
				desc += ", advertised as " + o.advertiseAddress
			}
			return desc, err
		},
		OpenDomain: func() (verbs.ProtectionDomain, error) { return newDomain(o), nil },
	}
}

// resolve settles the listen address and interface from the options and
// the environment env.
func (o *options) resolve(env map[string]string) error {
	switch {
	case o.listenAddress != "":
		o.listenFrom = "tcp.WithListenAddress"
	case env[EnvAddr] != "":
		addr, err := withPort(env[EnvAddr])
		if err != nil {
			return fmt.Errorf("tcp: %s: %v", EnvAddr, err)
		}
		o.listenAddress, o.listenFrom = addr, EnvAddr
	}
	if o.listenAddress != "" {
		host, _, err := net.SplitHostPort(o.listenAddress)
		if err != nil {
			return fmt.Errorf("tcp: listen address %q (%s): %v", o.listenAddress, o.listenFrom, err)
		}
		if !isWildcard(host) {
			return nil // an explicit host: the interface does not matter
		}
	}
	spec := env[EnvSocketIfname]
	if spec == "" {
		return nil
	}
	ifs, err := systemInterfaces()
	if err != nil {
		return fmt.Errorf("tcp: %s=%q: listing the interfaces: %w", EnvSocketIfname, spec, err)
	}
	name, addr, err := pickInterface(spec, ifs)
	if err != nil {
		return err
	}
	o.ifSpec, o.ifName, o.ifAddr = spec, name, addr
	return nil
}

// isWildcard reports whether a listen host means every address.
func isWildcard(host string) bool {
	if host == "" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.IsUnspecified()
}

// describeListen says where queue pairs listen, for Devices.
func (o *options) describeListen() string {
	port := "a free port"
	if o.listenAddress != "" {
		host, pt, _ := net.SplitHostPort(o.listenAddress)
		if !isWildcard(host) {
			return o.listenAddress + " (" + o.listenFrom + ")"
		}
		if pt != "0" && pt != "" {
			port = "port " + pt + " (" + o.listenFrom + ")"
		}
	}
	switch {
	case o.ifAddr.IsValid():
		return fmt.Sprintf("%s of interface %s (%s=%q), %s", o.ifAddr, o.ifName, EnvSocketIfname, o.ifSpec, port)
	case o.listenAddress != "":
		return "each queue pair's local address, else " + o.listenAddress + " (" + o.listenFrom + ")"
	}
	return "each queue pair's local address, else 127.0.0.1, " + port
}
