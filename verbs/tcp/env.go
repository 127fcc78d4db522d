package tcp

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
)

// The environment variables New reads.
const (
	// EnvSocketIfname, in the style of NCCL_SOCKET_IFNAME, is a
	// comma-separated list of interface name prefixes ("eth,ib"); "=" before
	// the list makes the names exact ("=eth0") and "^" before it excludes
	// the listed interfaces instead ("^docker,lo"). The first IPv4 address
	// (else the first IPv6 address that is not link-local) of the first
	// matching interface that is up becomes the host queue pairs listen on
	// and advertise, unless an explicit listen address is given.
	EnvSocketIfname = "TENSORRPC_SOCKET_IFNAME"
	// EnvAddr is an explicit listen address, "host[:port]", used when
	// WithListenAddress is not given; it has the same meaning.
	EnvAddr = "TENSORRPC_TCP_ADDR"
)

// EnvSettings returns the environment variables the provider reads that
// are set, with their values, as New would read them now.
func EnvSettings() map[string]string {
	m := make(map[string]string)
	for _, k := range []string{EnvSocketIfname, EnvAddr} {
		if v, ok := os.LookupEnv(k); ok && v != "" {
			m[k] = v
		}
	}
	return m
}

// withPort adds port 0 to an address that has none: "10.0.0.1" becomes
// "10.0.0.1:0", "::1" and "[::1]" become "[::1]:0".
func withPort(s string) (string, error) {
	s = strings.TrimSpace(s)
	if _, _, err := net.SplitHostPort(s); err == nil {
		return s, nil
	}
	if strings.HasPrefix(s, "[") != strings.HasSuffix(s, "]") {
		return "", fmt.Errorf("%q is not host[:port]", s)
	}
	h := strings.TrimSuffix(strings.TrimPrefix(s, "["), "]")
	if h == "" || strings.ContainsAny(h, "[]") {
		return "", fmt.Errorf("%q is not host[:port]", s)
	}
	return net.JoinHostPort(h, "0"), nil
}

// iface is a network interface as pickInterface sees it.
type iface struct {
	name  string
	up    bool
	addrs []netip.Addr
}

func systemInterfaces() ([]iface, error) {
	nifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	ifs := make([]iface, 0, len(nifs))
	for _, ni := range nifs {
		f := iface{name: ni.Name, up: ni.Flags&net.FlagUp != 0}
		addrs, err := ni.Addrs()
		if err != nil {
			return nil, fmt.Errorf("addresses of %s: %w", ni.Name, err)
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok {
					f.addrs = append(f.addrs, ip.Unmap())
				}
			}
		}
		ifs = append(ifs, f)
	}
	return ifs, nil
}

// matchInterface reports whether the interface name matches spec, a
// TENSORRPC_SOCKET_IFNAME value.
func matchInterface(spec, name string) bool {
	s := strings.TrimSpace(spec)
	exclude := strings.HasPrefix(s, "^")
	s = strings.TrimPrefix(s, "^")
	exact := strings.HasPrefix(s, "=")
	s = strings.TrimPrefix(s, "=")
	found := false
	for _, n := range strings.Split(s, ",") {
		n = strings.TrimSpace(n)
		if n == "" {
			continue
		}
		if exact && name == n || !exact && strings.HasPrefix(name, n) {
			found = true
			break
		}
	}
	return found != exclude
}

// usableAddr is the interface's first IPv4 address, else its first IPv6
// address that is not link-local.
func usableAddr(f iface) (netip.Addr, bool) {
	for _, a := range f.addrs {
		if a.Is4() {
			return a, true
		}
	}
	for _, a := range f.addrs {
		if a.Is6() && !a.IsLinkLocalUnicast() && !a.IsUnspecified() {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// pickInterface finds the first up interface that matches spec and has a
// usable address. Its error names the variable and the interfaces seen.
func pickInterface(spec string, ifs []iface) (string, netip.Addr, error) {
	var seen []string
	for _, f := range ifs {
		state := "down"
		if f.up {
			state = "up"
		}
		seen = append(seen, f.name+" ("+state+")")
		if !f.up || !matchInterface(spec, f.name) {
			continue
		}
		if a, ok := usableAddr(f); ok {
			return f.name, a, nil
		}
	}
	return "", netip.Addr{}, fmt.Errorf("tcp: %s=%q matches no interface that is up and has a usable address (interfaces: %s); unset it or name an interface of this host",
		EnvSocketIfname, spec, strings.Join(seen, ", "))
}
