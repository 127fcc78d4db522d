package suite

import (
	"context"
	"fmt"
	"hash/crc32"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// A session is one case set up for one payload and size: servers
// listening, clients connected, the payload in place.
type session interface {
	// transport names the medium the bytes actually crossed, as negotiated.
	transport() string
	// newStream opens one stream: a client (or a connection, or a
	// goroutine on a shared connection) that repeats one transfer.
	newStream() (stream, error)
	close() error
}

// A stream repeats one transfer of the session's payload.
type stream interface {
	do(ctx context.Context) error
	// received is what the last do delivered to the stream, valid until
	// the next do or close: the bytes a check compares with the source.
	received() []byte
	close() error
}

// Verify modes: which transfers have their bytes checked against the
// source's (CRC32C), always outside the timed region.
const (
	// VerifyLast checks the last transfer of every stream in every round
	// (warm-up, calibration and each rep) after the round's clock has
	// stopped: every transfer of the sizes that make one transfer per
	// stream per rep, a sample of the small ones.
	VerifyLast = "last"
	// VerifyAll checks every transfer, in the stream right after the
	// transfer's clock stops; the rep's time leaves out each stream's
	// checks (see round).
	VerifyAll = "all"
	// VerifyOff checks nothing.
	VerifyOff = "off"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// checksum is the CRC32C of b.
func checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// verifier checks what streams received against the source.
type verifier struct {
	mode string
	size int
	want uint32 // CRC32C of the source
	// checked counts the transfers checked; it is updated by the stream
	// goroutines of a round.
	checked atomic.Int64
}

func newVerifier(mode string, src []byte) *verifier {
	return &verifier{mode: mode, size: len(src), want: checksum(src)}
}

// check compares what stream i received in its transfer n (counted from 1
// in the round named what) with the source.
func (v *verifier) check(s stream, i, n int, what string) error {
	got := s.received()
	v.checked.Add(1)
	if len(got) != v.size {
		return fmt.Errorf("stream %d, %s, transfer %d: received %d bytes, want %d", i, what, n, len(got), v.size)
	}
	if c := checksum(got); c != v.want {
		return fmt.Errorf("stream %d, %s, transfer %d: the %d bytes received differ from the source's (CRC32C %08x, want %08x)",
			i, what, n, len(got), c, v.want)
	}
	return nil
}

// timing is what one measurement observed.
type timing struct {
	reps      int
	ops       int64           // transfers timed, over every rep and stream
	seconds   float64         // wall time of the reps
	repRates  []float64       // bytes per second of each rep
	latencies []time.Duration // every timed transfer

	// With partners measured alongside (a ceiling, a baseline), one
	// pairing each, in the order of measure's partners.
	pairs []pairing

	verified int64 // transfers checked, of this case and its partners
}

// pairing is what a partner measured alongside a case observed: its bytes
// per second in the rep next to each of the case's, the case's rate over
// its, rep by rep, and every timed transfer of the partner.
type pairing struct {
	rates     []float64
	ratios    []float64
	latencies []time.Duration
}

// plan says how many transfers a measurement makes.
type plan struct {
	warm      bool          // run warm-up rounds and calibrate
	repTime   time.Duration // a rep lasts at least this long
	reps      int           // wanted reps
	minReps   int           // reps even over budget
	budget    time.Duration // time the reps should take
	opTimeout time.Duration // bound on one round, against hangs
	verify    string        // VerifyLast, VerifyAll or VerifyOff
	// moved is the bytes one transfer moves, counted in the rates: the
	// size, or twice it for a call that sends the size and receives it
	// back; 0 means the size.
	moved int
}

// streams are the open streams of one session, with the number of
// transfers each makes per rep.
type streams struct {
	list   []stream
	perRep int
	repEst time.Duration // expected duration of one rep
	v      *verifier     // nil: no checks
}

func openStreams(sess session, conc int, v *verifier) (*streams, error) {
	ss := &streams{perRep: 1, v: v}
	for range conc {
		s, err := sess.newStream()
		if err != nil {
			ss.close()
			return nil, err
		}
		ss.list = append(ss.list, s)
	}
	return ss, nil
}

func (ss *streams) close() {
	for _, s := range ss.list {
		s.close()
	}
}

// calibrate warms the streams up and sets how many transfers a rep makes
// so that it lasts about p.repTime.
func (ss *streams) calibrate(ctx context.Context, p plan) error {
	wall, _, err := round(ctx, ss.list, 1, p.opTimeout, ss.v, "warm-up")
	if err != nil {
		return err
	}
	perOp := wall
	if wall < p.repTime/10 {
		k := int(min(1e6, math.Ceil(float64(p.repTime/4)/float64(max(wall, time.Microsecond)))))
		if wall, _, err = round(ctx, ss.list, k, p.opTimeout, ss.v, "calibration"); err != nil {
			return err
		}
		perOp = wall / time.Duration(k)
	}
	ss.perRep = int(min(1e6, max(1, math.Ceil(float64(p.repTime)/float64(max(perOp, time.Nanosecond))))))
	ss.repEst = perOp * time.Duration(ss.perRep)
	return nil
}

// rep runs one rep and returns its rate in bytes per second, moved bytes
// per transfer.
func (ss *streams) rep(ctx context.Context, i, moved int, timeout time.Duration) (float64, time.Duration, [][]time.Duration, error) {
	wall, lat, err := round(ctx, ss.list, ss.perRep, timeout, ss.v, fmt.Sprintf("rep %d", i+1))
	if err != nil {
		return 0, 0, nil, err
	}
	return float64(ss.perRep*len(ss.list)) * float64(moved) / wall.Seconds(), wall, lat, nil
}

// measure runs conc streams of sess, each repeating a transfer of src:
// warm-up, calibration of the transfers per rep, then the reps.
//
// Each partner session (a ceiling, a baseline) runs the same transfers with
// as many streams, rep for rep alternating with sess, so that each of our
// reps has a partner rep seconds away: on a shared machine whose load
// changes by the minute, the ratio of neighbouring reps is steadier than
// the ratio of two medians taken at different times.
//
// Unless p.verify is VerifyOff, transfers are checked against src (see
// VerifyLast and VerifyAll), and a mismatch ends the measurement with an
// error that names the stream, the round and the transfer.
func measure(ctx context.Context, sess session, partners []partner, src []byte, conc int, p plan) (timing, error) {
	moved := p.moved
	if moved == 0 {
		moved = len(src)
	}
	var v *verifier
	if p.verify != VerifyOff {
		v = newVerifier(p.verify, src)
	}
	ours, err := openStreams(sess, conc, v)
	if err != nil {
		return timing{}, err
	}
	defer ours.close()
	theirs := make([]*streams, len(partners))
	for i, ps := range partners {
		if theirs[i], err = openStreams(ps.sess, conc, v); err != nil {
			return timing{}, fmt.Errorf("%s: %w", ps.name, err)
		}
		defer theirs[i].close()
	}

	reps := p.minReps
	if p.warm {
		if err := ours.calibrate(ctx, p); err != nil {
			return timing{}, err
		}
		repEst := ours.repEst
		for i, ts := range theirs {
			if err := ts.calibrate(ctx, p); err != nil {
				return timing{}, fmt.Errorf("%s: %w", partners[i].name, err)
			}
			repEst += ts.repEst
		}
		reps = p.reps
		if time.Duration(reps)*repEst > p.budget {
			reps = max(p.minReps, int(p.budget/max(repEst, 1)))
		}
	}

	t := timing{reps: reps, pairs: make([]pairing, len(partners))}
	partnerReps := func(i int, rates []float64) error {
		for j, ts := range theirs {
			rate, _, lat, err := ts.rep(ctx, i, moved, p.opTimeout)
			if err != nil {
				return fmt.Errorf("%s: %w", partners[j].name, err)
			}
			rates[j] = rate
			for _, l := range lat {
				t.pairs[j].latencies = append(t.pairs[j].latencies, l...)
			}
		}
		return nil
	}
	rates := make([]float64, len(partners))
	for i := range reps {
		// The partners go first in even reps and last in odd ones, so
		// that neither side always follows the other's garbage.
		if i%2 == 0 {
			if err := partnerReps(i, rates); err != nil {
				return timing{}, err
			}
		}
		rate, wall, lat, err := ours.rep(ctx, i, moved, p.opTimeout)
		if err != nil {
			return timing{}, err
		}
		if i%2 == 1 {
			if err := partnerReps(i, rates); err != nil {
				return timing{}, err
			}
		}
		t.ops += int64(ours.perRep * conc)
		t.seconds += wall.Seconds()
		t.repRates = append(t.repRates, rate)
		for _, l := range lat {
			t.latencies = append(t.latencies, l...)
		}
		for j, r := range rates {
			t.pairs[j].rates = append(t.pairs[j].rates, r)
			t.pairs[j].ratios = append(t.pairs[j].ratios, rate/r)
		}
	}
	if v != nil {
		t.verified = v.checked.Load()
	}
	return t, nil
}

// A partner is a session measured alongside a case: its ceiling or its
// baseline. Its name ("ceiling tcp-socket") prefixes its errors.
type partner struct {
	name string
	sess session
}

// round has every stream make k transfers at once and returns the wall time
// from the start signal to the last stream's end, and each transfer's time.
// Its errors name the stream, the round (what) and the transfer.
//
// With a verifier, what the streams received is checked outside the
// transfers' clocks: in VerifyLast mode each stream's last transfer once
// every stream has finished; in VerifyAll mode every transfer, by its
// stream, after its latency is taken, and the round's time is then the
// longest of the streams' times less their own checks (exact for one
// stream; with more, a stream checking frees the CPU for the others, so
// the sum is slightly shorter than it would be without checks).
func round(ctx context.Context, streams []stream, k int, timeout time.Duration, v *verifier, what string) (time.Duration, [][]time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	all := v != nil && v.mode == VerifyAll
	lat := make([][]time.Duration, len(streams))
	errs := make([]error, len(streams))
	busy := make([]time.Duration, len(streams)) // from the start to the stream's end, less its checks
	start := make(chan struct{})
	var wg sync.WaitGroup
	var t0 time.Time
	for i, s := range streams {
		lat[i] = make([]time.Duration, 0, k)
		wg.Go(func() {
			<-start
			var checks time.Duration
			for n := range k {
				t := time.Now()
				if err := s.do(ctx); err != nil {
					errs[i] = fmt.Errorf("stream %d, %s, transfer %d: %w", i+1, what, n+1, err)
					return
				}
				end := time.Now()
				lat[i] = append(lat[i], end.Sub(t))
				if all {
					if err := v.check(s, i+1, n+1, what); err != nil {
						errs[i] = err
						return
					}
					checks += time.Since(end)
				}
			}
			busy[i] = time.Since(t0) - checks
		})
	}
	t0 = time.Now()
	close(start)
	wg.Wait()
	wall := time.Since(t0)
	for _, err := range errs {
		if err != nil {
			return 0, nil, err
		}
	}
	if all {
		wall = slices.Max(busy)
	}
	if v != nil && !all {
		for i, s := range streams {
			if err := v.check(s, i+1, k, what); err != nil {
				return 0, nil, err
			}
		}
	}
	return wall, lat, nil
}

// median returns the median of xs (the mean of the middle two for an even
// count); xs is sorted in place.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	n := len(xs)
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

// percentile returns the nearest-rank q-quantile (0 < q ≤ 1) of ds, sorted
// in place.
func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(math.Ceil(q*float64(len(ds)))) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}
