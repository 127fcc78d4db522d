// Package infotest is the fuzz target a software provider's FuzzParseInfo
// runs on its connection info (softrc.Info with the provider's magic and
// checks).
package infotest

import (
	"bytes"
	"errors"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/internal/softrc"
)

// Fuzz feeds arbitrary bytes to parse, which must never panic, must refuse
// with an error wrapping verbs.ErrInvalidInfo, and must accept only what
// encodes back (with magic) to the same bytes.
func Fuzz(f *testing.F, magic string, parse func([]byte) (softrc.Info, error)) {
	f.Fuzz(func(t *testing.T, b []byte) {
		in, err := parse(b)
		if err != nil {
			if !errors.Is(err, verbs.ErrInvalidInfo) {
				t.Fatalf("parseInfo error %v does not wrap ErrInvalidInfo", err)
			}
			return
		}
		if again := in.Encode(magic); !bytes.Equal(again, b) {
			t.Fatalf("parseInfo accepted %x as %+v, which encodes as %x", b, in, again)
		}
	})
}
