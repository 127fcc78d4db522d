package verbstest

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
)

// testRemoteMapper runs only on providers whose queue pairs implement
// verbs.RemoteMapper. A Mapping shows the peer's bytes and their later
// changes, is read-only (checked in /proc/self/maps, never by faulting the
// test process), stays readable with the last bytes after the local queue
// pair closes and after the peer's domain closes, and Release is
// idempotent. MapRemote checks the key, the bounds and the remote-read
// right, and fails with ErrClosed on a closed queue pair.
func testRemoteMapper(t *testing.T, env Env) {
	t.Run("Mapping", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		m, ok := p.a.qp.(verbs.RemoteMapper)
		if !ok {
			t.Skipf("%s: queue pairs do not implement verbs.RemoteMapper (only the shm provider maps a peer's memory into this process)", env.Name)
		}
		page := os.Getpagesize()
		src := p.region(p.b, 3*page, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
		fill(src.Bytes(), 80)
		const off = 100
		n := 2*page + 5
		mp, err := m.MapRemote(verbs.Remote{Addr: src.Addr() + off, Key: src.RemoteKey()}, n)
		if err != nil {
			t.Fatalf("%s: MapRemote of %d bytes at %d: %v", env.Name, n, off, err)
		}
		released := false
		defer func() {
			if !released {
				mp.Release()
			}
		}()
		view := mp.Bytes()
		checkBytes(t, "mapping", view, src.Bytes()[off:off+n])
		checkReadOnly(t, env.Name, view)

		// The peer writes: the mapping shows it.
		fill(src.Bytes(), 81)
		checkBytes(t, "mapping after the peer wrote its region", view, src.Bytes()[off:off+n])

		// The local queue pair closes: the mapping stays, with the bytes.
		last := append([]byte(nil), src.Bytes()[off:off+n]...)
		if err := p.a.qp.Close(); err != nil {
			t.Fatalf("%s: Close: %v", env.Name, err)
		}
		checkBytes(t, "mapping after its queue pair closed", mp.Bytes(), last)
		if _, err := m.MapRemote(verbs.Remote{Addr: src.Addr(), Key: src.RemoteKey()}, 8); err == nil {
			t.Fatalf("%s: MapRemote on a closed queue pair succeeded", env.Name)
		} else {
			p.expectErr(err, verbs.ErrClosed, "MapRemote on a closed queue pair")
		}

		// The peer's domain closes: the mapping keeps the last bytes.
		if err := p.b.pd.Close(); err != nil {
			t.Fatalf("%s: closing the peer's domain: %v", env.Name, err)
		}
		checkBytes(t, "mapping after the peer's domain closed", mp.Bytes(), last)
		checkReadOnly(t, env.Name, mp.Bytes())

		released = true
		for i := range 2 {
			if err := mp.Release(); err != nil {
				t.Fatalf("%s: Release (call %d): %v, want nil", env.Name, i+1, err)
			}
		}
	})

	t.Run("Refused", func(t *testing.T) {
		defer leakcheck.Check(t)
		p := newPair(t, env, options{})
		defer p.close()
		m, ok := p.a.qp.(verbs.RemoteMapper)
		if !ok {
			t.Skipf("%s: queue pairs do not implement verbs.RemoteMapper (only the shm provider maps a peer's memory into this process)", env.Name)
		}
		readable := p.region(p.b, 4096, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
		writeOnly := p.region(p.b, 4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
		cases := []struct {
			name   string
			remote verbs.Remote
			n      int
		}{
			{"BadKey", verbs.Remote{Addr: readable.Addr(), Key: readable.RemoteKey() ^ 0x5ec7e7}, 64},
			{"PastEnd", verbs.Remote{Addr: readable.Addr() + 4000, Key: readable.RemoteKey()}, 97},
			{"BeforeStart", verbs.Remote{Addr: readable.Addr() - 1, Key: readable.RemoteKey()}, 64},
			{"WithoutRemoteRead", verbs.Remote{Addr: writeOnly.Addr(), Key: writeOnly.RemoteKey()}, 64},
		}
		for _, c := range cases {
			if mp, err := m.MapRemote(c.remote, c.n); err == nil {
				mp.Release()
				t.Errorf("%s: MapRemote %s succeeded, want an error", env.Name, c.name)
			}
		}
	})
}

// checkReadOnly fails the test when any page of b is mapped writable in
// this process, according to /proc/self/maps. Where that file cannot be
// read it logs and checks nothing.
func checkReadOnly(t *testing.T, name string, b []byte) {
	t.Helper()
	if len(b) == 0 {
		return
	}
	data, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Logf("%s: cannot read /proc/self/maps (%v): not checking that the mapping is read-only", name, err)
		return
	}
	lo := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
	hi := lo + uint64(len(b))
	covered := lo
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		start, end, perms, err := parseMapsLine(sc.Text())
		if err != nil {
			t.Fatalf("%s: /proc/self/maps: %v", name, err)
		}
		if end <= lo || start >= hi {
			continue
		}
		if strings.Contains(perms, "w") {
			t.Fatalf("%s: the mapping [%#x, %#x) lies in %q, which is writable (perms %s); a Mapping must be read-only", name, lo, hi, sc.Text(), perms)
		}
		if start <= covered && end > covered {
			covered = end
		}
	}
	if covered < hi {
		t.Fatalf("%s: /proc/self/maps does not cover the mapping [%#x, %#x) (covered up to %#x)", name, lo, hi, covered)
	}
}

// parseMapsLine parses "start-end perms ..." of a /proc/self/maps line.
func parseMapsLine(line string) (start, end uint64, perms string, err error) {
	f := strings.Fields(line)
	if len(f) < 2 {
		return 0, 0, "", fmt.Errorf("bad line %q", line)
	}
	a, b, ok := strings.Cut(f[0], "-")
	if !ok {
		return 0, 0, "", fmt.Errorf("bad range in %q", line)
	}
	if start, err = strconv.ParseUint(a, 16, 64); err != nil {
		return 0, 0, "", fmt.Errorf("bad range in %q: %v", line, err)
	}
	if end, err = strconv.ParseUint(b, 16, 64); err != nil {
		return 0, 0, "", fmt.Errorf("bad range in %q: %v", line, err)
	}
	return start, end, f[1], nil
}
