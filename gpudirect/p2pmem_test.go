package gpudirect

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/tensorrpc/tensorrpc/verbs"
)

func TestFindP2PMem(t *testing.T) {
	topo := discoverFixture(t, "switch")
	allowPHB := discoverFixture(t, "switch", WithHostBridgeP2P(true))
	for _, tc := range []struct {
		topo    *Topology
		clients []string
		want    string // "" for none
		reason  string
	}{
		// 0000:05:00.0 and 0000:0c:00.0 are both 4 from mlx5_0: the one
		// with more available memory wins.
		{topo, []string{"mlx5_0"}, "0000:05:00.0", ""},
		{topo, []string{"mlx5_0", "0000:03:00.0"}, "0000:05:00.0", ""},
		// Distance first: 0000:0d:00.0 shares GPU1's nested switch.
		{topo, []string{"0000:08:00.0"}, "0000:0d:00.0", ""},
		// From mlx5_0 and GPU1 every published drive totals 10 (05 and 0c:
		// 4 + 6, 0d: 6 + 4): available memory breaks the tie.
		{topo, []string{"mlx5_0", "0000:08:00.0"}, "0000:05:00.0", ""},
		{topo, []string{"mlx5_1"}, "", "WithHostBridgeP2P is off"},
		{allowPHB, []string{"mlx5_1"}, "0000:05:00.0", ""},
		{topo, []string{"rxe0"}, "", "software RDMA device"},
		{topo, []string{"mlx5_7"}, "", "no PCI device or RDMA device"},
	} {
		p, err := tc.topo.FindP2PMem(tc.clients...)
		switch {
		case tc.want != "" && (err != nil || p.PCIAddress != tc.want):
			t.Errorf("FindP2PMem(%q) = %+v, %v; want %s", tc.clients, p, err, tc.want)
		case tc.want == "" && (err == nil || !strings.Contains(err.Error(), tc.reason)):
			t.Errorf("FindP2PMem(%q) = %+v, %v; want an error saying %q", tc.clients, p, err, tc.reason)
		}
	}
	_, err := topo.FindP2PMem("mlx5_1")
	if !errors.Is(err, ErrNotDirect) || !strings.Contains(err.Error(), "0000:0a:00.0 is not published") {
		t.Errorf("too far: %v", err)
	}
	t.Logf("mlx5_1: %v", err)

	two := discoverFixture(t, "twosocket", WithHostBridgeP2P(true))
	if _, err := two.FindP2PMem("mlx5_0"); !errors.Is(err, ErrNotDirect) || !strings.Contains(err.Error(), "SYS") {
		t.Errorf("across NUMA nodes: %v", err)
	}
	if p, err := two.FindP2PMem("mlx5_1"); err != nil || p.PCIAddress != "0000:82:00.0" {
		t.Errorf("same root complex, PHB allowed: %+v, %v", p, err)
	}
	if _, err := topo.FindP2PMem(); err == nil {
		t.Error("FindP2PMem() without clients succeeded")
	}
}

// sizeAllocateFile stands in for the kernel: it makes the fixture's
// p2pmem/allocate file a regular file of size bytes, so that it can be
// mapped.
func sizeAllocateFile(t *testing.T, topo *Topology, addr string, size int64) {
	t.Helper()
	path := filepath.Join(topo.Root, "sys/bus/pci/devices", addr, "p2pmem/allocate")
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
}

func TestMapP2PMem(t *testing.T) {
	topo := discoverFixture(t, "switch")
	if _, err := topo.MapP2PMem("0000:0a:00.0", 4096); !errors.Is(err, ErrNotDirect) || !strings.Contains(err.Error(), "not published") {
		t.Errorf("unpublished: %v", err)
	}
	if _, err := topo.MapP2PMem("0000:03:00.0", 4096); err == nil || !strings.Contains(err.Error(), "offers no p2pmem") {
		t.Errorf("GPU as a provider: %v", err)
	}
	if _, err := topo.MapP2PMem("0000:0d:00.0", 17<<20); err == nil || !strings.Contains(err.Error(), "available") {
		t.Errorf("more than available: %v", err)
	}
	// An empty regular file: mapping it would raise SIGBUS on first touch.
	if _, err := topo.MapP2PMem("0000:05:00.0", 4096); err == nil || !strings.Contains(err.Error(), "fewer than") {
		t.Errorf("empty allocate file: %v", err)
	}
	sizeAllocateFile(t, topo, "0000:05:00.0", 1<<20)
	a, err := topo.MapP2PMem("0000:05:00.0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if a.Len() != 1<<20 || a.Provider() != "0000:05:00.0" {
		t.Errorf("arena %d bytes of %s", a.Len(), a.Provider())
	}
	copy(a.Bytes(), "through the mapping")
	if m := a.Memory(); m.HasFD || len(m.Bytes) != 1<<20 {
		t.Errorf("Memory() = HasFD %v, %d bytes", m.HasFD, len(m.Bytes))
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("second Close: %v", err)
	}
	// The mapping was shared: the bytes reached the file.
	got, err := os.ReadFile(filepath.Join(topo.Root, "sys/bus/pci/devices/0000:05:00.0/p2pmem/allocate"))
	if err != nil || !bytes.HasPrefix(got, []byte("through the mapping")) {
		t.Errorf("file after unmap: %q..., %v", got[:20], err)
	}
}

// recordingPD is a protection domain that records registrations.
type recordingPD struct {
	registered []verbs.Memory
}

type recordedRegion struct{ m verbs.Memory }

func (pd *recordingPD) Provider() string { return "ibv" }
func (pd *recordingPD) RegisterMemory(m verbs.Memory, access verbs.Access) (verbs.MemoryRegion, error) {
	pd.registered = append(pd.registered, m)
	return recordedRegion{m}, nil
}
func (pd *recordingPD) NewCompletionQueue(int) (verbs.CompletionQueue, error) {
	return nil, verbs.ErrUnsupported
}
func (pd *recordingPD) NewQueuePair(verbs.QueuePairConfig) (verbs.QueuePair, error) {
	return nil, verbs.ErrUnsupported
}
func (pd *recordingPD) Close() error                 { return nil }
func (pd *recordingPD) Attributes() verbs.Attributes { return verbs.Attributes{} }

func (r recordedRegion) Addr() uint64         { return 0 }
func (r recordedRegion) Len() int             { return len(r.m.Bytes) }
func (r recordedRegion) Bytes() []byte        { return r.m.Bytes }
func (r recordedRegion) LocalKey() uint32     { return 1 }
func (r recordedRegion) RemoteKey() uint32    { return 1 }
func (r recordedRegion) Access() verbs.Access { return verbs.AccessRemoteRead }
func (r recordedRegion) Deregister() error    { return nil }

func TestRegisterP2PMem(t *testing.T) {
	topo := discoverFixture(t, "switch")
	sizeAllocateFile(t, topo, "0000:05:00.0", 1<<20)
	a, err := topo.MapP2PMem("0000:05:00.0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	pd := &recordingPD{}
	access := verbs.AccessLocalWrite | verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	mr, err := RegisterP2PMem(pd, a, "mlx5_0", access)
	if err != nil {
		t.Fatalf("same switch: %v", err)
	}
	if len(pd.registered) != 1 || &pd.registered[0].Bytes[0] != &a.Bytes()[0] || mr.Len() != a.Len() {
		t.Errorf("registered %d regions", len(pd.registered))
	}
	for nic, reason := range map[string]string{
		"mlx5_1": "WithHostBridgeP2P", // through the host bridge
		"rxe0":   "software RDMA device",
		"":       "needs the RDMA device",
	} {
		if _, err := RegisterP2PMem(pd, a, nic, access); err == nil || !strings.Contains(err.Error(), reason) {
			t.Errorf("RegisterP2PMem through %q: %v, want %q", nic, err, reason)
		}
	}
	if len(pd.registered) != 1 {
		t.Errorf("refused registrations reached the domain: %d", len(pd.registered))
	}
}

func TestP2PAllocator(t *testing.T) {
	topo := discoverFixture(t, "switch")
	sizeAllocateFile(t, topo, "0000:05:00.0", 1<<20)
	p, err := NewP2PAllocator(topo, "0000:05:00.0", 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	var _ Allocator = p
	if p.Name() != "p2pmem:0000:05:00.0" {
		t.Errorf("Name %q", p.Name())
	}
	b1, err := p.Alloc(1000)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := p.Alloc(3000)
	if err != nil {
		t.Fatal(err)
	}
	if b1.Device() != "p2pmem:0000:05:00.0" || b1.Len() != 1000 {
		t.Errorf("buffer %s, %d bytes", b1.Device(), b1.Len())
	}
	if pm := b1.(PCIMemory); pm.PCIAddress() != "0000:05:00.0" || pm.Mechanism() != MechanismP2PMem {
		t.Errorf("PCIMemory %s %s", pm.PCIAddress(), pm.Mechanism())
	}
	msg := []byte("peer-to-peer")
	if err := b2.CopyFromHost(msg, 100); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if err := b2.CopyToHost(got, 100); err != nil || !bytes.Equal(got, msg) {
		t.Errorf("read back %q, %v", got, err)
	}
	if err := b2.CopyToHost(got, 2990); err == nil {
		t.Error("copy past the end succeeded")
	}
	m, ok := b2.Direct()
	arena := p.Arena().Bytes()
	if !ok || len(m.Bytes) != 3000 || m.HasFD || !bytes.Equal(m.Bytes[100:112], msg) {
		t.Errorf("Direct() = %d bytes, %v", len(m.Bytes), ok)
	}
	if off := int(uintptrOf(m.Bytes) - uintptrOf(arena)); off != 1024 {
		t.Errorf("second buffer at arena offset %d, want 1024 (1000 rounded up to 256)", off)
	}

	d := Plan(b2, "ibv", topo)
	if d.Path != Direct || d.NIC != "mlx5_0" || d.Mechanism != MechanismP2PMem {
		t.Errorf("Plan(p2pmem buffer, ibv) = %+v", d)
	}
	if d := Plan(b2, "ibv:mlx5_1", topo); d.Path != Staged {
		t.Errorf("Plan(p2pmem buffer, ibv:mlx5_1) = %+v", d)
	}
	if d := Plan(b2, "shm", topo); d.Path != Staged || !strings.Contains(d.Reason, "shm data plane") {
		t.Errorf("Plan(p2pmem buffer, shm) = %+v", d)
	}
	if d := Plan(b2, "mlx5_0", topo); d.Path != Staged || !strings.Contains(d.Reason, "unknown data plane") {
		t.Errorf("Plan(p2pmem buffer, mlx5_0) = %+v", d)
	}

	if _, err := p.Alloc(64 << 10); !errors.Is(err, ErrExhausted) {
		t.Errorf("Alloc beyond the arena: %v", err)
	}
	if err := p.Close(); !errors.Is(err, ErrOutstanding) {
		t.Errorf("Close with buffers: %v", err)
	}
	for _, b := range []DeviceBuffer{b1, b2} {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if err := b1.Free(); !errors.Is(err, ErrFreed) {
		t.Errorf("double Free: %v", err)
	}
	if _, ok := b1.Direct(); ok {
		t.Error("Direct after Free")
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Alloc(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Close: %v", err)
	}
}

// uintptrOf is the address of a slice's first byte, for offset checks.
func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
