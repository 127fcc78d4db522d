package ibv

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// This file reads sysfs only; it is pure Go so that it is tested against
// fixture trees on every build.

// noDeviceError says why the provider has no device. It wraps
// verbs.ErrNoDevice; its message is the whole explanation, without the
// generic text of the sentinel.
type noDeviceError struct{ msg string }

func (e *noDeviceError) Error() string { return e.msg }
func (e *noDeviceError) Unwrap() error { return verbs.ErrNoDevice }

func noDevice(format string, args ...any) error {
	return &noDeviceError{msg: "ibv: " + fmt.Sprintf(format, args...)}
}

// explainNoDevices says why libibverbs listed no device, from what sysfs
// shows. cause is the error ibv_get_device_list reported, or nil when it
// returned an empty list.
func explainNoDevices(sysfs string, cause error) error {
	suffix := ""
	if cause != nil {
		suffix = fmt.Sprintf(" (ibv_get_device_list: %v)", cause)
	}
	class := filepath.Join(sysfs, "class", "infiniband")
	entries, err := os.ReadDir(class)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return noDevice("no RDMA devices: %s does not exist (kernel without RDMA support or no rdma driver loaded)%s", class, suffix)
	case err != nil:
		return noDevice("no RDMA devices: %v%s", err, suffix)
	case len(entries) == 0:
		return noDevice("no RDMA devices: %s is empty (no rdma driver bound to a device)%s", class, suffix)
	}
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i] = e.Name()
	}
	uverbs := filepath.Join(sysfs, "class", "infiniband_verbs")
	if _, err := os.Stat(uverbs); err != nil {
		return noDevice("RDMA devices %s exist but %s does not (load the ib_uverbs kernel module)%s",
			strings.Join(names, ", "), uverbs, suffix)
	}
	return noDevice("libibverbs found no devices although %s lists %s (is the rdma-core provider library for their driver installed?)%s",
		class, strings.Join(names, ", "), suffix)
}

// gidChoice is the outcome of the automatic source GID selection.
type gidChoice struct {
	index  int
	reason string // for Device.Description and errors
}

// selectGID picks the source GID index of a RoCE port: the first RoCE v2
// GID holding an IPv4-mapped address (routable over IPv4 networks, what
// most RoCE fabrics run), else the first RoCE v2 GID, else index 0. It reads
// <sysfs>/class/infiniband/<dev>/ports/<port>/gids/<i> and
// gid_attrs/types/<i>; entries that cannot be read are skipped (the kernel
// fails reads of unpopulated entries with EINVAL).
func selectGID(sysfs, dev string, port uint8) gidChoice {
	dir := filepath.Join(sysfs, "class", "infiniband", dev, "ports", strconv.Itoa(int(port)))
	entries, err := os.ReadDir(filepath.Join(dir, "gids"))
	if err != nil {
		return gidChoice{0, fmt.Sprintf("GID index 0 (cannot list GIDs: %v)", err)}
	}
	var indexes []int
	for _, e := range entries {
		if i, err := strconv.Atoi(e.Name()); err == nil && i >= 0 {
			indexes = append(indexes, i)
		}
	}
	sort.Ints(indexes)
	firstV2 := -1
	for _, i := range indexes {
		name := strconv.Itoa(i)
		typ, err := os.ReadFile(filepath.Join(dir, "gid_attrs", "types", name))
		if err != nil || strings.TrimSpace(string(typ)) != "RoCE v2" {
			continue
		}
		text, err := os.ReadFile(filepath.Join(dir, "gids", name))
		if err != nil {
			continue
		}
		gid, ok := parseGID(strings.TrimSpace(string(text)))
		if !ok || gid == [16]byte{} {
			continue
		}
		if isIPv4Mapped(gid) {
			return gidChoice{i, fmt.Sprintf("GID index %d (RoCE v2, IPv4 %d.%d.%d.%d)", i, gid[12], gid[13], gid[14], gid[15])}
		}
		if firstV2 < 0 {
			firstV2 = i
		}
	}
	if firstV2 >= 0 {
		return gidChoice{firstV2, fmt.Sprintf("GID index %d (RoCE v2, IPv6)", firstV2)}
	}
	return gidChoice{0, "GID index 0 (no RoCE v2 GID found)"}
}

// parseGID parses the sysfs form of a GID: eight groups of four hex digits
// separated by colons.
func parseGID(s string) ([16]byte, bool) {
	var gid [16]byte
	groups := strings.Split(s, ":")
	if len(groups) != 8 {
		return gid, false
	}
	for i, g := range groups {
		if len(g) != 4 {
			return gid, false
		}
		if _, err := hex.Decode(gid[2*i:2*i+2], []byte(g)); err != nil {
			return gid, false
		}
	}
	return gid, true
}

// isIPv4Mapped reports whether gid is ::ffff:a.b.c.d.
func isIPv4Mapped(gid [16]byte) bool {
	return [10]byte(gid[:10]) == [10]byte{} && gid[10] == 0xff && gid[11] == 0xff
}
