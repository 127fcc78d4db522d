package suite

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
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
	close() error
}

// streamFunc adapts a function to a stream with nothing to close.
type streamFunc func(ctx context.Context) error

func (f streamFunc) do(ctx context.Context) error { return f(ctx) }
func (f streamFunc) close() error                 { return nil }

// timing is what one measurement observed.
type timing struct {
	reps      int
	ops       int64           // transfers timed, over every rep and stream
	seconds   float64         // wall time of the reps
	repRates  []float64       // bytes per second of each rep
	latencies []time.Duration // every timed transfer

	// With a ceiling measured alongside: its bytes per second in the rep
	// next to each of ours, and our rate over its, rep by rep.
	ceilingRates []float64
	ratios       []float64
}

// plan says how many transfers a measurement makes.
type plan struct {
	warm      bool          // run warm-up rounds and calibrate
	repTime   time.Duration // a rep lasts at least this long
	reps      int           // wanted reps
	minReps   int           // reps even over budget
	budget    time.Duration // time the reps should take
	opTimeout time.Duration // bound on one round, against hangs
}

// streams are the open streams of one session, with the number of
// transfers each makes per rep.
type streams struct {
	list   []stream
	perRep int
	repEst time.Duration // expected duration of one rep
}

func openStreams(sess session, conc int) (*streams, error) {
	ss := &streams{perRep: 1}
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
	wall, _, err := round(ctx, ss.list, 1, p.opTimeout)
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	perOp := wall
	if wall < p.repTime/10 {
		k := int(min(1e6, math.Ceil(float64(p.repTime/4)/float64(max(wall, time.Microsecond)))))
		if wall, _, err = round(ctx, ss.list, k, p.opTimeout); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
		perOp = wall / time.Duration(k)
	}
	ss.perRep = int(min(1e6, max(1, math.Ceil(float64(p.repTime)/float64(max(perOp, time.Nanosecond))))))
	ss.repEst = perOp * time.Duration(ss.perRep)
	return nil
}

// rep runs one rep and returns its rate in bytes per second.
func (ss *streams) rep(ctx context.Context, size int, timeout time.Duration) (float64, time.Duration, [][]time.Duration, error) {
	wall, lat, err := round(ctx, ss.list, ss.perRep, timeout)
	if err != nil {
		return 0, 0, nil, err
	}
	return float64(ss.perRep*len(ss.list)*size) / wall.Seconds(), wall, lat, nil
}

// measure runs conc streams of sess, each repeating a transfer of size
// bytes: warm-up, calibration of the transfers per rep, then the reps.
//
// With a ceiling session, the ceiling runs the same transfers with as many
// streams, rep for rep alternating with sess, so that each of our reps has
// a ceiling rep seconds away: on a shared machine whose load changes by
// the minute, the ratio of neighbouring reps is steadier than the ratio of
// two medians taken at different times.
func measure(ctx context.Context, sess, ceiling session, size, conc int, p plan) (timing, error) {
	ours, err := openStreams(sess, conc)
	if err != nil {
		return timing{}, err
	}
	defer ours.close()
	var theirs *streams
	if ceiling != nil {
		if theirs, err = openStreams(ceiling, conc); err != nil {
			return timing{}, fmt.Errorf("ceiling: %w", err)
		}
		defer theirs.close()
	}

	reps := p.minReps
	if p.warm {
		if err := ours.calibrate(ctx, p); err != nil {
			return timing{}, err
		}
		repEst := ours.repEst
		if theirs != nil {
			if err := theirs.calibrate(ctx, p); err != nil {
				return timing{}, fmt.Errorf("ceiling: %w", err)
			}
			repEst += theirs.repEst
		}
		reps = p.reps
		if time.Duration(reps)*repEst > p.budget {
			reps = max(p.minReps, int(p.budget/max(repEst, 1)))
		}
	}

	t := timing{reps: reps}
	for i := range reps {
		var ceilRate float64
		// The ceiling goes first in even reps and last in odd ones, so
		// that neither side always follows the other's garbage.
		if theirs != nil && i%2 == 0 {
			if ceilRate, _, _, err = theirs.rep(ctx, size, p.opTimeout); err != nil {
				return timing{}, fmt.Errorf("ceiling: %w", err)
			}
		}
		rate, wall, lat, err := ours.rep(ctx, size, p.opTimeout)
		if err != nil {
			return timing{}, err
		}
		if theirs != nil && i%2 == 1 {
			if ceilRate, _, _, err = theirs.rep(ctx, size, p.opTimeout); err != nil {
				return timing{}, fmt.Errorf("ceiling: %w", err)
			}
		}
		t.ops += int64(ours.perRep * conc)
		t.seconds += wall.Seconds()
		t.repRates = append(t.repRates, rate)
		for _, l := range lat {
			t.latencies = append(t.latencies, l...)
		}
		if theirs != nil {
			t.ceilingRates = append(t.ceilingRates, ceilRate)
			t.ratios = append(t.ratios, rate/ceilRate)
		}
	}
	return t, nil
}

// round has every stream make k transfers at once and returns the wall time
// from the start signal to the last stream's end, and each transfer's time.
func round(ctx context.Context, streams []stream, k int, timeout time.Duration) (time.Duration, [][]time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	lat := make([][]time.Duration, len(streams))
	errs := make([]error, len(streams))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, s := range streams {
		lat[i] = make([]time.Duration, 0, k)
		wg.Go(func() {
			<-start
			for range k {
				t0 := time.Now()
				if err := s.do(ctx); err != nil {
					errs[i] = err
					return
				}
				lat[i] = append(lat[i], time.Since(t0))
			}
		})
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	wall := time.Since(t0)
	for _, err := range errs {
		if err != nil {
			return 0, nil, err
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
