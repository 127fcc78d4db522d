package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/tensorrpc/tensorrpc/examples/internal/peerwatch"
	"github.com/tensorrpc/tensorrpc/rpc"
	"github.com/tensorrpc/tensorrpc/zerocopy"
)

// The launched mode: the user, or a launcher (torchrun, mpirun, a job
// scheduler, ssh), starts every rank; each knows its rank, the world size
// and rank 0's address, from flags or from the environment torchrun sets:
//
//	-rank      RANK
//	-world     WORLD_SIZE
//	-master    MASTER_ADDR:MASTER_PORT
//
// Rank 0's ring server listens on the master address and doubles as the
// job's store: the ranks exchange small uint8 tensors through its
// rendezvous, ranks > 0 with Client.Send and Client.Fetch (rpc.WaitForKey)
// over a session of their own ("rank-<r>/store", apart from the ring's, so
// that it does not count in the ring's traffic), rank 0 with Server.Publish
// and Server.Take. The keys:
//
//	job/config              rank 0: the job, which every rank checks against its own flags
//	job/addr/<r>            rank r: the address its ring server listens on
//	job/ready/<iter>/<r>    rank r > 0: ready for all-reduce iter (its data plane)
//	job/go/<iter>           rank 0: every rank is ready, start
//	job/result/<iter>/<r>   rank r > 0: its iterResult, as JSON
//	job/done                rank 0: the summary is printed ("ok" or what failed)
//	job/bye/<r>             rank r > 0: it needs rank 0's server no more
//	job/abort               a rank > 0 failed (its error): rank 0 gives up at once
//
// Rank 0 also watches the ranks' sessions with the store (watchRanks): a
// rank that put its address and then has none for a few seconds, without
// having said bye, died without a word, and rank 0 gives up.
//
// Rank 0 takes the ready, result and bye keys as they come, so the store
// holds a few keys at any time.

// launch is how a launched rank finds the others.
type launch struct {
	rank, world int
	master      string // host:port of rank 0's server and store
	listen      string // where this rank's server listens; "" for the default
}

// resolveLaunch combines the flags that were set with the environment
// (getenv): a flag wins over its variable. It returns nil, without error,
// when neither -rank nor RANK says this process is a launched rank.
func resolveLaunch(set map[string]string, getenv func(string) string) (*launch, error) {
	rankS, ok := set["rank"]
	if !ok {
		if rankS = getenv("RANK"); rankS == "" {
			return nil, nil
		}
	}
	l := &launch{listen: set["listen"]}
	var err error
	if l.rank, err = strconv.Atoi(rankS); err != nil {
		return nil, fmt.Errorf("rank %q is not a number", rankS)
	}
	worldS, ok := set["world"]
	if !ok {
		worldS = getenv("WORLD_SIZE")
	}
	if worldS == "" {
		return nil, errors.New("a launched rank needs -world or WORLD_SIZE")
	}
	if l.world, err = strconv.Atoi(worldS); err != nil {
		return nil, fmt.Errorf("world size %q is not a number", worldS)
	}
	if l.master, ok = set["master"]; !ok {
		host, port := getenv("MASTER_ADDR"), getenv("MASTER_PORT")
		if host == "" || port == "" {
			return nil, errors.New("a launched rank needs -master HOST:PORT, or MASTER_ADDR and MASTER_PORT")
		}
		l.master = net.JoinHostPort(host, port)
		if v := getenv("TORCHELASTIC_USE_AGENT_STORE"); strings.EqualFold(v, "true") || v == "1" {
			// torchrun's agent serves torch.distributed's store there.
			return nil, fmt.Errorf("torchrun's own store listens on MASTER_PORT %s (TORCHELASTIC_USE_AGENT_STORE=%s): give every rank -master %s with a port of its own",
				port, v, net.JoinHostPort(host, "PORT"))
		}
	}
	if _, _, err := net.SplitHostPort(l.master); err != nil {
		return nil, fmt.Errorf("master address %q: %v", l.master, err)
	}
	if l.rank < 0 || l.rank >= l.world {
		return nil, fmt.Errorf("rank %d is outside the world of %d", l.rank, l.world)
	}
	return l, nil
}

// runLaunched runs one launched rank. Rank 0 prints the summary to out
// and fails when the job did; the other ranks end once rank 0 has printed
// it.
func runLaunched(ctx context.Context, cfg *config, l *launch, out io.Writer) (err error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	co := &storeCoordinator{cfg: cfg, rank: l.rank, master: l.master, out: out, fail: cancel}
	defer func() {
		if c := context.Cause(ctx); err != nil && c != nil && c != ctx.Err() {
			err = c // a rank's abort, rather than what it interrupted here
		}
		if err != nil && l.rank != 0 {
			co.abort(err)
		}
		err = errors.Join(err, co.close())
	}()
	listen := l.listen
	if l.rank == 0 {
		header(out, cfg)
		if listen == "" {
			listen = l.master
		}
	} else {
		// Listen where rank 0 reaches us: on the interface this host
		// reaches rank 0 through (the rule of rpc's tcp data plane).
		local, err := localAddrTo(ctx, l.master)
		if err != nil {
			return err
		}
		co.localIP = local
		if listen == "" {
			listen = net.JoinHostPort(local, "0")
		}
	}
	return runRank(ctx, cfg, l.rank, listen, co)
}

// localAddrTo waits until master accepts TCP connections and returns the
// local address of one: the address of this host's interface toward it.
func localAddrTo(ctx context.Context, master string) (string, error) {
	for {
		d := net.Dialer{Timeout: 5 * time.Second}
		conn, err := d.DialContext(ctx, "tcp", master)
		if err == nil {
			ip := conn.LocalAddr().(*net.TCPAddr).IP.String()
			conn.Close()
			return ip, nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("rank 0 at %s: %w (last: %v)", master, ctx.Err(), err)
		case <-time.After(200 * time.Millisecond): // rank 0 is not listening yet
		}
	}
}

// storeCoordinator coordinates a launched rank through rank 0's server.
type storeCoordinator struct {
	cfg     *config
	rank    int
	master  string
	localIP string // ranks > 0: the address this host reaches master from

	// Rank 0.
	srv   *rpc.Server
	out   io.Writer
	tally *tally

	fail context.CancelCauseFunc // ends the rank's context when another rank aborts or leaves

	// Rank 0: the ranks whose job/bye it took, which may close their
	// sessions with the store.
	byeMu sync.Mutex
	bye   map[int]bool

	// Ranks > 0: the session with rank 0's store.
	client *rpc.Client
}

// watchAborts runs in rank 0: it ends the rank's context when another rank
// puts job/abort, so that rank 0 does not wait for it until -timeout.
func (s *storeCoordinator) watchAborts(ctx context.Context) {
	why, err := s.take(ctx, "job/abort")
	if err == nil {
		s.fail(errors.New(string(why)))
	}
}

// watchRanks runs in rank 0: it ends the rank's context when a rank that
// put its address has had no session with the store for peerwatch.Grace
// without saying bye, so that a rank that dies without a word (killed,
// crashed) fails the job within seconds instead of at -timeout.
func (s *storeCoordinator) watchRanks(ctx context.Context, every time.Duration) {
	ranks := make([]int, 0, s.cfg.Ranks-1)
	for r := 1; r < s.cfg.Ranks; r++ {
		ranks = append(ranks, r)
	}
	peerwatch.Watch(ctx, s.srv, every, peerwatch.Peers{
		IDs:  func() []int { return ranks },
		Name: storeName,
		// It joined once it put its address (its session may have come
		// and gone between two looks); it may go once it said bye.
		Needed: func(r int) bool { return s.has(ctx, addrKey(r)) && !s.saidBye(ctx, r) },
	}, func(r int, gone time.Duration) {
		s.fail(fmt.Errorf("rank %d left: it has had no session with rank 0's store for %v and did not say bye (the process died, or lost rank 0)", r, gone))
	})
}

// saidBye reports whether rank r said bye (it may have, before rank 0
// took the ranks' byes up to it).
func (s *storeCoordinator) saidBye(ctx context.Context, r int) bool {
	s.byeMu.Lock()
	took := s.bye[r]
	s.byeMu.Unlock()
	if took {
		return true
	}
	return s.has(ctx, byeKey(r))
}

// has reports whether the store holds key now; only rank 0 asks.
func (s *storeCoordinator) has(ctx context.Context, key string) bool {
	t, err := s.srv.Fetch(ctx, key)
	if err != nil {
		return false
	}
	t.Release()
	return true
}

// storeName is the name rank r's session with the store gives.
func storeName(r int) string { return clientName(r) + "/store" }

// abort tells rank 0, if this rank reached it, that this rank failed.
func (s *storeCoordinator) abort(err error) {
	if s.client == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.put(ctx, "job/abort", []byte(fmt.Sprintf("rank %d failed: %v", s.rank, err)))
}

func readyKey(iter, r int) string  { return fmt.Sprintf("job/ready/%d/%d", iter, r) }
func goKey(iter int) string        { return fmt.Sprintf("job/go/%d", iter) }
func resultKey(iter, r int) string { return fmt.Sprintf("job/result/%d/%d", iter, r) }
func addrKey(r int) string         { return fmt.Sprintf("job/addr/%d", r) }
func byeKey(r int) string          { return fmt.Sprintf("job/bye/%d", r) }

// put stores val under key.
func (s *storeCoordinator) put(ctx context.Context, key string, val []byte) error {
	zt, err := zerocopy.FromSlice(val)
	if err != nil {
		return err
	}
	if s.rank == 0 {
		err = s.srv.Publish(ctx, key, rpc.WrapTensor(zt))
	} else {
		err = s.client.Send(ctx, key, rpc.WrapTensor(zt))
	}
	if err != nil {
		return fmt.Errorf("putting store key %s: %w", key, err)
	}
	return nil
}

// get returns what key holds, waiting until some rank puts it.
func (s *storeCoordinator) get(ctx context.Context, key string) ([]byte, error) {
	var t *rpc.Tensor
	var err error
	if s.rank == 0 {
		t, err = s.srv.Fetch(ctx, key, rpc.WaitForKey())
	} else {
		t, err = s.client.Fetch(ctx, key, rpc.WaitForKey())
	}
	if err != nil {
		return nil, fmt.Errorf("store key %s: %w", key, err)
	}
	defer t.Release()
	return slices.Clone(t.Bytes()), nil
}

// take is get that also removes key; only rank 0, the store, takes.
func (s *storeCoordinator) take(ctx context.Context, key string) ([]byte, error) {
	t, err := s.srv.Take(ctx, key, rpc.WaitForKey())
	if err != nil {
		return nil, fmt.Errorf("store key %s: %w", key, err)
	}
	defer t.Release()
	return slices.Clone(t.Bytes()), nil
}

// jobConfig is what the ranks must agree on.
type jobConfig struct{ Ranks, Elements, Iters int }

func (s *storeCoordinator) connect(ctx context.Context, srv *rpc.Server, addr string) (string, error) {
	job, _ := json.Marshal(jobConfig{s.cfg.Ranks, s.cfg.Elements, s.cfg.Iters})
	p := s.cfg.Ranks
	if s.rank == 0 {
		s.srv = srv
		s.bye = map[int]bool{}
		go s.watchAborts(ctx)
		go s.watchRanks(ctx, 250*time.Millisecond)
		if err := s.put(ctx, "job/config", job); err != nil {
			return "", err
		}
		// The others reach rank 0 at the master address, whatever it
		// listens on.
		if err := s.put(ctx, addrKey(0), []byte(s.master)); err != nil {
			return "", err
		}
	} else {
		dctx, cancel := context.WithTimeout(ctx, connectTimeout)
		var err error
		s.client, err = rpc.Dial(dctx, s.master, rpc.WithTransportCredentials(insecure.NewCredentials()),
			rpc.WithTransports(s.cfg.Transports...), rpc.WithName(storeName(s.rank)))
		cancel()
		if err != nil {
			return "", fmt.Errorf("dialing rank 0's store at %s: %w", s.master, err)
		}
		theirs, err := s.get(ctx, "job/config")
		if err != nil {
			return "", err
		}
		if string(theirs) != string(job) {
			return "", fmt.Errorf("rank 0 runs the job %s, this rank %s: give every rank the same -n and -iters, and the world size", theirs, job)
		}
		// A listener on every interface is reached at this host's
		// address toward rank 0.
		if host, port, err := net.SplitHostPort(addr); err == nil && net.ParseIP(host) != nil && net.ParseIP(host).IsUnspecified() {
			addr = net.JoinHostPort(s.localIP, port)
		}
		if err := s.put(ctx, addrKey(s.rank), []byte(addr)); err != nil {
			return "", err
		}
	}
	right, err := s.get(ctx, addrKey((s.rank+1)%p))
	return string(right), err
}

func (s *storeCoordinator) begin(ctx context.Context, iter int, plane string) (bool, error) {
	if iter > s.cfg.Iters {
		return false, nil
	}
	if s.rank != 0 {
		if err := s.put(ctx, readyKey(iter, s.rank), []byte(plane)); err != nil {
			return false, err
		}
		_, err := s.get(ctx, goKey(iter))
		return err == nil, err
	}
	planes := []string{plane}
	for r := 1; r < s.cfg.Ranks; r++ {
		p, err := s.take(ctx, readyKey(iter, r))
		if err != nil {
			return false, err
		}
		planes = append(planes, string(p))
	}
	if iter == 0 {
		s.tally = newTally(s.cfg, s.out, planes)
	}
	if err := s.put(ctx, goKey(iter), []byte("go")); err != nil {
		return false, err
	}
	// Every rank said it is ready for iter, so has seen the previous go.
	s.srv.Unpublish(goKey(iter - 1))
	return true, nil
}

func (s *storeCoordinator) report(ctx context.Context, res iterResult) error {
	if s.rank != 0 {
		b, err := json.Marshal(res)
		if err != nil {
			return err
		}
		return s.put(ctx, resultKey(res.Iter, s.rank), b)
	}
	results := []iterResult{res}
	for r := 1; r < s.cfg.Ranks; r++ {
		b, err := s.take(ctx, resultKey(res.Iter, r))
		if err != nil {
			return err
		}
		var other iterResult
		if err := json.Unmarshal(b, &other); err != nil {
			return fmt.Errorf("rank %d: unexpected result %q", r, b)
		}
		results = append(results, other)
	}
	return s.tally.add(res.Iter, results)
}

func (s *storeCoordinator) end(ctx context.Context) error {
	if s.rank != 0 {
		if _, err := s.get(ctx, "job/done"); err != nil {
			return err
		}
		return s.put(ctx, byeKey(s.rank), []byte("bye"))
	}
	_, failed := s.tally.finish()
	done := "ok"
	if failed != nil {
		done = failed.Error()
	}
	if err := s.put(ctx, "job/done", []byte(done)); err != nil {
		return errors.Join(failed, err)
	}
	// Keep the store up until every rank has seen job/done.
	for r := 1; r < s.cfg.Ranks; r++ {
		if _, err := s.take(ctx, byeKey(r)); err != nil {
			return errors.Join(failed, err)
		}
		s.byeMu.Lock()
		s.bye[r] = true
		s.byeMu.Unlock()
	}
	return failed
}

// close ends a rank's session with the store.
func (s *storeCoordinator) close() error {
	if s.client == nil {
		return nil
	}
	return s.client.Close()
}
