// Package gloo runs PyTorch Gloo allreduce across the worker namespaces of a netns_tests/topo
// topology: the software baseline that xdpagg's in-network aggregation is benchmarked against.
//
// Start launches one long-lived torch.distributed rank (gloo_worker.py, embedded) per worker
// namespace with `ip netns exec NS python3 ...`; rank 0's address is the rendezvous master. Ranks
// are driven by a line protocol on their stdin/stdout. Gloo traffic crosses the topology's switch
// namespace like any other routed traffic.
//
// It needs Debian's python3-torch (torch 1.13, which has Gloo) under /usr/bin/python3; see
// Available. The package never logs or exits; it returns wrapped errors.
package gloo

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/xdpagg/xdpagg/netns_tests/topo"
)

//go:embed gloo_worker.py
var workerScript []byte

// Script returns the embedded rank script (gloo_worker.py).
func Script() []byte { return bytes.Clone(workerScript) }

// Defaults of Options.
const (
	DefaultPython  = "/usr/bin/python3"
	DefaultPort    = 29500
	DefaultThreads = 1
	DefaultTimeout = 2 * time.Minute
)

// ErrBroken is wrapped by the errors of every call on a Group after a rank failed, a reply was
// unusable or a context ended mid-command: the collective state is unknown, so only Close is left.
var ErrBroken = errors.New("gloo group is broken")

// ErrClosed is returned by calls on a closed Group.
var ErrClosed = errors.New("gloo group is closed")

// Options configure Start. Zero values mean the defaults.
type Options struct {
	// Python is the interpreter that has torch; default DefaultPython (Debian's, with
	// python3-torch). A pyenv/venv python without torch will not do.
	Python string
	// Port is the rendezvous (TCPStore) port on rank 0; default DefaultPort.
	Port int
	// Threads is torch.set_num_threads in every rank; default DefaultThreads.
	Threads int
	// Timeout is Gloo's timeout for the rendezvous and for every collective; default
	// DefaultTimeout. It only matters when a rank dies: the others then fail after it.
	Timeout time.Duration
}

func (o Options) withDefaults() Options {
	if o.Python == "" {
		o.Python = DefaultPython
	}
	if o.Port == 0 {
		o.Port = DefaultPort
	}
	if o.Threads <= 0 {
		o.Threads = DefaultThreads
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	return o
}

// Group is a running set of Gloo ranks, one per worker of a topology. Its methods are safe for
// concurrent use; commands run one at a time.
type Group struct {
	opts   Options
	dir    string // temp dir holding the script
	script string // path of the script
	ranks  []*rank
	events chan event     // replies and EOFs of every rank
	rwg    sync.WaitGroup // readers; events is closed when all are done

	mu     sync.Mutex // serialises commands and Close
	broken error
	closed bool
	torch  string
}

// rank is one python process.
type rank struct {
	id     int
	ns     string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *tailBuffer
	done   chan struct{} // closed once the process has been waited for
	werr   error         // Wait's error, valid after done

	cpuMu   sync.Mutex
	lastCPU time.Duration // last value read from /proc while alive
}

// event is one protocol line of a rank, or its end (eof).
type event struct {
	rank int
	line []byte
	eof  bool
}

// Start launches one rank per worker of t (rank i in t.Workers[i]'s namespace, rank 0's address
// as master) and waits until all have joined the Gloo process group, ctx ends or a rank fails. On
// error everything started is stopped.
func Start(ctx context.Context, t *topo.Topology, opts Options) (*Group, error) {
	if t == nil || len(t.Workers) == 0 {
		return nil, errors.New("gloo: start: topology has no workers")
	}
	opts = opts.withDefaults()
	if opts.Port < 1 || opts.Port > 65535 {
		return nil, fmt.Errorf("gloo: start: port %d out of range", opts.Port)
	}
	dir, err := os.MkdirTemp("", "xdpagg-gloo-")
	if err != nil {
		return nil, fmt.Errorf("gloo: start: %w", err)
	}
	g := &Group{
		opts:   opts,
		dir:    dir,
		script: filepath.Join(dir, "gloo_worker.py"),
		events: make(chan event, 2*len(t.Workers)),
	}
	if err := os.WriteFile(g.script, workerScript, 0o644); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("gloo: start: write script: %w", err)
	}
	fail := func(err error) (*Group, error) {
		g.broken = err
		if cerr := g.Close(); cerr != nil {
			return nil, fmt.Errorf("%w (and stopping the ranks: %w)", err, cerr)
		}
		return nil, err
	}
	master := t.Workers[0].IP.String()
	world := len(t.Workers)
	var startErr error
	for i, h := range t.Workers {
		if err := g.startRank(i, world, h, master); err != nil {
			startErr = fmt.Errorf("gloo: start rank %d in %s: %w", i, h.NSName, err)
			break
		}
	}
	go func() { g.rwg.Wait(); close(g.events) }()
	if startErr != nil {
		return fail(startErr)
	}
	replies, err := g.collect(ctx, "start")
	if err != nil {
		return fail(err)
	}
	for i, rep := range replies {
		var ready struct {
			Ready bool   `json:"ready"`
			Rank  int    `json:"rank"`
			World int    `json:"world"`
			Torch string `json:"torch"`
		}
		if err := json.Unmarshal(rep, &ready); err != nil || !ready.Ready || ready.Rank != i || ready.World != world {
			return fail(fmt.Errorf("gloo: start: rank %d: unexpected ready line %q", i, rep))
		}
		g.torch = ready.Torch
	}
	return g, nil
}

func (g *Group) startRank(id, world int, h *topo.Host, master string) error {
	cmd := exec.Command("ip", "netns", "exec", h.NSName, g.opts.Python, "-u", g.script,
		strconv.Itoa(id), strconv.Itoa(world), master, strconv.Itoa(g.opts.Port),
		strconv.Itoa(g.opts.Threads), strconv.FormatFloat(g.opts.Timeout.Seconds(), 'f', -1, 64), h.Ifname)
	cmd.Env = append(os.Environ(), "GLOO_SOCKET_IFNAME="+h.Ifname, "PYTHONUNBUFFERED=1")
	// Own process group, so that a kill reaches anything a rank spawned; SIGKILL if we die.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	r := &rank{id: id, ns: h.NSName, cmd: cmd, stderr: &tailBuffer{max: 16 << 10}, done: make(chan struct{})}
	cmd.Stderr = r.stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		_ = stdin.Close()
		return err
	}
	r.stdin = stdin
	if err := cmd.Start(); err != nil {
		return err
	}
	// `ip netns exec` execs the command, so cmd.Process.Pid is python's PID.
	g.ranks = append(g.ranks, r)
	g.rwg.Add(1)
	go func() {
		defer g.rwg.Done()
		br := bufio.NewReaderSize(stdout, 64<<10)
		for {
			line, err := br.ReadBytes('\n')
			if line = bytes.TrimSpace(line); len(line) > 0 {
				g.events <- event{rank: id, line: line}
			}
			if err != nil {
				break
			}
		}
		// Wait only after stdout's EOF (exec.Cmd's rule for StdoutPipe).
		r.werr = cmd.Wait()
		close(r.done)
		g.events <- event{rank: id, eof: true}
	}()
	return nil
}

// collect waits for one reply line from every rank. Any failure breaks the group.
func (g *Group) collect(ctx context.Context, what string) ([][]byte, error) {
	out := make([][]byte, len(g.ranks))
	for got := 0; got < len(g.ranks); {
		select {
		case ev, ok := <-g.events:
			switch {
			case !ok:
				g.broken = fmt.Errorf("gloo: %s: all ranks ended", what)
				return nil, g.broken
			case ev.eof:
				r := g.ranks[ev.rank]
				g.broken = fmt.Errorf("gloo: %s: rank %d (%s) exited (%v): %s", what, ev.rank, r.ns, r.werr, r.stderr.Tail(2000))
				return nil, g.broken
			case out[ev.rank] != nil:
				g.broken = fmt.Errorf("gloo: %s: rank %d sent an extra line %q", what, ev.rank, ev.line)
				return nil, g.broken
			}
			var e struct {
				Error string `json:"error"`
			}
			if err := json.Unmarshal(ev.line, &e); err != nil {
				g.broken = fmt.Errorf("gloo: %s: rank %d: bad reply %q: %w", what, ev.rank, ev.line, err)
				return nil, g.broken
			}
			if e.Error != "" {
				r := g.ranks[ev.rank]
				g.broken = fmt.Errorf("gloo: %s: rank %d (%s): %s%s", what, ev.rank, r.ns, e.Error, installHint(e.Error))
				if tail := r.stderr.Tail(2000); tail != "" {
					g.broken = fmt.Errorf("%w; stderr: %s", g.broken, tail)
				}
				return nil, g.broken
			}
			out[ev.rank] = ev.line
			got++
		case <-ctx.Done():
			g.broken = fmt.Errorf("gloo: %s: %w", what, context.Cause(ctx))
			return nil, g.broken
		}
	}
	return out, nil
}

func installHint(msg string) string {
	if strings.Contains(msg, "import torch") || strings.Contains(msg, "no Gloo") {
		return " (" + installAdvice + ")"
	}
	return ""
}

const installAdvice = "install Debian's python3-torch (apt-get install python3-torch) and use /usr/bin/python3"

// command sends line to every rank and collects one reply from each.
func (g *Group) command(ctx context.Context, what, line string) ([][]byte, error) {
	if g.closed {
		return nil, fmt.Errorf("gloo: %s: %w", what, ErrClosed)
	}
	if g.broken != nil {
		return nil, fmt.Errorf("gloo: %s: %w: %w", what, ErrBroken, g.broken)
	}
	for _, r := range g.ranks {
		if _, err := io.WriteString(r.stdin, line+"\n"); err != nil {
			g.broken = fmt.Errorf("gloo: %s: write to rank %d: %w", what, r.id, err)
			return nil, g.broken
		}
	}
	return g.collect(ctx, what)
}

// AllReduce sums a float32 tensor of n elements (random values) across all ranks iters times,
// after one untimed warm-up, with a barrier before each iteration. An iteration's time is the
// maximum over the ranks of their all_reduce time: the allreduce is done when the slowest rank
// has its result.
func (g *Group) AllReduce(ctx context.Context, n, iters int) ([]time.Duration, error) {
	if n < 1 || iters < 1 {
		return nil, fmt.Errorf("gloo: allreduce: n=%d iters=%d: both must be >= 1", n, iters)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	what := fmt.Sprintf("allreduce n=%d iters=%d", n, iters)
	replies, err := g.command(ctx, what, fmt.Sprintf("allreduce %d %d", n, iters))
	if err != nil {
		return nil, err
	}
	out := make([]time.Duration, iters)
	for i, rep := range replies {
		var res struct {
			N       int       `json:"n"`
			Seconds []float64 `json:"seconds"`
		}
		if err := json.Unmarshal(rep, &res); err != nil || res.N != n || len(res.Seconds) != iters {
			g.broken = fmt.Errorf("gloo: %s: rank %d: unexpected reply %.200q", what, i, rep)
			return nil, g.broken
		}
		for j, s := range res.Seconds {
			out[j] = max(out[j], time.Duration(s*float64(time.Second)))
		}
	}
	return out, nil
}

// Check runs one allreduce of n elements where rank r holds r+1 everywhere and verifies on every
// rank that each element is W(W+1)/2.
func (g *Group) Check(ctx context.Context, n int) error {
	if n < 1 {
		return fmt.Errorf("gloo: check: n=%d must be >= 1", n)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	what := fmt.Sprintf("check n=%d", n)
	replies, err := g.command(ctx, what, fmt.Sprintf("check %d", n))
	if err != nil {
		return err
	}
	var errs []error
	for i, rep := range replies {
		var res struct {
			OK       bool     `json:"ok"`
			N        int      `json:"n"`
			Want     float64  `json:"want"`
			Bad      int      `json:"bad"`
			FirstBad *float64 `json:"first_bad"`
		}
		if err := json.Unmarshal(rep, &res); err != nil || res.N != n {
			g.broken = fmt.Errorf("gloo: %s: rank %d: unexpected reply %.200q", what, i, rep)
			return g.broken
		}
		if !res.OK {
			first := "?"
			if res.FirstBad != nil {
				first = strconv.FormatFloat(*res.FirstBad, 'g', -1, 64)
			}
			errs = append(errs, fmt.Errorf("rank %d: %d of %d elements are not %g (e.g. %s)", i, res.Bad, n, res.Want, first))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("gloo: %s: wrong sums: %w", what, err)
	}
	return nil
}

// Size returns the number of ranks.
func (g *Group) Size() int { return len(g.ranks) }

// TorchVersion returns torch.__version__ as reported by the ranks.
func (g *Group) TorchVersion() string { return g.torch }

// PIDs returns the process IDs of the ranks (python's: `ip netns exec` execs it).
func (g *Group) PIDs() []int {
	out := make([]int, len(g.ranks))
	for i, r := range g.ranks {
		out[i] = r.cmd.Process.Pid
	}
	return out
}

// ScriptPath returns the path of the script the ranks run (removed by Close).
func (g *Group) ScriptPath() string { return g.script }

// CPUTime returns the user+system CPU time of all rank processes so far (all their threads, and
// their waited-for children if any): from /proc/PID/stat while a rank runs, from its wait status
// once it has exited. It does not wait for a running command.
func (g *Group) CPUTime() (time.Duration, error) {
	var total time.Duration
	var errs []error
	for _, r := range g.ranks {
		d, err := r.cpuTime()
		if err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w", r.id, err))
		}
		total += d
	}
	if err := errors.Join(errs...); err != nil {
		return total, fmt.Errorf("gloo: cpu time: %w", err)
	}
	return total, nil
}

func (r *rank) cpuTime() (time.Duration, error) {
	r.cpuMu.Lock()
	defer r.cpuMu.Unlock()
	fromState := func() time.Duration {
		if ps := r.cmd.ProcessState; ps != nil {
			return ps.UserTime() + ps.SystemTime()
		}
		return r.lastCPU
	}
	select {
	case <-r.done:
		return fromState(), nil
	default:
	}
	d, err := procCPU(r.cmd.Process.Pid)
	if err == nil {
		r.lastCPU = d
		return d, nil
	}
	// Reaped between the check and the read: the wait status is about to be there.
	select {
	case <-r.done:
		return fromState(), nil
	case <-time.After(2 * time.Second):
		return r.lastCPU, err
	}
}

// userHZ is the unit of the times in /proc/PID/stat (USER_HZ, 100 on every Linux ABI).
const userHZ = 100

// procCPU returns utime+stime+cutime+cstime of pid.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no ')'", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); utime, stime, cutime, cstime are fields 14..17.
	if len(f) < 15 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	var ticks int64
	for _, s := range f[11:15] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks += v
	}
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// Close asks every rank to quit and waits for them, killing those still running after a grace
// period (at once when the group is broken: a rank may be stuck in a collective). It removes the
// temporary script. Calling it again is a no-op.
func (g *Group) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	// Keep the readers moving so that they reach EOF and wait for their process.
	go func() {
		for range g.events {
		}
	}()
	var errs []error
	grace := 10 * time.Second
	if g.broken != nil {
		grace = 0
	}
	for _, r := range g.ranks {
		if grace > 0 {
			_, _ = io.WriteString(r.stdin, "quit\n")
		}
		_ = r.stdin.Close()
	}
	deadline := time.After(grace)
	var killed []int
	for _, r := range g.ranks {
		select {
		case <-r.done:
			continue
		default:
		}
		select {
		case <-r.done:
			continue
		case <-deadline:
		}
		select {
		case <-r.done: // it did exit: the PID may already be someone else's
			continue
		default:
		}
		killed = append(killed, r.id)
		// The whole process group (Setpgid): python and anything it started.
		if err := syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("kill rank %d: %w", r.id, err))
		}
		select {
		case <-r.done:
		case <-time.After(10 * time.Second):
			errs = append(errs, fmt.Errorf("rank %d (pid %d) did not exit after SIGKILL", r.id, r.cmd.Process.Pid))
		}
		deadline = time.After(0)
	}
	if g.broken == nil {
		if len(killed) > 0 {
			errs = append(errs, fmt.Errorf("ranks %v did not quit within %v and were killed", killed, grace))
		}
		for _, r := range g.ranks {
			select {
			case <-r.done:
				if r.werr != nil && !slices.Contains(killed, r.id) {
					errs = append(errs, fmt.Errorf("rank %d exited: %v: %s", r.id, r.werr, r.stderr.Tail(1000)))
				}
			default:
			}
		}
	}
	if err := os.RemoveAll(g.dir); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("gloo: close: %w", err)
	}
	return nil
}

// Available returns nil if python (DefaultPython when empty) can import torch and
// torch.distributed has the Gloo backend, else an error saying what to install.
func Available(python string) error {
	if python == "" {
		python = DefaultPython
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const probe = "import torch, torch.distributed as d\n" +
		"assert d.is_available(), 'torch.distributed is not available'\n" +
		"assert d.is_gloo_available(), 'torch.distributed has no Gloo backend'\n" +
		"print(torch.__version__)\n"
	cmd := exec.CommandContext(ctx, python, "-c", probe)
	var stderr tailBuffer
	stderr.max = 4 << 10
	cmd.Stderr = &stderr
	if _, err := cmd.Output(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
			msg = msg[i+1:] // the exception line of the traceback
		}
		if msg != "" {
			return fmt.Errorf("gloo: %s cannot run torch with Gloo: %v: %s; %s", python, err, msg, installAdvice)
		}
		return fmt.Errorf("gloo: %s cannot run torch with Gloo: %w; %s", python, err, installAdvice)
	}
	return nil
}

// tailBuffer is an io.Writer keeping the last max bytes written.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// Tail returns up to the last n bytes, trimmed.
func (t *tailBuffer) Tail(n int) string {
	s := t.String()
	if len(s) > n {
		s = "..." + s[len(s)-n:]
	}
	return strings.TrimSpace(s)
}
