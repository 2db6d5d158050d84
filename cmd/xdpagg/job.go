package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/vishvananda/netlink"

	"github.com/xdpagg/xdpagg/agent"
	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/loader"
	"github.com/xdpagg/xdpagg/maps"
)

// runJob dispatches `xdpagg job add|list|rm`: the operator's admission of jobs on a running
// switch (docs/security.md). add and rm change state; list reads.
func runJob(args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("%w: xdpagg job add|list|rm [flags] (see xdpagg job add -h)", errUsage)
	}
	switch args[0] {
	case "add":
		return runJobAdd(args[1:], stdout)
	case "list":
		return runJobList(args[1:], stdout)
	case "rm":
		return runJobRm(args[1:], stdout)
	case "-h", "--help", "help":
		fmt.Fprintln(stdout, "usage: xdpagg job add|list|rm [flags]\n\n"+
			"  add   admit a job: bind its PS, its worker count and slot quota (and a sparse job's\n"+
			"        register arrays, --reg-arrays), make its key\n"+
			"  list  show admitted jobs\n"+
			"  rm    end a job: drop its members and key, free its slots")
		return nil
	}
	return fmt.Errorf("%w: unknown job command %q: use add, list or rm", errUsage, args[0])
}

func switchFlags(fs *flag.FlagSet) (name, pinRoot *string) {
	name = fs.String("name", "default", "switch name (as given to xdpagg switch --name)")
	pinRoot = fs.String("pin-root", agent.DefaultPinRoot, "bpffs directory the switch pinned under")
	return
}

func openSwitch(pinRoot, name string) (*maps.Maps, error) {
	m, err := maps.OpenPinned(agent.PinDir(pinRoot, name))
	if err != nil {
		return nil, fmt.Errorf("%w (is `xdpagg switch --name %s` running?)", err, name)
	}
	return m, nil
}

// jobJSON is a job as `job add --json` and `job list --json` print it: maps.Job, with its register
// arrays always shown (0: a dense job) and their base whenever the job is sparse (maps.Job omits
// a base of 0, which is the first sparse job's).
type jobJSON struct {
	maps.Job
	RegArrays uint16  `json:"reg_arrays"`
	RegBase   *uint16 `json:"reg_base,omitempty"`
}

func newJobJSON(j maps.Job) jobJSON {
	out := jobJSON{Job: j, RegArrays: j.RegArrays}
	if j.RegArrays > 0 {
		base := j.RegBase
		out.RegBase = &base
	}
	return out
}

// sparseDesc is a job's register arrays as the tables show them: "m=64@0" (m arrays from array
// 0, of each parity), or "-" for a dense job.
func sparseDesc(j maps.Job) string {
	if j.RegArrays == 0 {
		return "-"
	}
	return fmt.Sprintf("m=%d@%d", j.RegArrays, j.RegBase)
}

// thresholdDesc is a job's H as the tables show it: "3" (asynchronous), or "sync" for a
// threshold of 0 or of every worker.
func thresholdDesc(j maps.Job) string { return hDesc(j.Threshold, j.Workers) }

func hDesc(h, workers uint8) string {
	if h == 0 || h >= workers {
		return "sync"
	}
	return fmt.Sprintf("%d", h)
}

// jobAdded is what `xdpagg job add --json` prints.
type jobAdded struct {
	jobJSON
	Key string `json:"key,omitempty"` // hex; absent when written to --key-file
}

func runJobAdd(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("job add", flag.ContinueOnError)
	name, pinRoot := switchFlags(fs)
	var (
		id       = fs.Uint("id", 0, "job id to admit, 1..4294967295 (required)")
		workers  = fs.Uint("workers", 0, "workers in the job, 1..32: worker ids 0..N-1 may join (required)")
		ps       = fs.String("ps", "", "the job's parameter server as IPv4[:port] (port default 9510); the only source of its results (required)")
		psIface  = fs.String("ps-iface", "", "switch port the PS is behind (default: the port the switch routes the PS's address to)")
		maxSlots = fs.Uint("max-slots", 0, "most aggregator slots the job may hold (default: a quarter of the pool, at least 128)")
		keyFile  = fs.String("key-file", "", "write the job's key (hex) to this file, mode 0600, instead of printing it")
		thresh   = fs.Uint("threshold", 0, "asynchronous aggregation: a fragment completes once H of the workers contributed, 1..--workers (iSwitch's H; members change it with MSG_SETH); 0: every worker (synchronous)")
		regArr   = fs.Uint("reg-arrays", 0, fmt.Sprintf("make a sparse (hot-parameter) job owning this many of the switch's register arrays (m), 1..%d: m x r hot parameters summed in-switch (r: xdpagg switch --reg-slots); 0: a dense job", bpf.JobMaxArrays))
		asJSON   = fs.Bool("json", false, "print JSON")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *id == 0 || *id > 0xffffffff {
		return fmt.Errorf("%w: --id %d: use 1..4294967295", errUsage, *id)
	}
	if *workers == 0 || *workers > 32 {
		return fmt.Errorf("%w: --workers %d: use 1..32", errUsage, *workers)
	}
	if *thresh > *workers {
		return fmt.Errorf("%w: --threshold %d: use 0 (synchronous) or 1..--workers (%d)", errUsage, *thresh, *workers)
	}
	if *thresh > 0 && *regArr > 0 {
		return fmt.Errorf("%w: --threshold: a sparse job (--reg-arrays) takes none", errUsage)
	}
	if *regArr > uint(bpf.JobMaxArrays) {
		return fmt.Errorf("%w: --reg-arrays %d: use 0 (a dense job) or 1..%d", errUsage, *regArr, bpf.JobMaxArrays)
	}
	psAddr, err := parsePS(*ps)
	if err != nil {
		return err
	}
	m, err := openSwitch(*pinRoot, *name)
	if err != nil {
		return err
	}
	defer m.Close()
	if total := m.RegArrays(); uint32(*regArr) > total {
		return fmt.Errorf("%w: --reg-arrays %d: the switch has %d register arrays in all (xdpagg switch --reg-arrays)", errUsage, *regArr, total)
	}
	ifindex, err := psPort(m, psAddr.Addr(), *psIface)
	if err != nil {
		return err
	}
	quota := uint32(*maxSlots)
	if quota == 0 {
		quota = maps.DefaultMaxSlots(m.PoolSize())
	}
	if quota > m.PoolSize() {
		return fmt.Errorf("%w: --max-slots %d: the pool has %d slots", errUsage, quota, m.PoolSize())
	}
	key, err := ctlauth.NewKey()
	if err != nil {
		return err
	}
	j := maps.Job{JobID: uint32(*id), PS: psAddr, PSIfindex: ifindex, Workers: uint8(*workers), MaxSlots: quota, RegArrays: uint16(*regArr), Threshold: uint8(*thresh)}
	if *keyFile != "" {
		// Written before admission, to a new file next to its destination: a job never exists
		// without its key somewhere, the file is 0600 whatever was there before, and a refused
		// admission (the id is taken) leaves an existing key file (the running job's) alone.
		tmp, err := writeKeyTemp(*keyFile, key)
		if err != nil {
			return err
		}
		if err := m.AddJob(j, key); err != nil {
			_ = os.Remove(tmp)
			return admitError(m, j, err)
		}
		if err := os.Rename(tmp, *keyFile); err != nil {
			return fmt.Errorf("job %d admitted, but its key is in %s: %w", j.JobID, tmp, err)
		}
	} else if err := m.AddJob(j, key); err != nil {
		return admitError(m, j, err)
	}
	// AddJob chose the register arrays of a sparse job: read them back. The key is printed
	// whatever happens (it exists nowhere else), and a failed read reported after it.
	var readErr error
	if j.RegArrays > 0 {
		if a, err := m.Admission(j.JobID); err != nil {
			readErr = fmt.Errorf("job %d admitted, but its register arrays could not be read back (see xdpagg job list): %w", j.JobID, err)
		} else {
			j.RegBase = a.RegBase
		}
	}
	out := jobAdded{jobJSON: newJobJSON(j)}
	if readErr != nil {
		out.RegBase = nil // unknown
	}
	if *keyFile == "" {
		out.Key = ctlauth.FormatKey(key)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(out); err != nil {
			return err
		}
		return readErr
	}
	fmt.Fprintf(stdout, "job %d admitted: %d workers, PS %v (switch port ifindex %d), at most %d slots", j.JobID, j.Workers, j.PS, j.PSIfindex, j.MaxSlots)
	if j.Threshold != 0 {
		fmt.Fprintf(stdout, ", asynchronous: threshold %s", thresholdDesc(j))
	}
	if j.RegArrays > 0 && readErr == nil {
		fmt.Fprintf(stdout, ", sparse: %d register arrays from array %d of each parity (%s)", j.RegArrays, j.RegBase, sparseDesc(j))
	}
	fmt.Fprintln(stdout)
	if out.Key != "" {
		fmt.Fprintf(stdout, "key %s\n", out.Key)
	} else {
		fmt.Fprintf(stdout, "key written to %s\n", *keyFile)
	}
	return readErr
}

// admitError explains a refused admission. When the switch has no free run of register arrays
// for a sparse job, it says how many it has, which jobs own them and the largest free run.
func admitError(m *maps.Maps, j maps.Job, err error) error {
	if !errors.Is(err, maps.ErrNoRegisters) {
		return err
	}
	total := m.RegArrays()
	jobs, lerr := m.ListJobs()
	if lerr != nil {
		return fmt.Errorf("job %d: --reg-arrays %d: %w", j.JobID, j.RegArrays, err)
	}
	var owners []string
	used := make([]bool, total)
	for _, o := range jobs {
		if o.RegArrays == 0 {
			continue
		}
		owners = append(owners, fmt.Sprintf("job %d %s", o.JobID, sparseDesc(o)))
		for a := uint32(o.RegBase); a < uint32(o.RegBase)+uint32(o.RegArrays) && a < total; a++ {
			used[a] = true
		}
	}
	free, run, largest := 0, 0, 0
	for _, u := range used {
		if u {
			run = 0
			continue
		}
		free++
		run++
		largest = max(largest, run)
	}
	held := "none"
	if len(owners) > 0 {
		held = strings.Join(owners, ", ")
	}
	return fmt.Errorf("job %d: --reg-arrays %d: %w: the switch has %d register arrays per parity, %d free, at most %d in one run (owned: %s); "+
		"ask for fewer, end a sparse job (xdpagg job rm), or restart the switch with a larger --reg-arrays",
		j.JobID, j.RegArrays, err, total, free, largest, held)
}

// writeKeyTemp writes key (hex) to a new file of mode 0600 in path's directory and returns its name.
func writeKeyTemp(path string, key []byte) (string, error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return "", fmt.Errorf("write key file: %w", err)
	}
	_, err = f.WriteString(ctlauth.FormatKey(key) + "\n")
	if err == nil {
		err = f.Chmod(0o600)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return "", fmt.Errorf("write key file: %w", err)
	}
	return f.Name(), nil
}

func parsePS(s string) (netip.AddrPort, error) {
	if s == "" {
		return netip.AddrPort{}, fmt.Errorf("%w: --ps is required (the job's parameter server, IPv4[:port])", errUsage)
	}
	if ap, err := netip.ParseAddrPort(s); err == nil && ap.Addr().Is4() && ap.Port() != 0 {
		return ap, nil
	}
	if a, err := netip.ParseAddr(s); err == nil && a.Is4() {
		return netip.AddrPortFrom(a, loader.DefaultPort), nil
	}
	return netip.AddrPort{}, fmt.Errorf("%w: --ps %q: want IPv4[:port], e.g. 10.0.5.2:9510", errUsage, s)
}

// psPort finds the switch port the PS is behind: the named interface, or where the switch's
// routing table sends the PS's address. Either must be one of the switch's ports.
func psPort(m *maps.Maps, ps netip.Addr, iface string) (uint32, error) {
	var ifindex int
	if iface != "" {
		l, err := netlink.LinkByName(iface)
		if err != nil {
			return 0, fmt.Errorf("%w: --ps-iface %q: %v", errUsage, iface, err)
		}
		ifindex = l.Attrs().Index
	} else {
		routes, err := netlink.RouteGet(net.IP(ps.AsSlice()))
		if err != nil || len(routes) == 0 {
			return 0, fmt.Errorf("%w: no route to the PS %v here: name its switch port with --ps-iface (%v)", errUsage, ps, err)
		}
		ifindex = routes[0].LinkIndex
	}
	ports, err := m.ListPorts()
	if err != nil {
		return 0, err
	}
	if !slices.Contains(ports, uint32(ifindex)) {
		return 0, fmt.Errorf("%w: the PS %v is behind ifindex %d, which is not a port of this switch (ports %v)", errUsage, ps, ifindex, ports)
	}
	return uint32(ifindex), nil
}

func runJobList(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("job list", flag.ContinueOnError)
	name, pinRoot := switchFlags(fs)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	m, err := openSwitch(*pinRoot, *name)
	if err != nil {
		return err
	}
	defer m.Close()
	jobs, err := m.ListJobs()
	if err != nil {
		return err
	}
	if *asJSON {
		out := []jobJSON{}
		for _, j := range jobs {
			out = append(out, newJobJSON(j))
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tPS\tPS IFINDEX\tWORKERS\tTHRESHOLD\tJOINED\tSLOTS HELD\tMAX SLOTS\tSPARSE")
	for _, j := range jobs {
		fmt.Fprintf(tw, "%d\t%v\t%d\t%d\t%s\t%#x\t%d\t%d\t%s\n", j.JobID, j.PS, j.PSIfindex, j.Workers, thresholdDesc(j), j.Joined, j.Held, j.MaxSlots, sparseDesc(j))
	}
	return tw.Flush()
}

func runJobRm(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("job rm", flag.ContinueOnError)
	name, pinRoot := switchFlags(fs)
	id := fs.Uint("id", 0, "job id to end (required)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *id == 0 || *id > 0xffffffff {
		return fmt.Errorf("%w: --id %d: use 1..4294967295", errUsage, *id)
	}
	m, err := openSwitch(*pinRoot, *name)
	if err != nil {
		return err
	}
	defer m.Close()
	freed, err := m.RemoveJob(uint32(*id))
	if errors.Is(err, maps.ErrNoJob) {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "job %d removed; %d slots freed\n", *id, freed)
	return nil
}
