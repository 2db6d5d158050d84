package agent

import (
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/xdpagg/xdpagg/internal/bpftest"
)

// The agent turns IPv4 forwarding on at its ports for its run (source validation asks the
// forwarding table) and puts the old setting back afterwards; ports that had it on stay on.
func TestEnableForwarding(t *testing.T) {
	bpftest.InNewNetns(t)
	for _, n := range []string{"xf-a", "xf-b"} {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: n}, PeerName: n + "p"}); err != nil {
			t.Fatal(err)
		}
	}
	read := func(name string) string {
		t.Helper()
		b, err := os.ReadFile("/proc/sys/net/ipv4/conf/" + name + "/forwarding")
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	write := func(name, v string) {
		t.Helper()
		if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+name+"/forwarding", []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("xf-a", "0")
	write("xf-b", "1")
	var links []netlink.Link
	for _, n := range []string{"xf-a", "xf-b"} {
		l, err := netlink.LinkByName(n)
		if err != nil {
			t.Fatal(err)
		}
		links = append(links, l)
	}
	restore, err := enableForwarding(links, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if a, b := read("xf-a"), read("xf-b"); a != "1" || b != "1" {
		t.Errorf("forwarding during the run: %s, %s; want 1, 1", a, b)
	}
	restore()
	if a, b := read("xf-a"), read("xf-b"); a != "0" || b != "1" {
		t.Errorf("forwarding after the run: %s, %s; want 0 (restored), 1 (untouched)", a, b)
	}
}
