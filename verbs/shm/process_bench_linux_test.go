package shm

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/childproc"
	"github.com/tensorrpc/tensorrpc/internal/childproc/childtest"
	"github.com/tensorrpc/tensorrpc/verbs"
	"golang.org/x/sys/unix"
)

// controlOptions returns the options of the control path named name (see
// controlPaths).
func controlOptions(name string) []Option {
	for _, cp := range controlPaths {
		if cp.name == name {
			return cp.opts
		}
	}
	return nil
}

// childEcho is the peer of the cross-process benchmarks, in mode
// "echo/<control path>": it prints "info addr key" for a 4 KiB region that
// grants remote write, connects to the parent whose info it reads from
// stdin, answers every Send with a 64-byte Send and reposts every Recv,
// until the queue pair fails.
func childEcho(mode string) error {
	const size = 64
	opts := controlOptions(strings.TrimPrefix(mode, "echo/"))
	fd, err := unix.MemfdCreate("child", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return err
	}
	if err := unix.Ftruncate(fd, 4096); err != nil {
		return err
	}
	mem, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		return err
	}
	pd, err := New(opts...).Open("")
	if err != nil {
		return err
	}
	defer pd.Close()
	mr, err := pd.RegisterMemory(verbs.Memory{Bytes: mem, HasFD: true, FD: fd}, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		return err
	}
	cq, err := pd.NewCompletionQueue(64)
	if err != nil {
		return err
	}
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 32, MaxRecv: 32})
	if err != nil {
		return err
	}
	recv := func() error {
		return qp.PostRecv(verbs.RecvRequest{Local: verbs.Local{Region: mr, Offset: 2048, Length: size}})
	}
	for range 16 {
		if err := recv(); err != nil {
			return err
		}
	}
	line, err := childproc.ReadParent()
	if err != nil {
		return err
	}
	parentInfo, err := hex.DecodeString(line)
	if err != nil {
		return err
	}
	fmt.Printf("%x %d %d\n", qp.LocalInfo(), mr.Addr(), mr.RemoteKey())
	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	err = qp.Connect(ctx, parentInfo)
	cancel()
	if err != nil {
		return err
	}
	cs := make([]verbs.Completion, 16)
	for {
		n, err := cq.Wait(context.Background(), cs)
		if err != nil {
			return err
		}
		for _, c := range cs[:n] {
			if c.Status != verbs.StatusSuccess {
				return nil // the parent is done
			}
			switch c.Op {
			case verbs.OpRecv, verbs.OpRecvImm:
				// Errors here mean the parent closed its end.
				if recv() != nil {
					return nil
				}
				if c.Op == verbs.OpRecv && qp.PostSend(verbs.SendRequest{Op: verbs.OpSend, Local: verbs.Local{Region: mr, Length: size}}) != nil {
					return nil
				}
			}
		}
	}
}

// benchOtherProcess connects to an echo child using control path name and
// runs op b.N times.
func benchOtherProcess(b *testing.B, name string, op func(ps *parentSide, addr uint64, key uint32) error) {
	opts := controlOptions(name)
	pd, err := New(opts...).Open("")
	if err != nil {
		b.Fatal(err)
	}
	defer pd.Close()
	cq, _ := pd.NewCompletionQueue(64)
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 32, MaxRecv: 32})
	if err != nil {
		b.Fatal(err)
	}
	mr, err := pd.RegisterMemory(sealedMemory(b, 4096), verbs.AccessLocalWrite)
	if err != nil {
		b.Fatal(err)
	}
	ps := &parentSide{pd: pd, cq: cq, qp: qp, mr: mr}
	p := childtest.Start(b, "echo/"+name, childproc.Options{})
	defer p.Stop(childTimeout) // it ends by itself once our queue pair closed
	if err := p.WriteLine(fmt.Sprintf("%x", qp.LocalInfo())); err != nil {
		b.Fatal(err)
	}
	var infoHex string
	var addr uint64
	var key uint32
	if _, err := fmt.Sscanf(childtest.Line(b, p), "%s %d %d", &infoHex, &addr, &key); err != nil {
		b.Fatal(err)
	}
	childInfo, err := hex.DecodeString(infoHex)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), childTimeout)
	defer cancel()
	if err := qp.Connect(ctx, childInfo); err != nil {
		b.Fatal(err)
	}
	for range 100 { // warm up: map the region, fault pages in
		if err := op(ps, addr, key); err != nil {
			b.Fatal(err)
		}
	}
	b.ResetTimer()
	for range b.N {
		if err := op(ps, addr, key); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	qp.Close()
}

// BenchmarkOtherProcessRoundTrip is BenchmarkSendRecvRoundTrip with the
// peer in another process: a 64-byte Send there and the child's Send back.
func BenchmarkOtherProcessRoundTrip(b *testing.B) {
	for _, cp := range controlPaths {
		b.Run(cp.name, func(b *testing.B) {
			cs := make([]verbs.Completion, 4)
			benchOtherProcess(b, cp.name, func(ps *parentSide, _ uint64, _ uint32) error {
				if err := ps.qp.PostRecv(verbs.RecvRequest{Local: verbs.Local{Region: ps.mr, Offset: 2048, Length: 64}}); err != nil {
					return err
				}
				if err := ps.qp.PostSend(verbs.SendRequest{Op: verbs.OpSend, Local: verbs.Local{Region: ps.mr, Length: 64}}); err != nil {
					return err
				}
				for {
					n, err := ps.cq.Wait(context.Background(), cs)
					if err != nil {
						return err
					}
					got := false
					for _, c := range cs[:n] {
						if err := verbs.CompletionError(c); err != nil {
							return err
						}
						got = got || c.Op == verbs.OpRecv
					}
					if got {
						return nil
					}
				}
			})
		})
	}
}

// BenchmarkOtherProcessWriteImm is BenchmarkWriteImm with the target in
// another process.
func BenchmarkOtherProcessWriteImm(b *testing.B) {
	for _, cp := range controlPaths {
		b.Run(cp.name, func(b *testing.B) {
			cs := make([]verbs.Completion, 1)
			benchOtherProcess(b, cp.name, func(ps *parentSide, addr uint64, key uint32) error {
				wr := verbs.SendRequest{Op: verbs.OpWriteImm, Imm: 7, Local: verbs.Local{Region: ps.mr, Length: 64}, Remote: verbs.Remote{Addr: addr, Key: key}}
				if err := ps.qp.PostSend(wr); err != nil {
					return err
				}
				if _, err := ps.cq.Wait(context.Background(), cs); err != nil {
					return err
				}
				if cs[0].Op != verbs.OpWriteImm {
					return errors.New("unexpected completion")
				}
				return verbs.CompletionError(cs[0])
			})
		})
	}
}
