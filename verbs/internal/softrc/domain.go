package softrc

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// Domain is the state of a soft-RC protection domain that does not depend
// on its wire: its key table, completion queues, queue pairs (by id, for
// the handshake to find) and accept loops, and the checks and errors of
// the domain's verbs. A provider's domain embeds it and adds
// RegisterMemory, NewQueuePair (around NewQP) and Close (around Close).
type Domain struct {
	Name     string // the provider's ("tcp"), which begins every error
	Attrs    verbs.Attributes
	Limits   Limits
	Table    *Table
	Acceptor Acceptor

	// Mu guards the fields below, and those a provider keeps with them.
	Mu     sync.Mutex
	closed bool
	qps    map[uint64]*QP
	nextQP uint64
	cqs    map[*CQ]struct{}
}

// NewDomain makes a domain of provider name with the device attributes
// attrs. Queue pair ids follow firstID.
func NewDomain(name string, attrs verbs.Attributes, firstID uint64) *Domain {
	d := &Domain{Name: name, Attrs: attrs, Limits: LimitsOf(attrs), nextQP: firstID,
		qps: make(map[uint64]*QP), cqs: make(map[*CQ]struct{})}
	d.Table = NewTable(d)
	return d
}

// Provider returns the provider's name.
func (d *Domain) Provider() string { return d.Name }

// Attributes returns the device's attributes.
func (d *Domain) Attributes() verbs.Attributes { return d.Attrs }

// Closed reports whether Close was called.
func (d *Domain) Closed() bool {
	d.Mu.Lock()
	defer d.Mu.Unlock()
	return d.closed
}

// ClosedLocked is Closed for a caller holding Mu.
func (d *Domain) ClosedLocked() bool { return d.closed }

// Errorf is an error of the domain: "provider: " and the formatted text.
func (d *Domain) Errorf(format string, args ...any) error {
	return fmt.Errorf("%s: %w", d.Name, fmt.Errorf(format, args...))
}

// ErrClosed is the error of verb op ("register memory") on a closed
// domain.
func (d *Domain) ErrClosed(op string) error {
	return ClosedError(d.Name, op)
}

// RegisterLocked registers m in the table (see Table.Register) unless the
// domain is closed; the caller holds Mu.
func (d *Domain) RegisterLocked(m verbs.Memory, access verbs.Access, addr uint64) (*Region, error) {
	if d.closed {
		return nil, d.ErrClosed("register memory")
	}
	r, err := d.Table.Register(m, access, addr)
	if err != nil {
		return nil, d.Errorf("%w", err)
	}
	return r, nil
}

// NewCompletionQueue makes a completion queue of the domain, which it
// closes with the domain.
func (d *Domain) NewCompletionQueue(capacity int) (verbs.CompletionQueue, error) {
	var cq *CQ
	cq, err := NewCQ(d, capacity, func() {
		d.Mu.Lock()
		delete(d.cqs, cq)
		d.Mu.Unlock()
	})
	if err != nil {
		return nil, d.Errorf("%w", err)
	}
	d.Mu.Lock()
	defer d.Mu.Unlock()
	if d.closed {
		return nil, d.ErrClosed("new completion queue")
	}
	d.cqs[cq] = struct{}{}
	return cq, nil
}

// NewQP is the skeleton of NewQueuePair: the contract's checks in order
// (see Reserve, which runs check), the room in the completion queues, a
// new secret and id. Then makeWire makes the provider's queue pair around
// the core one (it may set Info, which can name the id) and returns its
// wire; takesOffers says whether the queue pair accepts data connections
// offered to it (see QP.Offer) before Connect.
func (d *Domain) NewQP(cfg verbs.QueuePairConfig, check func() error, takesOffers bool, makeWire func(*QP) Wire) (*QP, error) {
	res, err := Reserve(d.Name, d, d.Closed(), cfg, check)
	if err != nil {
		return nil, err
	}
	q := &QP{
		Domain:      d,
		Secret:      NewSecret(),
		SendCQ:      res.SendCQ,
		RecvCQ:      res.RecvCQ,
		SendQ:       NewWorkQueue(res.MaxSend),
		RecvQ:       NewWorkQueue(res.MaxRecv),
		Errored:     make(chan struct{}),
		RecvPosted:  make(chan struct{}, 1),
		incoming:    make(chan Offer, 4),
		state:       verbs.QPReset,
		accepting:   takesOffers,
		takesOffers: takesOffers,
	}
	d.Mu.Lock()
	for {
		d.nextQP++
		if d.qps[d.nextQP] == nil {
			q.ID = d.nextQP
			break
		}
	}
	d.Mu.Unlock()
	q.wire = makeWire(q)
	d.Mu.Lock()
	defer d.Mu.Unlock()
	if d.closed {
		res.Release()
		return nil, d.ErrClosed("new queue pair")
	}
	d.qps[q.ID] = q
	return q, nil
}

// Offer hands a data connection to the queue pair its hello names if it
// presents the secret that queue pair issued (compared in constant time)
// and the queue pair takes offers now.
func (d *Domain) Offer(o Offer) bool {
	h := o.Hello()
	d.Mu.Lock()
	q := d.qps[h.QPID]
	d.Mu.Unlock()
	return q != nil && q.Secret.Equal(h.Acceptor) && q.Offer(o)
}

// Admit is an accepted connection's handshake (see Acceptor): read takes
// the dialer's hello from c, within timeout, and the connection is offered
// to the queue pair it names (Offer), or closed (the offer's Close) with
// an error that says why.
func (d *Domain) Admit(c net.Conn, timeout time.Duration, read func(net.Conn) (Offer, error)) error {
	c.SetDeadline(time.Now().Add(timeout))
	o, err := read(c)
	if err != nil {
		return err
	}
	if !d.Offer(o) {
		o.Close()
		return errors.New("an unknown or used secret")
	}
	return nil
}

// QPsLocked calls f on each queue pair of the domain; the caller holds Mu.
func (d *Domain) QPsLocked(f func(*QP)) {
	for _, q := range d.qps {
		f(q)
	}
}

func (d *Domain) remove(q *QP) {
	d.Mu.Lock()
	if d.qps[q.ID] == q {
		delete(d.qps, q.ID)
	}
	d.Mu.Unlock()
}

// Close closes the accept loops, the queue pairs, then deregister (which
// deregisters the regions left) and the completion queues, and waits for
// the domain's goroutines. It is idempotent.
func (d *Domain) Close(deregister func()) error {
	d.Mu.Lock()
	if d.closed {
		d.Mu.Unlock()
		return nil
	}
	d.closed = true
	qps := make([]*QP, 0, len(d.qps))
	for _, q := range d.qps {
		qps = append(qps, q)
	}
	d.Mu.Unlock()
	d.Acceptor.Close()
	for _, q := range qps {
		q.Close()
	}
	deregister()
	d.Mu.Lock()
	cqs := make([]*CQ, 0, len(d.cqs))
	for cq := range d.cqs {
		cqs = append(cqs, cq)
	}
	d.Mu.Unlock()
	for _, cq := range cqs {
		cq.Close()
	}
	return nil
}

// DeregisterAll deregisters every region left in the table.
func (d *Domain) DeregisterAll() {
	for _, r := range d.Table.Regions() {
		d.Table.Deregister(r)
	}
}
