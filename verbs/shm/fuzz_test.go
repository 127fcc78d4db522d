package shm

import (
	"bytes"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc/infotest"
)

// FuzzParseInfo feeds arbitrary bytes to parseInfo: it must never panic,
// must wrap ErrInvalidInfo on failure, and what it accepts must encode back
// to the same bytes.
func FuzzParseInfo(f *testing.F) {
	good := softrc.Info{Secret: [16]byte{1, 2, 3}, QPID: 42, Addr: "@tensorrpc-shm-0123456789abcdef"}.Encode(infoMagic)
	f.Add(good)
	f.Add(softrc.Info{Addr: "/tmp/x.sock"}.Encode(infoMagic))
	f.Add([]byte{})
	f.Add([]byte("TRSM"))
	f.Add(good[:len(good)-1])
	infotest.Fuzz(f, infoMagic, parseInfo)
}

// FuzzDecodeMessage feeds arbitrary bytes to decodeMessage: it must never
// panic and what it accepts must encode back to the same bytes.
func FuzzDecodeMessage(f *testing.F) {
	var b [messageSize]byte
	(&message{typ: msgSend, flags: flagLast, seq: 9, length: 100, total: 100}).encode(&b)
	f.Add(b[:])
	f.Add([]byte{})
	f.Add(make([]byte, messageSize))
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := decodeMessage(in)
		if err != nil {
			return
		}
		var out [messageSize]byte
		m.encode(&out)
		if !bytes.Equal(out[:], in) {
			t.Fatalf("decodeMessage accepted %x, which re-encodes as %x", in, out)
		}
	})
}
