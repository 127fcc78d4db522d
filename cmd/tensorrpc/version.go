package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/tensorrpc/tensorrpc/rpc"
)

// Version is what `tensorrpc version` prints and doctor's JSON carries.
type Version struct {
	Module    string `json:"module"`   // the module's version: a tag, a pseudo-version, or "(devel)" for a checkout
	Commit    string `json:"commit"`   // VCS revision the binary was built from, "" when unknown
	Modified  bool   `json:"modified"` // the working tree had uncommitted changes
	Time      string `json:"commit_time,omitempty"`
	Tags      string `json:"build_tags"` // -tags, "" for none
	CGO       bool   `json:"cgo"`
	GoVersion string `json:"go_version"`
	Protocol  uint32 `json:"protocol_version"` // the session protocol this build speaks
}

func buildVersion() Version {
	v := Version{Module: "(devel)", GoVersion: runtime.Version(), Protocol: rpc.ProtocolVersion}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return v
	}
	if bi.Main.Version != "" {
		v.Module = bi.Main.Version
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Commit = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		case "vcs.time":
			v.Time = s.Value
		case "-tags":
			v.Tags = s.Value
		case "CGO_ENABLED":
			v.CGO = s.Value == "1"
		}
	}
	return v
}

func (v Version) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "tensorrpc %s", v.Module)
	if v.Commit != "" {
		c := v.Commit
		if len(c) > 12 {
			c = c[:12]
		}
		fmt.Fprintf(&b, ", commit %s", c)
		if v.Modified {
			b.WriteString(" (modified)")
		}
		if v.Time != "" {
			fmt.Fprintf(&b, " of %s", v.Time)
		}
	}
	tags := v.Tags
	if tags == "" {
		tags = "none"
	}
	fmt.Fprintf(&b, "\nbuild tags: %s; cgo: %t; %s %s/%s; session protocol %d\n", tags, v.CGO, v.GoVersion, runtime.GOOS, runtime.GOARCH, v.Protocol)
	return b.String()
}

func versionMain(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		fmt.Fprintf(stderr, "tensorrpc version: unexpected arguments %q\nusage: tensorrpc version\n", args)
		return 2
	}
	fmt.Fprint(stdout, buildVersion())
	return 0
}
