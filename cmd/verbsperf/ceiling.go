package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// socketBandwidth writes iters messages of size bytes to w, stopping early
// after d, while the peer reads them into a size-byte buffer. sinkDone
// returns when the peer has read everything. It returns how many bytes
// went through and how long that took.
func socketBandwidth(w net.Conn, size, iters int, d time.Duration, sinkDone func() error) (result, error) {
	buf := make([]byte, size)
	start := time.Now()
	deadline := start.Add(d)
	n := 0
	for ; n < iters && time.Now().Before(deadline); n++ {
		if _, err := w.Write(buf); err != nil {
			return result{}, fmt.Errorf("raw socket: writing: %w", err)
		}
	}
	if err := sinkDone(); err != nil {
		return result{}, err
	}
	return result{iters: n, bytes: int64(n) * int64(size), elapsed: time.Since(start)}, nil
}

// sink reads total bytes from r, each size-byte message whole into a
// buffer of that size, as a Write's payload lands whole in its region.
func sink(r io.Reader, size int, total int64) error {
	buf := make([]byte, size)
	for total > 0 {
		n, err := io.ReadFull(r, buf[:min(int64(size), total)])
		total -= int64(n)
		if err != nil {
			return fmt.Errorf("raw socket: reading: %w", err)
		}
	}
	return nil
}

// socketLatency sends size bytes and waits for the echo, iters times or
// until d passes; each sample is half the round trip.
func socketLatency(c net.Conn, size, iters int, d time.Duration) (result, error) {
	buf := make([]byte, max(size, 1))[:size]
	res := result{lat: make([]time.Duration, 0, min(iters, 1<<16))}
	start := time.Now()
	deadline := start.Add(d)
	for i := 0; i < iters && time.Now().Before(deadline); i++ {
		t0 := time.Now()
		if _, err := c.Write(buf); err != nil {
			return result{}, fmt.Errorf("raw socket: writing: %w", err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			return result{}, fmt.Errorf("raw socket: reading the echo: %w", err)
		}
		res.lat = append(res.lat, time.Since(t0)/2)
	}
	res.iters = len(res.lat)
	res.elapsed = time.Since(start)
	return res, nil
}

// echo answers n messages of size bytes on c.
func echo(c net.Conn, size, n int) error {
	buf := make([]byte, size)
	for range n {
		if _, err := io.ReadFull(c, buf); err != nil {
			return fmt.Errorf("raw socket: reading: %w", err)
		}
		if _, err := c.Write(buf); err != nil {
			return fmt.Errorf("raw socket: echoing: %w", err)
		}
	}
	return nil
}

// loopbackPair is a connected pair of TCP sockets on 127.0.0.1.
func loopbackPair() (net.Conn, net.Conn, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	defer ln.Close()
	type accepted struct {
		c   net.Conn
		err error
	}
	ch := make(chan accepted, 1)
	go func() {
		c, err := ln.Accept()
		ch <- accepted{c, err}
	}()
	c1, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		ln.Close()
		<-ch
		return nil, nil, err
	}
	a := <-ch
	if a.err != nil {
		c1.Close()
		return nil, nil, a.err
	}
	return c1, a.c, nil
}

// localSocketCeiling measures a loopback socket in this process.
func localSocketCeiling(latency bool, size, iters int, d time.Duration) (result, error) {
	c1, c2, err := loopbackPair()
	if err != nil {
		return result{}, fmt.Errorf("raw socket: %w", err)
	}
	defer c1.Close()
	defer c2.Close()
	if latency {
		go echo(c2, size, iters) // ends when c2 closes
		return socketLatency(c1, size, iters, d)
	}
	// The sink reads each message whole into its buffer, until the writer,
	// which may stop early at the deadline, closes its side.
	type sunk struct {
		n   int64
		err error
	}
	ch := make(chan sunk, 1)
	go func() {
		var s sunk
		buf := make([]byte, size)
		for {
			n, err := io.ReadFull(c2, buf)
			s.n += int64(n)
			if err != nil {
				if !errors.Is(err, io.EOF) {
					s.err = fmt.Errorf("raw socket: reading: %w", err)
				}
				break
			}
		}
		ch <- s
	}()
	var res result
	res, err = socketBandwidth(c1, size, iters, d, func() error {
		c1.(*net.TCPConn).CloseWrite()
		s := <-ch
		return s.err
	})
	return res, err
}

// memcpyBandwidth copies size bytes iters times, or until d passes,
// between a source and a destination from newMemory (the provider's kind
// of memory), reused every iteration as the provider's registered buffers
// are: in cache while 2 × size fits. With threads > 1, each of as many
// goroutines copies its own slice of the message, every iteration: the same
// working set, copied by several cores at once, as a provider whose copies
// overlap would.
func memcpyBandwidth(newMemory func(int) (verbs.Memory, func(), error), size, iters, threads int, d time.Duration) (result, error) {
	if size == 0 {
		return result{}, errors.New("memcpy: zero size")
	}
	threads = min(max(threads, 1), size)
	var bufs [2][]byte
	for i := range bufs {
		m, free, err := newMemory(size)
		if err != nil {
			return result{}, fmt.Errorf("memcpy: %w", err)
		}
		defer free()
		bufs[i] = m.Bytes[:size]
	}
	src, dst := bufs[0], bufs[1]
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault the pages in before timing
	var wg sync.WaitGroup
	moved := make([]int64, threads)
	counts := make([]int, threads)
	start := time.Now()
	deadline := start.Add(d)
	for k := range threads {
		lo, hi := k*size/threads, (k+1)*size/threads
		wg.Go(func() {
			n := 0
			for ; n < iters && time.Now().Before(deadline); n++ {
				copy(dst[lo:hi], src[lo:hi])
			}
			counts[k], moved[k] = n, int64(n)*int64(hi-lo)
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	var bytes int64
	for _, m := range moved {
		bytes += m
	}
	return result{iters: slices.Min(counts), bytes: bytes, elapsed: elapsed}, nil
}
