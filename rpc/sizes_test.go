package rpc_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
)

func TestFetchAndSendSizes(t *testing.T) {
	for _, tr := range testTransports {
		t.Run(tr, func(t *testing.T) {
			s, c := pair(t, tr, nil, nil)
			ctx := ctxT(t)
			for _, n := range []int{0, 1, 7, 4096, 65536, 65537, 1<<20 + 3, 8 << 20} {
				key := fmt.Sprintf("k%d", n)
				in := wrapped(t, n, byte(n))
				if err := s.Publish(context.Background(), key, in); err != nil {
					t.Fatal(err)
				}
				got, err := c.Fetch(ctx, key)
				if err != nil {
					t.Fatalf("Fetch %d bytes: %v", n, err)
				}
				if !bytes.Equal(got.Bytes(), in.Bytes()) {
					t.Fatalf("Fetch %d bytes: data differs", n)
				}
				got.Release()
				s.Unpublish(key)

				if err := c.Send(ctx, "s"+key, in); err != nil {
					t.Fatalf("Send %d bytes: %v", n, err)
				}
				back, err := s.Take(ctx, "s"+key)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(back.Bytes(), in.Bytes()) {
					t.Fatalf("Send %d bytes: data differs", n)
				}
				back.Release()
			}
			st := c.Stats()
			t.Logf("%s client stats: %+v", tr, st)
		})
	}
}
