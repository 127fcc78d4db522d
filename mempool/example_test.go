//go:build linux

package mempool_test

import (
	"context"
	"fmt"

	"github.com/tensorrpc/tensorrpc/mempool"
)

func Example() {
	registered := 0
	p, err := mempool.NewPool(
		mempool.WithArenaSize(1<<20),
		mempool.WithLimit(64<<20),
		mempool.WithHook(mempool.HookFuncs{
			Added:   func(a *mempool.Arena) error { registered++; return nil },
			Removed: func(a *mempool.Arena) { registered-- },
		}),
	)
	if err != nil {
		panic(err)
	}
	buf, err := p.Alloc(context.Background(), 1000)
	if err != nil {
		panic(err)
	}
	copy(buf.Bytes(), "tensor bytes")
	arena, offset, _ := p.Locate(buf.Addr())
	fmt.Println(len(buf.Bytes()), arena == buf.Arena(), offset == buf.Offset(), registered)
	if err := buf.Release(); err != nil {
		panic(err)
	}
	fmt.Println(p.Stats().InUse, p.Close(), registered)
	// Output:
	// 1000 true true 1
	// 0 <nil> 0
}

func ExampleRing() {
	mem := make([]byte, 4096) // in practice a memfd arena shared with a peer
	producer, _ := mempool.NewRing(mem)
	consumer, _ := mempool.AttachRing(mem)

	b, _ := producer.Reserve(5)
	copy(b, "hello")
	_ = producer.Commit(5)

	rec, _ := consumer.Read()
	fmt.Printf("%s, used %d\n", rec, producer.Used())
	consumer.Release()
	fmt.Println("used", producer.Used())
	// Output:
	// hello, used 16
	// used 0
}
