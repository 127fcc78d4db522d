//go:build linux

package mempool

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestRingBasics(t *testing.T) {
	mem := make([]byte, ringHeader+256)
	r, err := NewRing(mem)
	if err != nil {
		t.Fatal(err)
	}
	if r.Cap() != 256 || r.Free() != 256 || r.Used() != 0 || r.MaxRecord() != 120 {
		t.Fatalf("Cap %d Free %d Used %d MaxRecord %d", r.Cap(), r.Free(), r.Used(), r.MaxRecord())
	}
	c, err := AttachRing(mem)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Read(); ok {
		t.Fatal("Read on an empty ring")
	}
	if err := r.Commit(1); err == nil {
		t.Error("Commit without Reserve succeeded")
	}
	if _, err := r.Reserve(121); !errors.Is(err, ErrTooLarge) {
		t.Errorf("Reserve(121): %v, want ErrTooLarge", err)
	}

	put := func(s string) error {
		b, err := r.Reserve(len(s))
		if err != nil {
			return err
		}
		copy(b, s)
		return r.Commit(len(s))
	}
	// 100 bytes of payload: 8 + 104 = 112 bytes per record.
	rec := func(i int) string { return fmt.Sprintf("%-100d", i) }
	for i := range 2 {
		if err := put(rec(i)); err != nil {
			t.Fatalf("put %d: %v", i, err)
		}
	}
	if r.Used() != 224 || r.Free() != 32 {
		t.Fatalf("Used %d Free %d after two records", r.Used(), r.Free())
	}
	if err := put(rec(2)); !errors.Is(err, ErrRingFull) {
		t.Fatalf("third record: %v, want ErrRingFull", err)
	}
	got, ok := c.Read()
	if !ok || string(got) != rec(0) || cap(got) != len(got) {
		t.Fatalf("Read: %q %v", got, ok)
	}
	if err := put(rec(2)); !errors.Is(err, ErrRingFull) {
		t.Fatalf("a record read but not released gave credit: %v", err)
	}
	c.Release()
	// The third record does not fit in the 32 bytes left at the end, so it
	// wraps behind a padding record.
	if err := put(rec(2)); err != nil {
		t.Fatalf("after Release: %v", err)
	}
	if r.Used() != 112+32+112 {
		t.Fatalf("Used %d, want 256 (two records and 32 bytes of padding)", r.Used())
	}
	for i := 1; i <= 2; i++ {
		got, ok := c.Read()
		if !ok || string(got) != rec(i) {
			t.Fatalf("record %d: %q %v", i, got, ok)
		}
	}
	if _, ok := c.Read(); ok {
		t.Fatal("Read past the end")
	}
	c.Release()
	if r.Used() != 0 || c.Err() != nil {
		t.Fatalf("Used %d, Err %v after draining", r.Used(), c.Err())
	}
	if _, err := NewRing(make([]byte, 100)); err == nil {
		t.Error("NewRing on 100 bytes succeeded")
	}
}

func TestRingCorruption(t *testing.T) {
	mem := make([]byte, 1024)
	r, _ := NewRing(mem)
	b, _ := r.Reserve(16)
	copy(b, "0123456789abcdef")
	_ = r.Commit(16)

	bad := bytes.Clone(mem)
	binary.LittleEndian.PutUint64(bad[ringHeader:], 5000) // length past the ring
	c, err := AttachRing(bad)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Read(); ok || !errors.Is(c.Err(), ErrRingCorrupt) {
		t.Errorf("oversized record: Err %v", c.Err())
	}
	bad = bytes.Clone(mem)
	binary.LittleEndian.PutUint64(bad[ringHeader:], 16|9<<32) // unknown kind
	c, _ = AttachRing(bad)
	if _, ok := c.Read(); ok || !errors.Is(c.Err(), ErrRingCorrupt) {
		t.Errorf("unknown kind: Err %v", c.Err())
	}
	bad = bytes.Clone(mem)
	binary.NativeEndian.PutUint64(bad[ringTailOff:], 1<<40)
	if _, err := AttachRing(bad); !errors.Is(err, ErrRingCorrupt) {
		t.Errorf("tail far ahead: %v", err)
	}
	bad = bytes.Clone(mem)
	bad[0] ^= 1
	if _, err := AttachRing(bad); !errors.Is(err, ErrRingCorrupt) {
		t.Errorf("bad magic: %v", err)
	}
	bad = bytes.Clone(mem)
	binary.NativeEndian.PutUint64(bad[ringCapOff:], 1<<20)
	if _, err := AttachRing(bad); !errors.Is(err, ErrRingCorrupt) {
		t.Errorf("capacity beyond the memory: %v", err)
	}
}

// FuzzRingRead attaches to arbitrary memory and reads from it: a peer's
// garbage must be refused, never followed out of bounds.
func FuzzRingRead(f *testing.F) {
	mem := make([]byte, 512)
	r, _ := NewRing(mem)
	for _, n := range []int{3, 40, 100} {
		b, _ := r.Reserve(n)
		_ = r.Commit(len(b))
	}
	f.Add(bytes.Clone(mem))
	f.Fuzz(func(t *testing.T, data []byte) {
		mem := make([]byte, max(len(data), minRingLength))
		copy(mem, data)
		c, err := AttachRing(mem)
		if err != nil {
			return
		}
		for range 64 {
			rec, ok := c.Read()
			if !ok {
				break
			}
			_ = rec[len(rec)-min(len(rec), 1):] // in bounds
			c.Release()
		}
	})
}

// ringTraffic produces count records of pseudo-random sizes whose contents
// depend on their index; checkRecord verifies one.
func ringRecord(i int, rng *rand.Rand, max int) []byte {
	n := 8 + rng.IntN(max-8)
	b := make([]byte, n)
	binary.LittleEndian.PutUint64(b, uint64(i))
	for j := 8; j < n; j++ {
		b[j] = byte(i*31 + j)
	}
	return b
}

func checkRecord(i int, rec []byte) error {
	if len(rec) < 8 || binary.LittleEndian.Uint64(rec) != uint64(i) {
		return fmt.Errorf("record %d: got %d bytes starting %x", i, len(rec), rec[:min(8, len(rec))])
	}
	for j := 8; j < len(rec); j++ {
		if rec[j] != byte(i*31+j) {
			return fmt.Errorf("record %d: byte %d is %d", i, j, rec[j])
		}
	}
	return nil
}

// produce writes count records into r, retrying while the ring is full.
func produce(r *Ring, count, seed int) error {
	rng := rand.New(rand.NewPCG(uint64(seed), 1))
	deadline := time.Now().Add(time.Minute)
	spins := 0
	for i := 0; i < count; {
		rec := ringRecord(i, rng, r.MaxRecord()/3)
		for {
			b, err := r.Reserve(len(rec))
			if errors.Is(err, ErrRingFull) {
				if time.Now().After(deadline) {
					return fmt.Errorf("ring stayed full at record %d", i)
				}
				backoff(&spins)
				continue
			}
			if err != nil {
				return err
			}
			copy(b, rec)
			if err := r.Commit(len(rec)); err != nil {
				return err
			}
			break
		}
		i++
	}
	return nil
}

// backoff yields the processor while the other end catches up, and sleeps
// when it takes long.
func backoff(spins *int) {
	if *spins++; *spins%1024 != 0 {
		runtime.Gosched()
		return
	}
	time.Sleep(20 * time.Microsecond)
}

// consume reads count records from r, releasing every few.
func consume(r *Ring, count int) error {
	deadline := time.Now().Add(time.Minute)
	spins := 0
	for i := 0; i < count; {
		rec, ok := r.Read()
		if !ok {
			if r.Err() != nil {
				return r.Err()
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("no record %d", i)
			}
			r.Release()
			backoff(&spins)
			continue
		}
		if err := checkRecord(i, rec); err != nil {
			return err
		}
		i++
		if i%3 == 0 {
			r.Release()
		}
	}
	r.Release()
	return nil
}

// TestRingTwoMappings runs the producer on an arena and the consumer on a
// second mapping of its memfd, as two processes would.
func TestRingTwoMappings(t *testing.T) {
	a, err := NewArena(BackingMemfd, 64<<10, WithPinning(false))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	fd, _ := a.FD()
	peer, err := unix.Mmap(fd, 0, a.Len(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(peer)
	prod, err := NewRing(a.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	cons, err := AttachRing(peer)
	if err != nil {
		t.Fatal(err)
	}
	const count = 20000
	errc := make(chan error, 1)
	go func() { errc <- produce(prod, count, 7) }()
	if err := consume(cons, count); err != nil {
		t.Error(err)
	}
	if err := <-errc; err != nil {
		t.Error(err)
	}
	if prod.Used() != 0 {
		t.Errorf("Used %d after draining", prod.Used())
	}
}

const ringChildEnv = "MEMPOOL_RING_CHILD"

// TestRingPeerProcess shares a memfd ring with a child process (this test
// binary, re-executed) that consumes what this process produces.
func TestRingPeerProcess(t *testing.T) {
	a, err := NewArena(BackingMemfd, 64<<10, WithPinning(false))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	prod, err := NewRing(a.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	fd, _ := a.FD()
	const count = 5000
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), ringChildEnv+"="+strconv.Itoa(count))
	cmd.ExtraFiles = []*os.File{os.NewFile(uintptr(fd), "ring")} // fd 3 in the child
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	perr := produce(prod, count, 11)
	werr := cmd.Wait()
	if perr != nil || werr != nil {
		t.Fatalf("producer: %v; child: %v\n%s", perr, werr, out.Bytes())
	}
	if prod.Used() != 0 {
		t.Errorf("Used %d after the child drained the ring", prod.Used())
	}
}

// ringChild is the consumer side of TestRingPeerProcess.
func ringChild() int {
	count, _ := strconv.Atoi(os.Getenv(ringChildEnv))
	a, err := OpenMemfd(3, WithPinning(false))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	defer a.Close()
	r, err := AttachRing(a.Bytes())
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	if err := consume(r, count); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

// TestRingRandom checks the ring against a simple queue with random record
// sizes, interleaving reserve/commit and read/release in one goroutine.
func TestRingRandom(t *testing.T) {
	mem := make([]byte, ringHeader+4096)
	r, _ := NewRing(mem)
	c, _ := AttachRing(mem)
	rng := rand.New(rand.NewPCG(3, 4))
	var queue []uint32 // checksums of committed, unread records
	var unreleased int
	for i := 0; i < 50000; i++ {
		if rng.IntN(2) == 0 {
			n := rng.IntN(r.MaxRecord() + 1)
			b, err := r.Reserve(n)
			if errors.Is(err, ErrRingFull) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			for j := range b {
				b[j] = byte(rng.Uint32())
			}
			n = rng.IntN(n + 1) // commit a prefix
			if err := r.Commit(n); err != nil {
				t.Fatal(err)
			}
			queue = append(queue, crc32.ChecksumIEEE(b[:n]))
		} else if rec, ok := c.Read(); ok {
			if len(queue) == 0 || crc32.ChecksumIEEE(rec) != queue[0] {
				t.Fatalf("op %d: record does not match", i)
			}
			queue = queue[1:]
			if unreleased++; rng.IntN(3) == 0 {
				c.Release()
				unreleased = 0
			}
		}
		if r.Used() < 0 || r.Used() > r.Cap() || r.Free()+r.Used() != r.Cap() {
			t.Fatalf("op %d: Used %d Free %d", i, r.Used(), r.Free())
		}
	}
	if c.Err() != nil {
		t.Fatal(c.Err())
	}
}

// TestRingPeek: Peek shows the record the next Read returns, without
// taking it, across the padding at the ring's end too.
func TestRingPeek(t *testing.T) {
	mem := make([]byte, ringHeader+256)
	r, err := NewRing(mem)
	if err != nil {
		t.Fatal(err)
	}
	c, err := AttachRing(mem)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Peek(); ok {
		t.Fatal("Peek on an empty ring")
	}
	for i := range 40 { // 40 records of 48 bytes wrap the 256-byte ring several times
		b, err := r.Reserve(40)
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		for j := range b {
			b[j] = byte(i)
		}
		if err := r.Commit(40); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			p, ok := c.Peek()
			if !ok || len(p) != 40 || p[0] != byte(i) {
				t.Fatalf("record %d: Peek %v %x", i, ok, p)
			}
		}
		got, ok := c.Read()
		if !ok || got[0] != byte(i) || got[39] != byte(i) {
			t.Fatalf("record %d: Read after Peek %v %x", i, ok, got)
		}
		c.Release()
		if _, ok := c.Peek(); ok {
			t.Fatalf("record %d: Peek after the last record was read", i)
		}
	}
}
