// Package twohosts gives the examples' tests two "hosts": two network
// namespaces joined by a veth pair, which share no loopback, as two
// machines on one link. A process runs on a host when started under
// Prefix, as childproc.Options{Prefix: h.Prefix(i)}.
//
// Making namespaces needs root and iproute2's ip. Without them New skips
// the test, saying why; with CI=true it fails it instead, so that a CI
// image lacking them cannot pass by skipping.
package twohosts

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/testenv"
)

// Hosts are the two namespaces and their addresses on the link.
type Hosts struct {
	NS [2]string // the namespaces' names
	IP [2]string // their addresses, in one /24
}

// New makes the two hosts and removes them when the test ends.
func New(t testing.TB) *Hosts {
	t.Helper()
	testenv.NeedNetns(t)
	id := (os.Getpid()*7 + int(time.Now().UnixNano()%1000)) % 250
	h := &Hosts{
		NS: [2]string{fmt.Sprintf("trpcex%da", id), fmt.Sprintf("trpcex%db", id)},
		IP: [2]string{fmt.Sprintf("10.204.%d.1", id), fmt.Sprintf("10.204.%d.2", id)},
	}
	ifs := [2]string{fmt.Sprintf("trpcxa%d", id), fmt.Sprintf("trpcxb%d", id)}
	ip := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	for i, ns := range h.NS {
		if err := ip("netns", "add", ns); err != nil {
			testenv.Need(t, "cannot create a network namespace here: %v", err)
		}
		t.Cleanup(func() { ip("netns", "del", h.NS[i]) }) // deletes its end of the veth too
	}
	cmds := [][]string{{"link", "add", ifs[0], "netns", h.NS[0], "type", "veth", "peer", "name", ifs[1], "netns", h.NS[1]}}
	for i, ns := range h.NS {
		cmds = append(cmds,
			[]string{"-n", ns, "addr", "add", h.IP[i] + "/24", "dev", ifs[i]},
			[]string{"-n", ns, "link", "set", ifs[i], "up"},
			[]string{"-n", ns, "link", "set", "lo", "up"})
	}
	for _, args := range cmds {
		if err := ip(args...); err != nil {
			testenv.Need(t, "cannot set up a veth pair: %v", err)
		}
	}
	return h
}

// Prefix is the command that runs a program on host i.
func (h *Hosts) Prefix(i int) []string { return []string{"ip", "netns", "exec", h.NS[i]} }
