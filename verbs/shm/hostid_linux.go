package shm

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
)

// HostIdentity names the host and network namespace this process runs in.
// Two processes may use shm with each other only when their identities are
// equal: they then share a kernel (the same boot), the same machine-id and
// the same network namespace, which is where abstract unix sockets live.
//
// It hashes /proc/sys/kernel/random/boot_id, /etc/machine-id (when present)
// and the inode of /proc/self/ns/net, and returns 32 hex digits.
func HostIdentity() (string, error) {
	id, err := hostIdentity()
	if err != nil {
		return "", err
	}
	return hex.EncodeToString(id[:]), nil
}

func hostIdentity() ([16]byte, error) {
	var id [16]byte
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return id, fmt.Errorf("shm: host identity: %w", err)
	}
	machine, err := os.ReadFile("/etc/machine-id")
	if err != nil {
		// Minimal containers lack it; the boot id and namespace still
		// tell hosts apart, so go on without it.
		machine, _ = os.ReadFile("/var/lib/dbus/machine-id")
	}
	netns, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		return id, fmt.Errorf("shm: host identity: %w", err)
	}
	sum := sha256.Sum256([]byte("tensorrpc-shm-host\x00" +
		strings.TrimSpace(string(boot)) + "\x00" +
		strings.TrimSpace(string(machine)) + "\x00" +
		netns))
	copy(id[:], sum[:])
	return id, nil
}
