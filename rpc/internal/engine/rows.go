package engine

import (
	"context"
	"sync"

	"google.golang.org/grpc/status"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// RowRun is N rows that lie back to back on both sides of a rows transfer:
// remote rows Src.. land on local rows Dst.. (ReadRows).
type RowRun struct{ Src, Dst, N int64 }

// RowRuns turns a list of (source row, destination row) pairs, taken in
// order, into runs: consecutive pairs whose rows follow each other on
// both sides merge into one run, so a range of rows is one Read.
func RowRuns(n int, pair func(i int) (src, dst int64)) []RowRun {
	var runs []RowRun
	for i := range n {
		src, dst := pair(i)
		if k := len(runs) - 1; k >= 0 && runs[k].Src+runs[k].N == src && runs[k].Dst+runs[k].N == dst {
			runs[k].N++
			continue
		}
		runs = append(runs, RowRun{Src: src, Dst: dst, N: 1})
	}
	return runs
}

// ReadRows reads rows of rowBytes bytes from remote (row 0 at remote)
// into local (row 0 at local.Offset), one Read per run, all posted
// before any is waited for (as many at once as the send queue has room
// for): one request and one batch of Reads, not a round trip per row.
// On failure, or when ctx ends while Reads are under way, failed runs
// once every posted Read has completed (so local's memory is freed only
// then); it never runs after ReadRows returns nil.
func ReadRows(ctx context.Context, l *Link, local verbs.Local, remote verbs.Remote, rowBytes int64, runs []RowRun, failed func()) error {
	var mu sync.Mutex
	left := 1 // the poster's hold, dropped once everything is posted
	var first error
	all := make(chan struct{})
	finish := func(err error) {
		mu.Lock()
		if err != nil && first == nil {
			first = err
		}
		left--
		last := left == 0
		mu.Unlock()
		if last {
			close(all)
		}
	}
	for _, r := range runs {
		if r.N <= 0 {
			continue
		}
		mu.Lock()
		stop := first != nil
		mu.Unlock()
		if stop {
			break
		}
		if err := l.takeRoom(ctx); err != nil {
			mu.Lock()
			if first == nil {
				first = err
			}
			mu.Unlock()
			break
		}
		wr := verbs.SendRequest{Op: verbs.OpRead,
			Local:  verbs.Local{Region: local.Region, Offset: local.Offset + int(r.Dst*rowBytes), Length: int(r.N * rowBytes)},
			Remote: verbs.Remote{Addr: remote.Addr + uint64(r.Src*rowBytes), Key: remote.Key}}
		mu.Lock()
		left++
		mu.Unlock()
		l.Reads.Add(1)
		if err := l.PostAsync(wr, func(c verbs.Completion) {
			<-l.room
			finish(CompletionStatus(c))
		}); err != nil {
			<-l.room
			finish(Unavailable(err))
		}
	}
	finish(nil)
	select {
	case <-all:
	case <-ctx.Done():
		mu.Lock()
		done := left == 0
		mu.Unlock()
		if !done {
			go func() {
				<-all
				failed()
			}()
			return status.FromContextError(ctx.Err()).Err()
		}
	}
	if first != nil {
		failed()
		return first
	}
	return nil
}

// ReadRowsLanes is ReadRows spread over lanes, one share of the runs per
// lane, read at once (each lane's queue pair works on its own: on shm,
// its Reads are copies made where they are posted, so the lanes' shares
// are copied on as many cores): remotes[i] names the source on lanes[i].
// With one lane, or one run, it is ReadRows. failed runs as ReadRows's
// does, once, after every lane's Reads have completed.
func ReadRowsLanes(ctx context.Context, lanes []*Link, local verbs.Local, remotes []verbs.Remote, rowBytes int64, runs []RowRun, failed func()) error {
	k := min(len(lanes), len(remotes), len(runs))
	if k <= 1 {
		return ReadRows(ctx, lanes[0], local, remotes[0], rowBytes, runs, failed)
	}
	var total int64
	for _, r := range runs {
		total += r.N
	}
	// Shares of about equal rows, runs kept whole.
	shares := make([][]RowRun, 0, k)
	var acc int64
	start := 0
	for i, r := range runs {
		acc += r.N
		if len(shares) < k-1 && acc*int64(k) >= total*int64(len(shares)+1) {
			shares = append(shares, runs[start:i+1])
			start = i + 1
		}
	}
	shares = append(shares, runs[start:])
	end := joinEnds(len(shares), failed)
	errs := make([]error, len(shares))
	var wg sync.WaitGroup
	for i, share := range shares {
		read := func() {
			if errs[i] = ReadRows(ctx, lanes[i], local, remotes[i], rowBytes, share, func() { end(false) }); errs[i] == nil {
				end(true)
			}
		}
		if i == len(shares)-1 {
			read()
		} else {
			wg.Go(read)
		}
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
