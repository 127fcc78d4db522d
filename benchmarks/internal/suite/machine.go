package suite

import (
	"bufio"
	"bytes"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Machine describes where a run happened. Numbers from different machines
// are not comparable; ratios from the same run are.
type Machine struct {
	Kind       string    `json:"kind"` // "machine"
	Time       time.Time `json:"time"`
	CPUModel   string    `json:"cpu_model"`
	Cores      int       `json:"cores"`
	GOMAXPROCS int       `json:"gomaxprocs"`
	MemoryGiB  float64   `json:"memory_gib"`
	Kernel     string    `json:"kernel"`
	OS         string    `json:"os"`
	GoVersion  string    `json:"go_version"`
	// LoadBefore is the 1, 5 and 15 minute load average at the start of
	// the run; LoadAfter at its end (zero until then).
	LoadBefore [3]float64 `json:"load_before"`
	LoadAfter  [3]float64 `json:"load_after"`
	// Command is tensorbench's command line (absent from older runs).
	Command string `json:"command,omitempty"`
}

func describeMachine() Machine {
	m := Machine{
		Kind:       "machine",
		Time:       time.Now().UTC().Truncate(time.Second),
		Cores:      runtime.NumCPU(),
		GOMAXPROCS: runtime.GOMAXPROCS(0),
		OS:         runtime.GOOS + "/" + runtime.GOARCH,
		GoVersion:  runtime.Version(),
		LoadBefore: loadAverage(),
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Sysname[:]) + " " + unix.ByteSliceToString(u.Release[:])
	}
	m.CPUModel = procField("/proc/cpuinfo", "model name")
	if kb, err := strconv.ParseFloat(strings.Fields(procField("/proc/meminfo", "MemTotal") + " 0")[0], 64); err == nil {
		m.MemoryGiB = kb / (1 << 20)
	}
	return m
}

// procField returns the value of the first "name: value" line of a /proc
// file, or "".
func procField(path, name string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == name {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func loadAverage() [3]float64 {
	var l [3]float64
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return l
	}
	for i, f := range strings.Fields(string(b)) {
		if i == 3 {
			break
		}
		l[i], _ = strconv.ParseFloat(f, 64)
	}
	return l
}
