package tcp

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Name is the provider's name.
const Name = "tcp"

// provider implements verbs.Provider.
type provider struct {
	opts options
	err  error // a configuration error from the environment
}

// New returns the tcp provider. It is safe for concurrent use; every domain
// it opens has its own listeners. New reads TENSORRPC_TCP_ADDR and
// TENSORRPC_SOCKET_IFNAME (see EnvAddr and EnvSocketIfname) once; an
// invalid value, or an interface list that matches no interface, makes
// Devices and Open fail with an error that names the variable.
func New(opts ...Option) verbs.Provider {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	p := &provider{opts: o}
	p.err = p.opts.resolve(EnvSettings())
	return p
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

func (p *provider) Name() string { return Name }

// Devices returns the single device "tcp", described with where its queue
// pairs listen.
func (p *provider) Devices() ([]verbs.Device, error) {
	if p.err != nil {
		return nil, fmt.Errorf("%w: %w", p.err, verbs.ErrNoDevice)
	}
	desc := "software RC queue pairs over TCP, listening on " + p.opts.describeListen()
	if p.opts.advertiseAddress != "" {
		desc += ", advertised as " + p.opts.advertiseAddress
	}
	return []verbs.Device{{Provider: Name, Name: Name, Description: desc}}, nil
}

// Open opens the device "tcp" (or "") and returns a protection domain. The
// domain's listeners are created with the queue pairs that use them.
func (p *provider) Open(name string) (verbs.ProtectionDomain, error) {
	if p.err != nil {
		return nil, fmt.Errorf("%w: %w", p.err, verbs.ErrNoDevice)
	}
	if name != "" && name != Name {
		return nil, fmt.Errorf("tcp: open device %q: the only device is %q: %w", name, Name, verbs.ErrNoDevice)
	}
	return newDomain(p.opts), nil
}
