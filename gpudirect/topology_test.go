package gpudirect

import (
	"slices"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

func TestDiscoverSwitch(t *testing.T) {
	topo := discoverFixture(t, "switch")
	if len(topo.Notes) != 0 {
		t.Errorf("notes: %q", topo.Notes)
	}
	if got := len(topo.PCI); got != 23 {
		t.Errorf("%d PCI devices, want 23", got)
	}
	gpu := topo.PCI["0000:03:00.0"]
	if gpu == nil || !gpu.IsGPU() || gpu.Vendor != VendorNVIDIA || gpu.Device != 0x2330 || gpu.Class != 0x030200 ||
		gpu.NUMANode != 0 || gpu.Driver != "nvidia" || gpu.HostBridge != "pci0000:00" {
		t.Fatalf("GPU0: %+v", gpu)
	}
	if want := []string{"0000:02:00.0", "0000:01:00.0", "0000:00:01.0"}; !slices.Equal(gpu.Upstream, want) {
		t.Errorf("GPU0 upstream %q, want %q", gpu.Upstream, want)
	}
	if b := topo.PCI["0000:01:00.0"]; !b.IsBridge() || b.IsGPU() {
		t.Errorf("switch port: %+v", b)
	}
	var gpus []string
	for _, g := range topo.GPUs {
		gpus = append(gpus, g.Address)
	}
	if want := []string{"0000:03:00.0", "0000:08:00.0", "0000:0b:00.0"}; !slices.Equal(gpus, want) {
		t.Errorf("GPUs %q, want %q (two NVIDIA 3D controllers and the ASPEED VGA)", gpus, want)
	}
	want := []RDMADevice{{"mlx5_0", "0000:04:00.0", 0}, {"mlx5_1", "0000:09:00.0", 0}, {"rxe0", "", -1}}
	if !slices.Equal(topo.RDMA, want) {
		t.Errorf("RDMA %+v, want %+v", topo.RDMA, want)
	}
	wantP2P := []P2PProvider{
		{PCIAddress: "0000:05:00.0", Size: 64 << 20, Available: 48 << 20, Published: true},
		{PCIAddress: "0000:0a:00.0", Size: 128 << 20, Available: 128 << 20, Published: false},
		{PCIAddress: "0000:0c:00.0", Size: 64 << 20, Available: 32 << 20, Published: true},
		{PCIAddress: "0000:0d:00.0", Size: 16 << 20, Available: 16 << 20, Published: true},
	}
	if !slices.Equal(topo.P2PMem, wantP2P) {
		t.Errorf("p2pmem %+v,\nwant %+v", topo.P2PMem, wantP2P)
	}
	if pub := topo.PublishedP2PMem(); len(pub) != 3 {
		t.Errorf("published: %+v", pub)
	}
	if pm := topo.Peermem; !pm.Loaded || pm.Source != "nvidia_peermem" || pm.Version != "550.54.15" {
		t.Errorf("peermem %+v", pm)
	}
	if topo.DMABuf.Supported || !strings.Contains(topo.DMABuf.Detail, "ibv") {
		t.Errorf("dma-buf by default: %+v", topo.DMABuf)
	}
	for _, c := range topo.Capabilities() {
		if !c.Available && c.Name != "dma-buf" {
			t.Errorf("capability %s", c)
		}
	}
}

func TestDiscoverTwoSocket(t *testing.T) {
	topo := discoverFixture(t, "twosocket", WithDMABuf(func() (bool, string) { return true, "ibv_reg_dmabuf_mr works" }))
	if pm := topo.Peermem; !pm.Loaded || pm.Source != "memory_peers/nv_mem" || pm.Version != "1.3-0" {
		t.Errorf("peermem %+v", pm)
	}
	if !topo.DMABuf.Supported || topo.DMABuf.Detail != "ibv_reg_dmabuf_mr works" {
		t.Errorf("dma-buf %+v", topo.DMABuf)
	}
	if n, _ := topo.RDMADevice("mlx5_1"); n.NUMANode != 1 || n.PCIAddress != "0000:81:00.0" {
		t.Errorf("mlx5_1 %+v", n)
	}
	if hb := topo.PCI["0000:41:00.0"].HostBridge; hb != "pci0000:40" {
		t.Errorf("mlx5_0's host bridge %q", hb)
	}
}

func TestDiscoverACS(t *testing.T) {
	topo := discoverFixture(t, "acs")
	for addr, want := range map[string]bool{"0000:05:00.0": false, "0000:06:00.0": true, "0000:06:01.0": true} {
		if d := topo.PCI[addr]; !d.ACSKnown || d.ACSRedirect != want {
			t.Errorf("%s: ACS known %v redirect %v, want known, redirect %v", addr, d.ACSKnown, d.ACSRedirect, want)
		}
	}
	if d := topo.PCI["0000:01:00.0"]; d.ACSKnown {
		t.Errorf("ACS known without config space: %+v", d)
	}
	if g := topo.PCI["0000:03:00.0"]; !g.IsGPU() || g.Class != 0x030000 || g.NUMANode != -1 {
		t.Errorf("GeForce: %+v", g)
	}
	if topo.Peermem.Loaded || !strings.Contains(topo.Peermem.Detail, "nvidia_peermem is not loaded") {
		t.Errorf("peermem %+v", topo.Peermem)
	}
	odd := topo.PCI["0000:ff:00.0"]
	if odd == nil || odd.HostBridge != "" {
		t.Fatalf("plain bus directory: %+v", odd)
	}
	if len(topo.Notes) != 1 || !strings.Contains(topo.Notes[0], "0000:ff:00.0") {
		t.Errorf("notes %q", topo.Notes)
	}
}

func TestRoutes(t *testing.T) {
	switchTopo := discoverFixture(t, "switch")
	twoSocket := discoverFixture(t, "twosocket")
	acs := discoverFixture(t, "acs")
	for _, tc := range []struct {
		topo       *Topology
		a, b       string
		class      Class
		distance   int
		bridge     string
		acsOnRoute string
	}{
		{switchTopo, "0000:03:00.0", "0000:03:00.0", ClassPIX, 0, "0000:03:00.0", ""},
		{switchTopo, "0000:03:00.0", "0000:04:00.0", ClassPIX, 4, "0000:01:00.0", ""},
		{switchTopo, "0000:04:00.0", "0000:03:00.0", ClassPIX, 4, "0000:01:00.0", ""},
		{switchTopo, "0000:08:00.0", "0000:04:00.0", ClassPXB, 6, "0000:01:00.0", ""},
		{switchTopo, "0000:08:00.0", "0000:0d:00.0", ClassPIX, 4, "0000:06:00.0", ""},
		{switchTopo, "0000:03:00.0", "0000:09:00.0", ClassPHB, 6, "", ""},
		{twoSocket, "0000:01:00.0", "0000:41:00.0", ClassPHB, 4, "", ""},
		{twoSocket, "0000:01:00.0", "0000:81:00.0", ClassSYS, 4, "", ""},
		{twoSocket, "0000:82:00.0", "0000:81:00.0", ClassPHB, 4, "", ""},
		{acs, "0000:07:00.0", "0000:08:00.0", ClassPHB, 4, "0000:05:00.0", "0000:06:00.0"},
		{acs, "0000:03:00.0", "0000:04:00.0", ClassPIX, 4, "0000:01:00.0", ""},
		{acs, "0000:03:00.0", "0000:81:00.0", ClassSYS, 6, "", ""},
		{acs, "0000:03:00.0", "0000:ff:00.0", ClassUnknown, -1, "", ""},
	} {
		r, err := tc.topo.Route(tc.a, tc.b)
		if err != nil {
			t.Errorf("Route(%s, %s): %v", tc.a, tc.b, err)
			continue
		}
		if r.Class != tc.class || r.Distance != tc.distance || r.Bridge != tc.bridge || r.ACSRedirect != tc.acsOnRoute || r.Detail == "" {
			t.Errorf("Route(%s, %s) = %+v, want %s distance %d bridge %q ACS %q", tc.a, tc.b, r, tc.class, tc.distance, tc.bridge, tc.acsOnRoute)
		}
	}
	if _, err := switchTopo.Route("0000:03:00.0", "0000:99:00.0"); err == nil {
		t.Error("Route to a missing device succeeded")
	}
}

// TestDecisions is the table of fixture decisions: for each pairing of
// device memory and NIC, the path, the class and the words the reason must
// hold.
func TestDecisions(t *testing.T) {
	dmabuf := WithDMABuf(func() (bool, string) { return true, "the ibv provider registers DMA-BUFs" })
	for _, tc := range []struct {
		name        string
		tree        string
		opts        []Option
		device, nic string
		path        Path
		class       Class
		mech        Mechanism
		pickedNIC   string
		reason      string
	}{
		{"GPU and NIC under one switch", "switch", nil, "0000:03:00.0", "mlx5_0", Direct, ClassPIX, MechanismPeermem, "mlx5_0", "PIX, distance 4"},
		{"closest NIC is picked", "switch", nil, "0000:03:00.0", "", Direct, ClassPIX, MechanismPeermem, "mlx5_0", "direct via nvidia-peermem"},
		{"GPU behind nested switches", "switch", nil, "0000:08:00.0", "mlx5_0", Direct, ClassPXB, MechanismPeermem, "mlx5_0", "PXB, distance 6"},
		{"across the host bridge, default policy", "switch", nil, "0000:03:00.0", "mlx5_1", Staged, ClassPHB, MechanismPeermem, "mlx5_1", "WithHostBridgeP2P"},
		{"across the host bridge, allowed", "switch", []Option{WithHostBridgeP2P(true)}, "0000:03:00.0", "mlx5_1", Direct, ClassPHB, MechanismPeermem, "mlx5_1", "PHB"},
		{"p2pmem published, same switch", "switch", nil, "0000:05:00.0", "mlx5_0", Direct, ClassPIX, MechanismP2PMem, "mlx5_0", "direct via p2pmem"},
		{"p2pmem not published", "switch", nil, "0000:0a:00.0", "mlx5_0", Staged, ClassUnknown, MechanismNone, "", "not published"},
		{"VGA of another vendor", "switch", nil, "0000:0b:00.0", "mlx5_0", Staged, ClassUnknown, MechanismNone, "", "vendor 1a03"},
		{"software RDMA device", "switch", nil, "0000:03:00.0", "rxe0", Staged, ClassUnknown, MechanismNone, "rxe0", "software RDMA device"},
		{"missing NIC", "switch", nil, "0000:03:00.0", "mlx5_9", Staged, ClassUnknown, MechanismNone, "", "no RDMA device mlx5_9"},
		{"not device memory", "switch", nil, "0000:04:00.0", "mlx5_0", Staged, ClassUnknown, MechanismNone, "", "neither a GPU nor a p2pmem provider"},
		{"across NUMA nodes", "twosocket", []Option{WithHostBridgeP2P(true)}, "0000:01:00.0", "mlx5_1", Staged, ClassSYS, MechanismPeermem, "mlx5_1", "never used"},
		{"root complexes of one node, default policy", "twosocket", nil, "0000:01:00.0", "mlx5_0", Staged, ClassPHB, MechanismPeermem, "mlx5_0", "NUMA node 0"},
		{"root complexes of one node, allowed", "twosocket", []Option{WithHostBridgeP2P(true)}, "0000:01:00.0", "", Direct, ClassPHB, MechanismPeermem, "mlx5_0", "direct via nvidia-peermem"},
		{"p2pmem across NUMA nodes", "twosocket", []Option{WithHostBridgeP2P(true)}, "0000:82:00.0", "mlx5_0", Staged, ClassSYS, MechanismP2PMem, "mlx5_0", "SYS"},
		{"nvidia_peermem absent", "acs", nil, "0000:03:00.0", "mlx5_0", Staged, ClassUnknown, MechanismNone, "", "nvidia_peermem is not loaded"},
		{"nvidia_peermem absent, dma-buf supported", "acs", []Option{dmabuf}, "0000:03:00.0", "", Direct, ClassPIX, MechanismDMABuf, "mlx5_0", "direct via dma-buf"},
		{"ACS redirect", "acs", nil, "0000:07:00.0", "mlx5_1", Staged, ClassPHB, MechanismP2PMem, "mlx5_1", "ACS on 0000:06:00.0"},
		{"ACS redirect, host bridge allowed", "acs", []Option{WithHostBridgeP2P(true)}, "0000:07:00.0", "mlx5_1", Direct, ClassPHB, MechanismP2PMem, "mlx5_1", "redirects"},
		{"root complexes with unknown NUMA nodes", "acs", []Option{dmabuf, WithHostBridgeP2P(true)}, "0000:03:00.0", "mlx5_2", Staged, ClassSYS, MechanismDMABuf, "mlx5_2", "unknown"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			topo := discoverFixture(t, tc.tree, tc.opts...)
			d := topo.Decide(tc.device, tc.nic)
			if d.Path != tc.path || d.Route.Class != tc.class || d.Mechanism != tc.mech || d.NIC != tc.pickedNIC || d.Device != tc.device {
				t.Errorf("Decide(%s, %q) = %+v\nwant %s, %s, mechanism %q, NIC %q", tc.device, tc.nic, d, tc.path, tc.class, tc.mech, tc.pickedNIC)
			}
			if !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("reason %q lacks %q", d.Reason, tc.reason)
			}
			if d.Path == Staged && !strings.HasSuffix(d.Reason, "using host staging") {
				t.Errorf("staged reason %q does not say it uses host staging", d.Reason)
			}
			t.Logf("%s %s: %s: %s", tc.device, tc.nic, d.Path, d.Reason)
		})
	}
}

func TestPairs(t *testing.T) {
	topo := discoverFixture(t, "switch")
	pairs := topo.Pairs()
	// 3 GPUs and 4 p2pmem providers, each with mlx5_0 and mlx5_1.
	if len(pairs) != 14 {
		t.Fatalf("%d pairs, want 14", len(pairs))
	}
	direct := 0
	for _, p := range pairs {
		if p.Path == Direct {
			direct++
		}
	}
	// GPU0, GPU1 and the three published drives with mlx5_0.
	if direct != 5 {
		t.Errorf("%d direct pairs, want 5: %+v", direct, pairs)
	}
}

func TestDiscoverMissingRoot(t *testing.T) {
	if _, err := Discover(WithRoot("/nonexistent/sysfs/root")); err == nil {
		t.Error("Discover of a missing root succeeded")
	}
	topo, err := Discover(WithRoot(t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	caps := topo.Capabilities()
	if len(caps) != 5 {
		t.Fatalf("%d capabilities", len(caps))
	}
	for _, c := range caps {
		if c.Available || !strings.Contains(c.String(), "unavailable, using host staging: ") {
			t.Errorf("empty root: %s", c)
		}
	}
	if d := topo.Decide("0000:03:00.0", ""); d.Path != Staged || !strings.Contains(d.Reason, "no PCI device") {
		t.Errorf("empty root: %+v", d)
	}
}
