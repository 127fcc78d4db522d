package tcp_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/tensorrpc/tensorrpc/internal/leakcheck"
	"github.com/tensorrpc/tensorrpc/verbs"
	"github.com/tensorrpc/tensorrpc/verbs/tcp"
)

// childEnv carries the child's address on the veth pair to TestNetnsChild.
const childEnv = "TENSORRPC_TCP_NETNS_CHILD"

const netnsPayload = 1 << 20

func netnsPattern() []byte {
	b := make([]byte, netnsPayload)
	for i := range b {
		b[i] = byte(i*7 + i>>9)
	}
	return b
}

// TestAcrossNetworkNamespaces connects a queue pair in this process to one
// in a child process inside another network namespace, over a veth pair:
// the two ends share no loopback, as on two hosts. The connection info
// travels over the child's stdin and stdout, standing in for the control
// plane. The child uses the default options and only sets LocalAddress, as
// package rpc does, to its veth address. It runs twice: once the parent
// dials the child (RoleDial), so the child's data plane must listen on and
// advertise its LocalAddress, and once the child dials the parent
// (RoleAccept), which listens where WithListenAddress says.
func TestAcrossNetworkNamespaces(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		t.Skip("running as the namespace child")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs the ip command (iproute2) to create network namespaces")
	}
	defer leakcheck.Check(t)
	id := os.Getpid() % 100000
	ns := fmt.Sprintf("trpctcp%d", id)
	hostIf, nsIf := fmt.Sprintf("trpa%d", id), fmt.Sprintf("trpb%d", id)
	subnet := fmt.Sprintf("10.201.%d", id%250)
	ip := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := ip("netns", "add", ns); err != nil {
		t.Skipf("cannot create a network namespace here: %v", err)
	}
	defer ip("netns", "del", ns)
	for _, args := range [][]string{
		{"link", "add", hostIf, "type", "veth", "peer", "name", nsIf},
		{"link", "set", nsIf, "netns", ns},
		{"addr", "add", subnet + ".1/24", "dev", hostIf},
		{"link", "set", hostIf, "up"},
		{"netns", "exec", ns, "ip", "addr", "add", subnet + ".2/24", "dev", nsIf},
		{"netns", "exec", ns, "ip", "link", "set", nsIf, "up"},
	} {
		if err := ip(args...); err != nil {
			ip("link", "del", hostIf)
			t.Skipf("cannot set up a veth pair: %v", err)
		}
	}
	defer ip("link", "del", hostIf)

	for _, role := range []verbs.ConnectRole{verbs.RoleDial, verbs.RoleAccept} {
		t.Run("parent-"+role.String(), func(t *testing.T) {
			defer leakcheck.Check(t)
			netnsPair(t, ns, subnet, role)
		})
	}
}

// netnsPair connects a queue pair of the given role in this process to a
// child's in the namespace ns, then writes and sends to it.
func netnsPair(t *testing.T, ns, subnet string, role verbs.ConnectRole) {
	pd, err := tcp.New(tcp.WithListenAddress(subnet + ".1:0")).Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	cq, _ := pd.NewCompletionQueue(64)
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 16, MaxRecv: 16, Role: role})
	if err != nil {
		t.Fatal(err)
	}
	src, _ := pd.RegisterMemory(verbs.Memory{Bytes: netnsPattern()}, verbs.AccessLocalWrite)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns, os.Args[0], "-test.run", "^TestNetnsChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"="+subnet+".2")
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	lines := bufio.NewScanner(stdout)
	next := func(prefix string) string {
		for lines.Scan() {
			if rest, ok := strings.CutPrefix(lines.Text(), prefix); ok {
				return rest
			}
		}
		t.Fatalf("the child ended before saying %q", prefix)
		return ""
	}
	info, err := hex.DecodeString(next("INFO "))
	if err != nil {
		t.Fatal(err)
	}
	if want := []byte(subnet + ".2:"); !bytes.Contains(info, want) {
		t.Fatalf("the child's info %x does not advertise its LocalAddress %s", info, want)
	}
	var addr uint64
	var key uint32
	fmt.Sscanf(next("REGION "), "%d %d", &addr, &key)
	fmt.Fprintf(stdin, "INFO %x\n", qp.LocalInfo())
	if err := qp.Connect(ctx, info); err != nil {
		t.Fatalf("connecting across namespaces: %v", err)
	}
	if err := qp.PostSend(
		verbs.SendRequest{ID: 1, Op: verbs.OpWrite, Local: verbs.Local{Region: src, Length: netnsPayload}, Remote: verbs.Remote{Addr: addr, Key: key}},
		verbs.SendRequest{ID: 2, Op: verbs.OpSend, Local: verbs.Local{Region: src, Length: 8}},
	); err != nil {
		t.Fatal(err)
	}
	out := make([]verbs.Completion, 2)
	for got := 0; got < 2; {
		n, err := cq.Wait(ctx, out)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range out[:n] {
			if err := verbs.CompletionError(c); err != nil {
				t.Fatal(err)
			}
		}
		got += n
	}
	if verdict := next("RESULT "); verdict != "ok" {
		t.Fatalf("the child saw: %s", verdict)
	}
	qp.Close()
}

// TestNetnsChild is the other end of TestAcrossNetworkNamespaces, run in
// the namespace; it does nothing in a normal test run.
func TestNetnsChild(t *testing.T) {
	local := os.Getenv(childEnv)
	if local == "" {
		t.Skip("helper process of TestAcrossNetworkNamespaces")
	}
	fail := func(format string, args ...any) {
		fmt.Printf("RESULT "+format+"\n", args...)
		t.Fatalf(format, args...)
	}
	addr, err := netip.ParseAddr(local)
	if err != nil {
		fail("%s=%q: %v", childEnv, local, err)
	}
	pd, err := tcp.New().Open("")
	if err != nil {
		fail("open: %v", err)
	}
	defer pd.Close()
	cq, _ := pd.NewCompletionQueue(64)
	qp, err := pd.NewQueuePair(verbs.QueuePairConfig{SendCQ: cq, RecvCQ: cq, MaxSend: 16, MaxRecv: 16, LocalAddress: addr})
	if err != nil {
		fail("queue pair: %v", err)
	}
	dst, _ := pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, netnsPayload)}, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	msg, _ := pd.RegisterMemory(verbs.Memory{Bytes: make([]byte, 64)}, verbs.AccessLocalWrite)
	if err := qp.PostRecv(verbs.RecvRequest{ID: 1, Local: verbs.Local{Region: msg, Length: 64}}); err != nil {
		fail("post receive: %v", err)
	}
	fmt.Printf("INFO %x\nREGION %d %d\n", qp.LocalInfo(), dst.Addr(), dst.RemoteKey())
	in := bufio.NewScanner(os.Stdin)
	var peer []byte
	for in.Scan() {
		if rest, ok := strings.CutPrefix(in.Text(), "INFO "); ok {
			peer, _ = hex.DecodeString(rest)
			break
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := qp.Connect(ctx, peer); err != nil {
		fail("connect: %v", err)
	}
	out := make([]verbs.Completion, 1)
	if n, err := cq.Wait(ctx, out); err != nil || n != 1 || out[0].Status != verbs.StatusSuccess || out[0].Len != 8 {
		fail("receive: %v %v", out[:n], err)
	}
	if !bytes.Equal(dst.Bytes(), netnsPattern()) {
		fail("the written region differs from the pattern")
	}
	fmt.Println("RESULT ok")
	io.Copy(io.Discard, os.Stdin) // the parent closes stdin when done
	qp.Close()
}
