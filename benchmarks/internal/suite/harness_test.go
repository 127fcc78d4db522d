package suite

import (
	"bytes"
	"context"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// corruptingSession is memcpy whose stream number badStream (counted from
// 1) flips a byte of what it received in its transfer number badOp
// (counted from 1 over the stream's life; 0: every transfer).
type corruptingSession struct {
	src              []byte
	badStream, badOp int
	streams          atomic.Int32
}

func (s *corruptingSession) transport() string { return "memory" }
func (s *corruptingSession) close() error      { return nil }

func (s *corruptingSession) newStream() (stream, error) {
	n := int(s.streams.Add(1))
	return &corruptingStream{memcpyStream: memcpyStream{src: s.src, dst: make([]byte, len(s.src))},
		bad: n == s.badStream, badOp: s.badOp}, nil
}

type corruptingStream struct {
	memcpyStream
	bad   bool
	badOp int
	ops   int
}

func (s *corruptingStream) do(ctx context.Context) error {
	s.memcpyStream.do(ctx)
	s.ops++
	if s.bad && (s.badOp == 0 || s.ops == s.badOp) {
		s.dst[len(s.dst)/2] ^= 0x40
	}
	return nil
}

func testPlan(verify string) plan {
	return plan{warm: true, repTime: time.Millisecond, reps: 3, minReps: 3, budget: time.Second, opTimeout: 10 * time.Second, verify: verify}
}

func testSource(n int) []byte {
	src := make([]byte, n)
	newPayloadSource(Payloads[:1], n).fill(Payloads[0], src)
	return src
}

// TestVerifyDetectsCorruption corrupts one transfer of one stream and
// checks that the measurement fails naming that stream, in both modes
// that check; with checks off the corruption goes unseen.
func TestVerifyDetectsCorruption(t *testing.T) {
	src := testSource(64 << 10)
	for _, tc := range []struct {
		verify string
		badOp  int
		want   []string
	}{
		// The 2nd transfer of the stream falls in calibration or in the
		// first rep, depending on how fast the machine was, so only the
		// stream and the form of the message are checked. (Every stream
		// makes at least 1 + minReps transfers: a later one, such as the
		// 5th, may never come on a loaded machine, whose slow warm-up
		// leaves one transfer per rep.)
		{VerifyAll, 2, []string{"stream 2, ", ", transfer ", "differ from the source's", "CRC32C"}},
		// In VerifyLast mode a stream whose every transfer is corrupt
		// fails at the end of the warm-up.
		{VerifyLast, 0, []string{"stream 2, warm-up, transfer 1:", "differ from the source's"}},
	} {
		sess := &corruptingSession{src: src, badStream: 2, badOp: tc.badOp}
		_, err := measure(context.Background(), sess, nil, src, 3, testPlan(tc.verify))
		if err == nil {
			t.Errorf("verify %s: a corrupted transfer went undetected", tc.verify)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("verify %s: error %q lacks %q", tc.verify, err, w)
			}
		}
	}
	sess := &corruptingSession{src: src, badStream: 2}
	if _, err := measure(context.Background(), sess, nil, src, 3, testPlan(VerifyOff)); err != nil {
		t.Errorf("verify off: %v", err)
	}
}

// TestVerifyCounts checks that clean transfers pass and are counted: in
// VerifyAll mode every transfer of the case and of its ceiling.
func TestVerifyCounts(t *testing.T) {
	src := testSource(4 << 10)
	sess := &corruptingSession{src: src}
	ceil := &corruptingSession{src: src}
	tm, err := measure(context.Background(), sess, []partner{{"ceiling", ceil}}, src, 2, testPlan(VerifyAll))
	if err != nil {
		t.Fatal(err)
	}
	if tm.verified <= tm.ops {
		t.Errorf("checked %d transfers, not more than the %d timed ones of the case alone", tm.verified, tm.ops)
	}
}

// TestRunFailsOnCorruption runs a whole transfer section with a case that
// corrupts what it receives: the run fails with an error naming the case,
// the size, the payload and the stream.
func TestRunFailsOnCorruption(t *testing.T) {
	cfg := QuickConfig()
	cfg.Cases = []Case{{Name: "corrupting-memcpy", Kind: KindCeiling, About: "test",
		open: func(_ context.Context, env *caseEnv) (session, error) {
			return &corruptingSession{src: env.data, badStream: 1, badOp: 3}, nil
		}}}
	cfg.Payloads = Payloads[:1]
	cfg.Sizes, cfg.Concurrency = []int{16 << 10}, []int{2}
	cfg.Serdes, cfg.Codecs = false, false
	cfg.RepTime, cfg.Budget = time.Millisecond, 50*time.Millisecond
	var out bytes.Buffer
	_, err := Run(context.Background(), cfg, &out, nil, io.Discard)
	if err == nil {
		t.Fatal("a run with a corrupting case succeeded")
	}
	for _, want := range []string{"corrupting-memcpy at 16 KiB, gauss-f32, 2 streams: stream 1, ", ", transfer 2: the 16384 bytes received differ from the source's"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q\nlacks %q", err, want)
		}
	}
}
