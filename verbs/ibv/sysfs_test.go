package ibv

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tensorrpc/tensorrpc/verbs"
)

// writeTree creates files under root; a value of "" with a name ending in
// "/" makes an empty directory.
func writeTree(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for name, content := range files {
		path := filepath.Join(root, name)
		if strings.HasSuffix(name, "/") {
			if err := os.MkdirAll(path, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestExplainNoDevices(t *testing.T) {
	cases := []struct {
		name  string
		files map[string]string
		want  string
	}{
		{"no class", map[string]string{"class/net/": ""}, "infiniband does not exist (kernel without RDMA support or no rdma driver loaded)"},
		{"empty class", map[string]string{"class/infiniband/": ""}, "infiniband is empty"},
		{"no uverbs", map[string]string{"class/infiniband/mlx5_0/": ""}, "RDMA devices mlx5_0 exist but"},
		{"no provider library", map[string]string{"class/infiniband/rxe0/": "", "class/infiniband_verbs/uverbs0/": ""},
			"libibverbs found no devices although"},
	}
	for _, c := range cases {
		root := t.TempDir()
		writeTree(t, root, c.files)
		err := explainNoDevices(root, errors.New("function not implemented"))
		if !errors.Is(err, verbs.ErrNoDevice) {
			t.Errorf("%s: %v does not wrap verbs.ErrNoDevice", c.name, err)
		}
		if !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "function not implemented") {
			t.Errorf("%s: %q, want it to contain %q and the libibverbs error", c.name, err, c.want)
		}
	}
}

func TestSelectGID(t *testing.T) {
	const port = "class/infiniband/mlx5_0/ports/1/"
	link := "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
	v4 := "0000:0000:0000:0000:0000:ffff:c0a8:0107"
	v6 := "fd00:0000:0000:0000:0202:c9ff:fe00:0001"
	zero := "0000:0000:0000:0000:0000:0000:0000:0000"
	cases := []struct {
		name  string
		files map[string]string
		index int
		want  string
	}{
		{"IPv4-mapped RoCE v2 preferred", map[string]string{
			port + "gids/0": link, port + "gid_attrs/types/0": "IB/RoCE v1\n",
			port + "gids/1": link, port + "gid_attrs/types/1": "RoCE v2\n",
			port + "gids/2": v4, port + "gid_attrs/types/2": "IB/RoCE v1\n",
			port + "gids/3": v4, port + "gid_attrs/types/3": "RoCE v2\n",
		}, 3, "IPv4 192.168.1.7"},
		{"numeric order", map[string]string{
			port + "gids/10": v4, port + "gid_attrs/types/10": "RoCE v2\n",
			port + "gids/9": v4, port + "gid_attrs/types/9": "RoCE v2\n",
		}, 9, "RoCE v2"},
		{"RoCE v2 without IPv4", map[string]string{
			port + "gids/0": link, port + "gid_attrs/types/0": "IB/RoCE v1\n",
			port + "gids/1": v6, port + "gid_attrs/types/1": "RoCE v2\n",
		}, 1, "IPv6"},
		{"empty entries skipped", map[string]string{
			port + "gids/0": zero, port + "gid_attrs/types/0": "RoCE v2\n",
			port + "gids/1": v4, // no type: the kernel fails the read
			port + "gids/2": "garbage", port + "gid_attrs/types/2": "RoCE v2\n",
		}, 0, "no RoCE v2 GID"},
		{"no sysfs", map[string]string{}, 0, "cannot list GIDs"},
	}
	for _, c := range cases {
		root := t.TempDir()
		writeTree(t, root, c.files)
		got := selectGID(root, "mlx5_0", 1)
		if got.index != c.index || !strings.Contains(got.reason, c.want) {
			t.Errorf("%s: selectGID = %+v, want index %d and a reason containing %q", c.name, got, c.index, c.want)
		}
	}
}

func TestParseGID(t *testing.T) {
	gid, ok := parseGID("fe80:0000:0000:0000:0202:c9ff:fe00:0001")
	want := [16]byte{0xfe, 0x80, 8: 0x02, 9: 0x02, 10: 0xc9, 11: 0xff, 12: 0xfe, 13: 0x00, 14: 0x00, 15: 0x01}
	if !ok || gid != want {
		t.Fatalf("parseGID = %x, %v; want %x", gid, ok, want)
	}
	for _, bad := range []string{"", "fe80::1", "fe80:0000:0000:0000:0202:c9ff:fe00", "fe80:0000:0000:0000:0202:c9ff:fe00:000g", "fe80:0000:0000:0000:0202:c9ff:fe00:00001"} {
		if _, ok := parseGID(bad); ok {
			t.Errorf("parseGID(%q) accepted", bad)
		}
	}
}

func TestOptions(t *testing.T) {
	o := defaultOptions()
	for _, opt := range []Option{WithDevice("mlx5_1"), WithPort(2), WithGIDIndex(3), WithMTU(1024),
		WithTrafficClass(106), WithRetry(9, 5), WithTimeout(40), WithRNRTimer(99), WithMaxInline(-1), withSysfs("/x")} {
		opt(&o)
	}
	want := options{device: "mlx5_1", port: 2, gidIndex: 3, mtu: 1024, trafficClass: 106, hopLimit: 64,
		timeout: 31, retryCount: 7, rnrRetry: 5, minRNRTimer: 31, maxInline: 0, sysfs: "/x"}
	if o != want {
		t.Fatalf("options = %+v, want %+v", o, want)
	}
}
