// Command tensorrpc is tensorrpc's command-line tool.
//
//	tensorrpc doctor [-json]
//	tensorrpc version
//	tensorrpc soak [flags]
//
// doctor reports what this host offers tensorrpc: RDMA devices, the
// memlock limit and whether memory can be pinned, huge pages, shared
// memory, which data planes connect on loopback, GPUDirect and p2pmem.
// For each thing that is unavailable it says why and what to do. It is a
// report: it exits 0 whatever it finds, and 2 only on usage errors. It also
// prints this binary's version and the environment variables tensorrpc
// reads, with their values.
//
// version prints the module version, commit, build tags, cgo and the Go
// version of this binary.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
)

func main() { os.Exit(runMain(os.Args[1:], os.Stdout, os.Stderr)) }

const usageText = `usage: tensorrpc <command> [flags]

commands:
  doctor [-json]   report what this host can use, and why not
                   (-explain: how a 4 KiB, 1 MiB and 64 MiB Fetch moves on each data plane)
  soak [flags]     move verified tensors over loopback for a while (-h for flags)
  version          print the module version, commit, build tags and Go version
`

// runMain runs the command line args and returns the exit status.
func runMain(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usageText)
		return 2
	}
	switch args[0] {
	case "doctor":
		return doctorMain(args[1:], stdout, stderr)
	case "soak":
		return soakMain(args[1:], stdout, stderr)
	case "version", "-version", "--version":
		return versionMain(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usageText)
		return 0
	}
	fmt.Fprintf(stderr, "tensorrpc: unknown command %q\n%s", args[0], usageText)
	return 2
}

func doctorMain(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("tensorrpc doctor", flag.ContinueOnError)
	fs.SetOutput(stderr)
	asJSON := fs.Bool("json", false, "print the report as JSON")
	explain := fs.Bool("explain", false, "instead of the checks: fetch 4 KiB, 1 MiB and 64 MiB over each data plane of a loopback server and print how each moved (path, lanes, copies)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: tensorrpc doctor [-json] [-explain]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "tensorrpc doctor: unexpected arguments %q\n", fs.Args())
		fs.Usage()
		return 2
	}
	if *explain {
		es, err := explainPaths(context.Background())
		if err == nil {
			if *asJSON {
				enc := json.NewEncoder(stdout)
				enc.SetIndent("", "  ")
				err = enc.Encode(es)
			} else {
				err = writeExplained(stdout, es)
			}
		}
		if err != nil {
			fmt.Fprintln(stderr, "tensorrpc doctor -explain:", err)
			return 1
		}
		return 0
	}
	rep := diagnose(defaultHost())
	var err error
	if *asJSON {
		err = rep.writeJSON(stdout)
	} else {
		err = rep.writeText(stdout)
	}
	if err != nil {
		fmt.Fprintln(stderr, "tensorrpc doctor:", err)
		return 1
	}
	return 0
}
