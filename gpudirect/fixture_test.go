package gpudirect

import (
	"bufio"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// buildSysfs builds the tree that testdata/sysfs/<name>.txt describes (see
// testdata/sysfs/README.md) in a temporary directory and returns it.
func buildSysfs(t testing.TB, name string) string {
	t.Helper()
	root := t.TempDir()
	f, err := os.Open(filepath.Join("testdata", "sysfs", name+".txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mkdir := func(p string) {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p string, data []byte) {
		mkdir(filepath.Dir(p))
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	symlink := func(p, target string) {
		mkdir(filepath.Dir(p))
		if filepath.IsAbs(target) {
			t.Fatalf("%s: link %s -> %s: targets must be relative", name, p, target)
		}
		if err := os.Symlink(target, p); err != nil {
			t.Fatal(err)
		}
	}
	sc := bufio.NewScanner(f)
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		fields := strings.Fields(text)
		bad := func() { t.Fatalf("%s.txt:%d: bad directive %q", name, line, text) }
		if len(fields) < 2 {
			bad()
		}
		switch fields[0] {
		case "dir":
			mkdir(filepath.Join(root, fields[1]))
		case "file":
			content := ""
			if len(fields) > 2 {
				content = strings.Join(fields[2:], " ") + "\n"
			}
			write(filepath.Join(root, fields[1]), []byte(content))
		case "link":
			if len(fields) != 3 {
				bad()
			}
			symlink(filepath.Join(root, fields[1]), fields[2])
		case "pci":
			dir := filepath.Join(root, "sys/devices", fields[1])
			addr := filepath.Base(dir)
			mkdir(dir)
			for _, kv := range fields[2:] {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					bad()
				}
				switch k {
				case "vendor", "device", "class":
					write(filepath.Join(dir, k), []byte(v+"\n"))
				case "numa":
					write(filepath.Join(dir, "numa_node"), []byte(v+"\n"))
				case "driver":
					drv := filepath.Join(root, "sys/bus/pci/drivers", v)
					mkdir(drv)
					rel, err := filepath.Rel(dir, drv)
					if err != nil {
						t.Fatal(err)
					}
					symlink(filepath.Join(dir, "driver"), rel)
				default:
					bad()
				}
			}
			symlink(filepath.Join(root, "sys/bus/pci/devices", addr), filepath.Join("../../../devices", fields[1]))
		case "acs":
			if len(fields) != 3 || fields[2] != "redirect" && fields[2] != "off" {
				bad()
			}
			cfg := make([]byte, 4096)
			binary.LittleEndian.PutUint32(cfg[0x100:], pciExtCapACS|1<<16) // version 1, last capability
			binary.LittleEndian.PutUint16(cfg[0x104:], 0x001f)             // capabilities: SV, TB, RR, CR, UF
			if fields[2] == "redirect" {
				binary.LittleEndian.PutUint16(cfg[0x106:], 0x0004|0x0008) // RR, CR
			}
			write(filepath.Join(root, "sys/devices", fields[1], "config"), cfg)
		default:
			bad()
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return root
}

// discoverFixture builds a fixture tree and discovers it.
func discoverFixture(t testing.TB, name string, opts ...Option) *Topology {
	t.Helper()
	topo, err := Discover(append([]Option{WithRoot(buildSysfs(t, name))}, opts...)...)
	if err != nil {
		t.Fatalf("Discover(%s): %v", name, err)
	}
	return topo
}
