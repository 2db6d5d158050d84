package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/internal/bpftest"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// jobSwitch is a switch pinned as <root>/sw inside a fresh network namespace, where lo (up) is a
// switch port (in the ports devmap) and a veth xd0 with 10.77.0.1/24 is not.
func jobSwitch(t *testing.T, pool uint32) (*loader.Switch, string) {
	t.Helper()
	return jobSwitchConfig(t, loader.Config{PoolSize: pool})
}

// jobSwitchConfig is jobSwitch for a switch of any configuration.
func jobSwitchConfig(t *testing.T, cfg loader.Config) (*loader.Switch, string) {
	t.Helper()
	bpftest.InNewNetns(t)
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "xd0"}, PeerName: "xd0p"}); err != nil {
		t.Fatalf("add veth: %v", err)
	}
	for _, name := range []string{"xd0", "xd0p"} {
		l, err := netlink.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if name == "xd0" {
			addr, _ := netlink.ParseAddr("10.77.0.1/24")
			if err := netlink.AddrAdd(l, addr); err != nil {
				t.Fatal(err)
			}
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	sw, root := pinnedSwitchConfig(t, "sw", cfg)
	if err := sw.Maps.Ports.Put(uint32(lo.Attrs().Index), &bpf.XdpaggBpfDevmapVal{Ifindex: uint32(lo.Attrs().Index)}); err != nil {
		t.Fatalf("make lo a switch port: %v", err)
	}
	return sw, root
}

// jobCmd runs `xdpagg job args...` against the switch pinned under root.
func jobCmd(root string, args ...string) (string, error) {
	var out bytes.Buffer
	args = append([]string{args[0], "--pin-root", root, "--name", "sw"}, args[1:]...)
	err := runJob(args, &out)
	return out.String(), err
}

func TestJobFlags(t *testing.T) {
	run := func(args []string, out *bytes.Buffer) error { return runJob(args, out) }
	root := filepath.Join(t.TempDir(), "none") // flags are checked before the switch is opened
	add := func(args ...string) []string {
		return append([]string{"add", "--pin-root", root}, args...)
	}
	checkUsage(t, run, []usageCase{
		{nil, "xdpagg job add|list|rm"},
		{[]string{"start"}, `unknown job command "start"`},
		{add("--workers", "2", "--ps", "10.0.0.1"), "--id 0: use 1..4294967295"},
		{add("--id", "4294967296", "--workers", "2", "--ps", "10.0.0.1"), "--id 4294967296"},
		{add("--id", "-1", "--workers", "2", "--ps", "10.0.0.1"), "invalid value"},
		{add("--id", "1", "--ps", "10.0.0.1"), "--workers 0: use 1..32"},
		{add("--id", "1", "--workers", "33", "--ps", "10.0.0.1"), "--workers 33: use 1..32"},
		{add("--id", "1", "--workers", "2"), "--ps is required"},
		{add("--id", "1", "--workers", "2", "--ps", "fd00::1"), `--ps "fd00::1": want IPv4[:port]`},
		{add("--id", "1", "--workers", "2", "--ps", "[fd00::1]:9510"), "want IPv4[:port]"},
		{add("--id", "1", "--workers", "2", "--ps", "10.0.0.1:0"), "want IPv4[:port]"},
		{add("--id", "1", "--workers", "2", "--ps", "10.0.0.1:65536"), "want IPv4[:port]"},
		{add("--id", "1", "--workers", "2", "--ps", "ps.example"), "want IPv4[:port]"},
		{add("--id", "1", "--workers", "2", "--ps", "10.0.0.1", "extra"), `unexpected argument "extra"`},
		{add("--id", "1", "--workers", "2", "--ps", "10.0.0.1", "--reg-arrays", "257"), "--reg-arrays 257: use 0 (a dense job) or 1..256"},
		{add("--id", "1", "--workers", "2", "--ps", "10.0.0.1", "--reg-arrays", "-1"), "invalid value"},
		{add("--id", "1", "--workers", "2", "--ps", "10.0.0.1", "--threshold", "3"), "--threshold 3: use 0 (synchronous) or 1..--workers (2)"},
		{add("--id", "1", "--workers", "2", "--ps", "10.0.0.1", "--threshold", "1", "--reg-arrays", "4"), "a sparse job (--reg-arrays) takes none"},
		{[]string{"rm", "--pin-root", root}, "--id 0"},
		{[]string{"rm", "--pin-root", root, "--id", "4294967296"}, "--id 4294967296"},
		{[]string{"list", "--pin-root", root, "--json=maybe"}, "invalid boolean value"},
		{[]string{"list", "--pin-root", root, "extra"}, `unexpected argument "extra"`},
	})
	for _, sub := range []string{"add", "list", "rm"} {
		if err := runJob([]string{sub, "-h"}, &bytes.Buffer{}); !errors.Is(err, flag.ErrHelp) {
			t.Errorf("job %s -h = %v, want flag.ErrHelp (exit 0)", sub, err)
		}
	}
	var out bytes.Buffer
	if err := runJob([]string{"help"}, &out); err != nil || !strings.Contains(out.String(), "add   admit a job") {
		t.Errorf("job help = %v, %q", err, out.String())
	}
}

func TestParsePS(t *testing.T) {
	for in, want := range map[string]string{
		"10.0.5.2":       "10.0.5.2:9510",
		"10.0.5.2:9511":  "10.0.5.2:9511",
		" 10.0.5.2:1":    "",
		"10.0.5.2:65535": "10.0.5.2:65535",
		"::ffff:1.2.3.4": "",
		"":               "",
	} {
		got, err := parsePS(in)
		if want == "" {
			if !errors.Is(err, errUsage) {
				t.Errorf("parsePS(%q) = %v, %v; want a usage error", in, got, err)
			}
			continue
		}
		if err != nil || got != netip.MustParseAddrPort(want) {
			t.Errorf("parsePS(%q) = %v, %v; want %s", in, got, err, want)
		}
	}
}

func TestJobNoSwitch(t *testing.T) {
	root := filepath.Join(t.TempDir(), "missing")
	for _, args := range [][]string{
		{"add", "--id", "1", "--workers", "2", "--ps", "10.0.0.1"},
		{"list"},
		{"rm", "--id", "1"},
	} {
		out, err := jobCmd(root, args...)
		if !errors.Is(err, maps.ErrNoSwitch) || errors.Is(err, errUsage) {
			t.Errorf("job %s on a missing switch = %v, want ErrNoSwitch (not a usage error)", args[0], err)
		}
		if err != nil && !strings.Contains(err.Error(), "xdpagg switch --name sw") {
			t.Errorf("error %q does not say how to start the switch", err)
		}
		if out != "" {
			t.Errorf("job %s on a missing switch printed %q", args[0], out)
		}
	}
}

// job add admits a job with a fresh key, printed once; list shows it; the key opens the job's
// control messages (it is the one in the switch's maps).
func TestJobAdd(t *testing.T) {
	const pool = 600
	sw, root := jobSwitch(t, pool)
	out, err := jobCmd(root, "add", "--id", "7", "--workers", "3", "--ps", "127.0.0.5:9600")
	if err != nil {
		t.Fatalf("job add: %+v", err)
	}
	want := "job 7 admitted: 3 workers, PS 127.0.0.5:9600 (switch port ifindex 1), at most 150 slots\n"
	if !strings.HasPrefix(out, want) {
		t.Errorf("job add printed %q, want it to start with %q", out, want)
	}
	line, ok := strings.CutPrefix(strings.TrimPrefix(out, want), "key ")
	if !ok {
		t.Fatalf("job add printed no key line: %q", out)
	}
	key, err := ctlauth.ParseKey(line)
	if err != nil {
		t.Fatalf("printed key %q: %v", line, err)
	}
	if k, err := sw.Maps.JobKey(7); err != nil || !bytes.Equal(k, key) {
		t.Errorf("switch holds key %x (%v), job add printed %x", k, err, key)
	}
	j, err := sw.Maps.GetJob(7)
	wantJob := maps.Job{JobID: 7, PS: netip.MustParseAddrPort("127.0.0.5:9600"), PSIfindex: 1, Workers: 3, MaxSlots: maps.DefaultMaxSlots(pool)}
	if err != nil || j != wantJob {
		t.Errorf("admitted job = %+v, %v; want %+v", j, err, wantJob)
	}

	// --json, --ps without a port (the default port), --ps-iface, --max-slots.
	out, err = jobCmd(root, "add", "--id", "4294967295", "--workers", "32", "--ps", "127.0.0.6", "--ps-iface", "lo", "--max-slots", "600", "--json")
	if err != nil {
		t.Fatalf("job add --json: %+v", err)
	}
	var got struct {
		Job       *uint32 `json:"job"`
		PS        *string `json:"ps"`
		PSIfindex *uint32 `json:"ps_ifindex"`
		Workers   *uint8  `json:"workers"`
		MaxSlots  *uint32 `json:"max_slots"`
		Key       *string `json:"key"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("job add --json printed %q: %v", out, err)
	}
	if got.Job == nil || *got.Job != 4294967295 || got.PS == nil || *got.PS != "127.0.0.6:9510" || got.PSIfindex == nil || *got.PSIfindex != 1 ||
		got.Workers == nil || *got.Workers != 32 || got.MaxSlots == nil || *got.MaxSlots != pool || got.Key == nil {
		t.Errorf("job add --json = %s", out)
	} else if k, err := sw.Maps.JobKey(4294967295); err != nil || ctlauth.FormatKey(k) != *got.Key {
		t.Errorf("--json key %s, switch holds %x (%v)", *got.Key, k, err)
	}

	// A second admission of an id fails and changes nothing.
	out, err = jobCmd(root, "add", "--id", "7", "--workers", "2", "--ps", "127.0.0.9")
	if !errors.Is(err, maps.ErrJobExists) {
		t.Errorf("second job add --id 7 = %v, want ErrJobExists", err)
	}
	if out != "" {
		t.Errorf("refused job add printed %q", out)
	}
	if j, _ := sw.Maps.GetJob(7); j != wantJob {
		t.Errorf("job 7 after a refused re-admission = %+v, want %+v", j, wantJob)
	}
	if k, _ := sw.Maps.JobKey(7); !bytes.Equal(k, key) {
		t.Error("a refused re-admission changed the job's key")
	}

	// The quota cannot exceed the pool.
	if _, err := jobCmd(root, "add", "--id", "8", "--workers", "2", "--ps", "127.0.0.9", "--max-slots", "601"); !errors.Is(err, errUsage) ||
		!strings.Contains(err.Error(), "--max-slots 601: the pool has 600 slots") {
		t.Errorf("job add --max-slots 601 = %v, want a usage error", err)
	}
	if _, err := sw.Maps.GetJob(8); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("refused job 8 admitted: %v", err)
	}

	// list: both jobs, by id.
	out, err = jobCmd(root, "list", "--json")
	if err != nil {
		t.Fatalf("job list --json: %v", err)
	}
	var jobs []maps.Job
	if err := json.Unmarshal([]byte(out), &jobs); err != nil {
		t.Fatalf("job list --json printed %q: %v", out, err)
	}
	if len(jobs) != 2 || jobs[0] != wantJob || jobs[1].JobID != 4294967295 {
		t.Errorf("job list --json = %+v", jobs)
	}
}

// The PS must be behind one of the switch's ports, named or found through the routes.
func TestJobAddPSPort(t *testing.T) {
	sw, root := jobSwitch(t, 16)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--ps", "10.77.0.5"}, "the PS 10.77.0.5 is behind ifindex"},
		{[]string{"--ps", "10.77.0.5", "--ps-iface", "xd0"}, "which is not a port of this switch (ports [1])"},
		{[]string{"--ps", "127.0.0.5", "--ps-iface", "xd0"}, "not a port of this switch"},
		{[]string{"--ps", "127.0.0.5", "--ps-iface", "nosuch0"}, `--ps-iface "nosuch0"`},
		{[]string{"--ps", "10.99.0.1"}, "no route to the PS 10.99.0.1 here: name its switch port with --ps-iface"},
	} {
		out, err := jobCmd(root, append([]string{"add", "--id", "3", "--workers", "2"}, tc.args...)...)
		if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("job add %v = %v, want a usage error saying %q", tc.args, err, tc.want)
		}
		if out != "" {
			t.Errorf("refused job add printed %q", out)
		}
	}
	if js, err := sw.Maps.ListJobs(); err != nil || len(js) != 0 {
		t.Errorf("refused admissions admitted %+v, %v", js, err)
	}
	// psPort itself: lo is the switch port, xd0 is not.
	xd, err := net.InterfaceByName("xd0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := psPort(sw.Maps, netip.MustParseAddr("10.77.0.9"), ""); !errors.Is(err, errUsage) ||
		!strings.Contains(err.Error(), "ifindex "+strconv.Itoa(xd.Index)) {
		t.Errorf("psPort(behind xd0) = %v, want a usage error naming ifindex %d", err, xd.Index)
	}
	if idx, err := psPort(sw.Maps, netip.MustParseAddr("127.0.0.9"), ""); err != nil || idx != 1 {
		t.Errorf("psPort(behind lo) = %d, %v; want 1", idx, err)
	}
	if idx, err := psPort(sw.Maps, netip.MustParseAddr("10.77.0.9"), "lo"); err != nil || idx != 1 {
		t.Errorf("psPort(--ps-iface lo) = %d, %v; want 1", idx, err)
	}
}

// --key-file: the key goes to a file of mode 0600 (even one that existed with other modes), not
// to stdout; a refused admission leaves an existing file alone.
func TestJobAddKeyFile(t *testing.T) {
	sw, root := jobSwitch(t, 16)
	dir := t.TempDir()
	kf := filepath.Join(dir, "job5.key")
	out, err := jobCmd(root, "add", "--id", "5", "--workers", "2", "--ps", "127.0.0.5", "--key-file", kf)
	if err != nil {
		t.Fatalf("job add --key-file: %+v", err)
	}
	if !strings.Contains(out, "key written to "+kf) || strings.Contains(out, "key 0") {
		t.Errorf("job add --key-file printed %q", out)
	}
	checkKeyFile := func(what string, id uint32) []byte {
		t.Helper()
		fi, err := os.Stat(kf)
		if err != nil {
			t.Fatalf("%s: key file: %v", what, err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: key file mode %v, want 0600", what, fi.Mode().Perm())
		}
		b, err := os.ReadFile(kf)
		if err != nil {
			t.Fatal(err)
		}
		key, err := ctlauth.ParseKey(string(b))
		if err != nil {
			t.Fatalf("%s: key file %q: %v", what, b, err)
		}
		if !strings.HasSuffix(string(b), "\n") {
			t.Errorf("%s: key file %q does not end in a newline", what, b)
		}
		if k, err := sw.Maps.JobKey(id); err != nil || !bytes.Equal(k, key) {
			t.Errorf("%s: key file holds %x, the switch %x (%v)", what, key, k, err)
		}
		return key
	}
	key := checkKeyFile("first admission", 5)

	// The same command again: refused, and the running job's key file is left as it was.
	if _, err := jobCmd(root, "add", "--id", "5", "--workers", "2", "--ps", "127.0.0.5", "--key-file", kf); !errors.Is(err, maps.ErrJobExists) {
		t.Fatalf("second job add --id 5 = %v, want ErrJobExists", err)
	}
	if got := checkKeyFile("refused re-admission", 5); !bytes.Equal(got, key) {
		t.Error("a refused re-admission rewrote the key file")
	}

	// A file that exists with a wider mode is replaced by one of mode 0600.
	if err := os.WriteFile(kf, []byte("old\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(kf, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = jobCmd(root, "add", "--id", "6", "--workers", "2", "--ps", "127.0.0.5", "--key-file", kf, "--json")
	if err != nil {
		t.Fatalf("job add --key-file over an existing file: %+v", err)
	}
	checkKeyFile("existing file", 6)
	if strings.Contains(out, `"key"`) {
		t.Errorf("job add --json --key-file printed the key: %s", out)
	}
	// Nothing else is left in the directory (no temporary files).
	if es, _ := os.ReadDir(dir); len(es) != 1 {
		t.Errorf("key file directory holds %v, want only the key file", es)
	}

	// A key file that cannot be written: no admission.
	if _, err := jobCmd(root, "add", "--id", "9", "--workers", "2", "--ps", "127.0.0.5", "--key-file", filepath.Join(dir, "no", "such", "dir")); err == nil {
		t.Error("job add with an unwritable key file succeeded")
	}
	if _, err := sw.Maps.GetJob(9); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("job admitted without its key file: %v", err)
	}
}

// job list shows the slots a job holds; job rm frees them, drops members and key, and a second rm
// is a usage error.
func TestJobListRm(t *testing.T) {
	sw, root := jobSwitch(t, 600)
	for id, h := range map[string]string{"11": "0", "12": "1"} {
		if _, err := jobCmd(root, "add", "--id", id, "--workers", "2", "--ps", "127.0.0.5", "--max-slots", "300", "--threshold", h); err != nil {
			t.Fatalf("job add --id %s: %+v", id, err)
		}
	}
	m := sw.Maps
	mb := maps.Member{JobID: 11, WorkerID: 1, Ifindex: 1, Addr: netip.MustParseAddrPort("127.0.0.7:4000"),
		MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, PortMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}}
	if err := m.PutMember(mb); err != nil {
		t.Fatal(err)
	}
	// Slots of job 11 across the collector's batches, and one of job 12; held as the datapath
	// counts them.
	for _, idx := range []uint32{0, 255, 256, 599} {
		s := bpf.XdpaggSlot{JobId: 11, Seq: idx, State: uint8(bpf.XdpaggSlotStateSLOT_AGGREGATING), FanIn: 2, Nvals: 1, TsNs: ^uint64(0) >> 1}
		if err := m.Slots.Put(idx, &s); err != nil {
			t.Fatal(err)
		}
	}
	s := bpf.XdpaggSlot{JobId: 12, Seq: 1, State: uint8(bpf.XdpaggSlotStateSLOT_COMPLETE), FanIn: 2, Nvals: 1, TsNs: ^uint64(0) >> 1}
	if err := m.Slots.Put(uint32(1), &s); err != nil {
		t.Fatal(err)
	}
	for id, held := range map[uint32]int32{11: 4, 12: 1} {
		var v bpf.XdpaggJob
		if err := m.Jobs.Lookup(id, &v); err != nil {
			t.Fatal(err)
		}
		v.Held = held
		if err := m.Jobs.Put(id, &v); err != nil {
			t.Fatal(err)
		}
	}

	out, err := jobCmd(root, "list")
	if err != nil {
		t.Fatalf("job list: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "SLOTS HELD") || !strings.Contains(lines[0], "JOINED") {
		t.Fatalf("job list printed %q, want a header and two jobs", out)
	}
	if !strings.Contains(lines[0], "SPARSE") {
		t.Errorf("job list header %q has no SPARSE column", lines[0])
	}
	for i, want := range [][]string{{"11", "127.0.0.5:9510", "1", "2", "sync", "0x2", "4", "300", "-"}, {"12", "127.0.0.5:9510", "1", "2", "1", "0x0", "1", "300", "-"}} {
		if f := strings.Fields(lines[i+1]); !slicesEqual(f, want) {
			t.Errorf("job list row %d = %q, want %q", i, f, want)
		}
	}
	out, err = jobCmd(root, "list", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var jobs []maps.Job
	if err := json.Unmarshal([]byte(out), &jobs); err != nil || len(jobs) != 2 || jobs[0].Held != 4 || jobs[0].Joined != 1<<1 {
		t.Errorf("job list --json = %s (%v)", out, err)
	}

	out, err = jobCmd(root, "rm", "--id", "11")
	if err != nil {
		t.Fatalf("job rm: %+v", err)
	}
	if out != "job 11 removed; 4 slots freed\n" {
		t.Errorf("job rm printed %q", out)
	}
	used, err := m.SlotsInUse()
	if err != nil || len(used) != 1 || used[0].JobID != 12 {
		t.Errorf("slots in use after job rm: %+v, %v; want job 12's only", used, err)
	}
	if ms, _ := m.ListMembers(); len(ms) != 0 {
		t.Errorf("members after job rm: %+v", ms)
	}
	if _, err := m.JobKey(11); !errors.Is(err, maps.ErrNoJob) {
		t.Errorf("key after job rm: %v", err)
	}
	// Again: a usage error naming the job, nothing printed.
	out, err = jobCmd(root, "rm", "--id", "11")
	if !errors.Is(err, errUsage) || !errors.Is(err, maps.ErrNoJob) || !strings.Contains(err.Error(), "job 11") {
		t.Errorf("second job rm = %v, want a usage error wrapping ErrNoJob", err)
	}
	if out != "" {
		t.Errorf("second job rm printed %q", out)
	}
	out, err = jobCmd(root, "list", "--json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(out), &jobs); err != nil || len(jobs) != 1 || jobs[0].JobID != 12 {
		t.Errorf("job list --json after rm = %s (%v)", out, err)
	}
	// An empty list is [] in JSON, a bare header in text.
	if _, err := jobCmd(root, "rm", "--id", "12"); err != nil {
		t.Fatal(err)
	}
	if out, _ := jobCmd(root, "list", "--json"); strings.TrimSpace(out) != "[]" {
		t.Errorf("job list --json of no jobs = %q, want []", out)
	}
	if out, _ := jobCmd(root, "list"); len(strings.Split(strings.TrimSpace(out), "\n")) != 1 {
		t.Errorf("job list of no jobs = %q, want only the header", out)
	}
}

func slicesEqual(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
