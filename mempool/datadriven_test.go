//go:build linux

package mempool

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output in testdata/*.txt")

// TestDataDriven runs the allocator traces in testdata/*.txt. Each case is a
// command, a "----" line and the expected output, ending at a blank line:
//
//	new arena=<bytes> limit=<bytes> [align=<bytes>] [release]
//	alloc <name> <bytes>    (TryAlloc; prints where the buffer went)
//	free <name>
//	layout                  (every arena's chunks, in creation order)
//	stats
//	trim
//
// Run with -rewrite to regenerate the expected output after a deliberate
// change, and review the diff.
func TestDataDriven(t *testing.T) {
	files, _ := filepath.Glob("testdata/*.txt")
	if len(files) == 0 {
		t.Fatal("no testdata")
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) { runDataDriven(t, file) })
	}
}

type traceState struct {
	p      *Pool
	arenas []*Arena // in creation order
	bufs   map[string]*Buffer
	names  map[*chunk]string
}

func runDataDriven(t *testing.T, file string) {
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	st := &traceState{bufs: map[string]*Buffer{}, names: map[*chunk]string{}}
	defer st.close(t)
	lines := strings.Split(string(data), "\n")
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			out.WriteString(line + "\n")
			continue
		}
		cmd := line
		if i+1 >= len(lines) || lines[i+1] != "----" {
			t.Fatalf("%s:%d: %q is not followed by ----", file, i+1, cmd)
		}
		i += 2
		var want []string
		for ; i < len(lines) && lines[i] != ""; i++ {
			want = append(want, lines[i])
		}
		i-- // the blank line is copied by the loop
		got := st.run(t, cmd)
		if !*rewrite && got != strings.Join(want, "\n") {
			t.Errorf("%s: %s\ngot:\n%s\nwant:\n%s", file, cmd, got, strings.Join(want, "\n"))
		}
		fmt.Fprintf(&out, "%s\n----\n%s\n", cmd, got)
	}
	if *rewrite {
		if err := os.WriteFile(file, []byte(strings.TrimRight(out.String(), "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func (st *traceState) run(t *testing.T, line string) string {
	f := strings.Fields(line)
	args := map[string]int{}
	for _, kv := range f[1:] {
		if k, v, ok := strings.Cut(kv, "="); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			args[k] = n
		}
	}
	switch f[0] {
	case "new":
		st.close(t)
		opts := []Option{WithPinning(false), WithArenaSize(args["arena"]), WithLimit(int64(args["limit"])),
			WithHook(HookFuncs{Added: func(a *Arena) error { st.arenas = append(st.arenas, a); return nil }})}
		if a, ok := args["align"]; ok {
			opts = append(opts, WithAlignment(a))
		}
		if strings.Contains(line, " release") {
			opts = append(opts, WithReleaseEmptyArenas(true))
		}
		p, err := NewPool(opts...)
		if err != nil {
			return "error: " + err.Error()
		}
		st.p = p
		return st.layout()
	case "alloc":
		n, _ := strconv.Atoi(f[2])
		b, err := st.p.TryAlloc(n)
		if err != nil {
			return "error: " + strings.TrimPrefix(err.Error(), "mempool: ")
		}
		st.p.mu.Lock()
		size := b.chunk.size
		st.p.mu.Unlock()
		st.bufs[f[1]] = b
		st.names[b.chunk] = f[1]
		return fmt.Sprintf("%s: arena %d offset %d chunk %d", f[1], st.arenaIndex(b.Arena()), b.Offset(), size)
	case "free":
		b := st.bufs[f[1]]
		delete(st.bufs, f[1])
		if b == nil {
			t.Fatalf("%q: no buffer %s", line, f[1])
		}
		delete(st.names, b.chunk)
		if err := b.Release(); err != nil {
			return "error: " + err.Error()
		}
		return st.layout()
	case "layout":
		return st.layout()
	case "stats":
		s := st.p.Stats()
		return fmt.Sprintf("in use %d, requested %d, peak %d, reserved %d, allocs %d (total %d)\nlargest free %d, free blocks %d, fragmentation %.3f, arenas %d",
			s.InUse, s.Requested, s.Peak, s.Reserved, s.Allocs, s.TotalAllocs, s.LargestFree, s.FreeBlocks, s.Fragmentation, s.Arenas)
	case "trim":
		return fmt.Sprintf("released %d\n%s", st.p.Trim(), st.layout())
	}
	t.Fatalf("unknown command %q", line)
	return ""
}

func (st *traceState) arenaIndex(a *Arena) int {
	for i, x := range st.arenas {
		if x == a {
			return i
		}
	}
	return -1
}

// layout prints each live arena's chunks as name:offset+size.
func (st *traceState) layout() string {
	st.p.mu.Lock()
	defer st.p.mu.Unlock()
	var lines []string
	for i, a := range st.arenas {
		if a.first == nil {
			continue // released
		}
		var w strings.Builder
		fmt.Fprintf(&w, "arena %d (%d):", i, len(a.mem))
		for c := a.first; c != nil; c = c.next {
			name := "free"
			if !c.free {
				name = st.names[c]
			}
			fmt.Fprintf(&w, " %s:%d+%d", name, c.off, c.size)
		}
		lines = append(lines, w.String())
	}
	if len(lines) == 0 {
		return "no arenas"
	}
	return strings.Join(lines, "\n")
}

func (st *traceState) close(t *testing.T) {
	if st.p == nil {
		return
	}
	for name, b := range st.bufs {
		delete(st.bufs, name)
		_ = b.Release()
	}
	closePool(t, st.p)
	st.p, st.arenas, st.names = nil, nil, map[*chunk]string{}
}
