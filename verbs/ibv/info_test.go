package ibv

import (
	"bytes"
	"errors"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

func roceInfo() connInfo {
	return connInfo{
		linkLayer:  linkEthernet,
		mtu:        3,
		responders: 16,
		qpn:        0x1234,
		psn:        0xabcdef,
		gid:        [16]byte{10: 0xff, 11: 0xff, 12: 192, 13: 168, 14: 1, 15: 7},
		secret:     [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
	}
}

func ibInfo() connInfo {
	return connInfo{linkLayer: linkInfini, mtu: 5, responders: 4, lid: 7, qpn: maxQPN, psn: 0}
}

func TestInfoRoundTrip(t *testing.T) {
	for _, want := range []connInfo{roceInfo(), ibInfo()} {
		b := want.marshal()
		if len(b) != infoSize {
			t.Fatalf("marshal: %d bytes, want %d", len(b), infoSize)
		}
		got, err := parseInfo(b)
		if err != nil {
			t.Fatalf("parseInfo(marshal(%+v)): %v", want, err)
		}
		if got != want {
			t.Fatalf("parseInfo(marshal(x)) = %+v, want %+v", got, want)
		}
	}
}

func TestParseInfoRejects(t *testing.T) {
	valid := roceInfo().marshal()
	mutate := func(f func(b []byte) []byte) []byte {
		return f(append([]byte(nil), valid...))
	}
	cases := map[string][]byte{
		"nil":             nil,
		"empty":           {},
		"one byte":        {0xff},
		"three zeros":     {0, 0, 0},
		"truncated":       valid[:len(valid)-1],
		"half":            valid[:len(valid)/2],
		"trailing byte":   append(append([]byte(nil), valid...), 0),
		"bad magic":       mutate(func(b []byte) []byte { b[0] = 'X'; return b }),
		"bad version":     mutate(func(b []byte) []byte { b[2] = 2; return b }),
		"link layer 0":    mutate(func(b []byte) []byte { b[3] = 0; return b }),
		"link layer 3":    mutate(func(b []byte) []byte { b[3] = 3; return b }),
		"MTU code 0":      mutate(func(b []byte) []byte { b[4] = 0; return b }),
		"MTU code 6":      mutate(func(b []byte) []byte { b[4] = 6; return b }),
		"QPN 0":           mutate(func(b []byte) []byte { copy(b[8:12], []byte{0, 0, 0, 0}); return b }),
		"QPN 1":           mutate(func(b []byte) []byte { copy(b[8:12], []byte{0, 0, 0, 1}); return b }),
		"QPN over 24 bit": mutate(func(b []byte) []byte { b[8] = 1; return b }),
		"PSN over 24 bit": mutate(func(b []byte) []byte { b[12] = 0x80; return b }),
		"RoCE without GID": mutate(func(b []byte) []byte {
			clear(b[16:32])
			return b
		}),
		"IB without LID": func() []byte {
			c := ibInfo()
			c.lid = 0
			return c.marshal()
		}(),
	}
	for name, b := range cases {
		if _, err := parseInfo(b); !errors.Is(err, verbs.ErrInvalidInfo) {
			t.Errorf("%s: parseInfo(%x) = %v, want ErrInvalidInfo", name, b, err)
		}
	}
}

func TestMTU(t *testing.T) {
	for _, c := range []struct {
		bytes int
		code  uint8
	}{{0, 1}, {100, 1}, {256, 1}, {511, 1}, {512, 2}, {1024, 3}, {1500, 3}, {2048, 4}, {4096, 5}, {9000, 5}} {
		if got := mtuCode(c.bytes); got != c.code {
			t.Errorf("mtuCode(%d) = %d, want %d", c.bytes, got, c.code)
		}
	}
	for code, want := range map[uint8]int{0: 0, 1: 256, 3: 1024, 5: 4096, 6: 0} {
		if got := mtuBytes(code); got != want {
			t.Errorf("mtuBytes(%d) = %d, want %d", code, got, want)
		}
	}
}

// FuzzParseInfo checks that no input makes parseInfo panic, that every
// error wraps ErrInvalidInfo, and that accepted info is canonical: it
// marshals back to the same bytes.
func FuzzParseInfo(f *testing.F) {
	f.Add(roceInfo().marshal())
	f.Add(ibInfo().marshal())
	f.Add([]byte{})
	f.Add([]byte("IB\x01"))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := parseInfo(b)
		if err != nil {
			if !errors.Is(err, verbs.ErrInvalidInfo) {
				t.Fatalf("parseInfo(%x): error %v does not wrap ErrInvalidInfo", b, err)
			}
			return
		}
		if again := c.marshal(); !bytes.Equal(again, b) {
			t.Fatalf("parseInfo(%x) accepted non-canonical info: marshals to %x", b, again)
		}
	})
}
