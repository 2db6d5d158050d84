package controller

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/xdpagg/xdpagg/mgmt"
)

// Request is an operator's request on the state directory's socket (SocketFile): one JSON
// object per connection, answered with one Reply. Who may send one: whoever may open the socket,
// i.e. the state directory's owner (mode 0700).
type Request struct {
	// Op: "failover" (Group: drain the active switch and move the group to the other one,
	// re-arming automatic failover), "reset" (Job: clear its slots, registers and counters on
	// both switches of its group), "status" (the View).
	Op    string `json:"op"`
	Group string `json:"group,omitempty"`
	Job   uint32 `json:"job,omitempty"`
}

// Reply answers a Request.
type Reply struct {
	Error    string    `json:"error,omitempty"`
	Failover *Failover `json:"failover,omitempty"`
	View     *View     `json:"view,omitempty"`
}

type request struct {
	Request
	reply chan Reply
}

// Ask sends req to the controller whose state directory is dir and returns its reply; a reply
// with an Error is returned with an error too.
func Ask(ctx context.Context, dir string, req Request) (Reply, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", filepath.Join(dir, SocketFile))
	if err != nil {
		return Reply{}, fmt.Errorf("reach the controller: %w", err)
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	if err := json.NewEncoder(conn).Encode(req); err != nil {
		return Reply{}, fmt.Errorf("send request: %w", err)
	}
	var r Reply
	if err := json.NewDecoder(conn).Decode(&r); err != nil {
		return Reply{}, fmt.Errorf("read reply: %w", err)
	}
	if r.Error != "" {
		return r, fmt.Errorf("%w: %s", ErrRequest, r.Error)
	}
	return r, nil
}

// listen opens the operator socket (a stale one from a dead controller is replaced).
func (c *Controller) listen() (net.Listener, error) {
	path := filepath.Join(c.dir, SocketFile)
	if conn, err := net.Dial("unix", path); err == nil {
		conn.Close()
		return nil, fmt.Errorf("%w: another controller serves %s", ErrConfig, c.dir)
	}
	_ = os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("operator socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("operator socket: %w", err)
	}
	return ln, nil
}

// serveRequests reads one request per connection and hands it to Run's loop, which does one
// thing at a time (a failover never races a replica refresh or another failover).
func (c *Controller) serveRequests(ctx context.Context, ln net.Listener) {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				return
			}
			continue
		}
		go func() {
			defer conn.Close()
			_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			var r request
			if err := json.NewDecoder(bufio.NewReader(conn)).Decode(&r.Request); err != nil {
				_ = json.NewEncoder(conn).Encode(Reply{Error: "bad request: " + err.Error()})
				return
			}
			_ = conn.SetReadDeadline(time.Time{})
			r.reply = make(chan Reply, 1)
			select {
			case c.reqs <- r:
			case <-ctx.Done():
				return
			}
			select {
			case rep := <-r.reply:
				_ = json.NewEncoder(conn).Encode(rep)
			case <-ctx.Done():
			}
		}()
	}
}

// handle runs one operator request (in Run's loop).
func (c *Controller) handle(ctx context.Context, r Request) Reply {
	switch r.Op {
	case "failover":
		g, ok := c.group(r.Group)
		if !ok {
			return Reply{Error: fmt.Sprintf("%v: group %q", ErrNoGroup, r.Group)}
		}
		c.mu.Lock()
		target := other(g, c.st.Groups[g.Name].Active)
		c.mu.Unlock()
		// Draining the active switch moves the hosts: only when the other one can take them.
		if statusOf(c.mon.Status(), target).State != StateHealthy {
			return Reply{Error: fmt.Sprintf("%s is not healthy: the group stays where it is", target)}
		}
		f := c.failover(ctx, g, ReasonOperator, "requested by the operator")
		return Reply{Failover: &f, Error: f.Error}
	case "reset":
		for _, j := range c.cfg.Jobs {
			if j.ID != r.Job {
				continue
			}
			g, _ := c.group(j.Group)
			var errs []error
			for _, name := range []string{g.Primary.Name, g.Standby.Name} {
				if err := c.call(ctx, func(ctx context.Context) error { return c.sw[name].Reset(ctx, j.ID) }); err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", name, err))
				}
			}
			if err := errors.Join(errs...); err != nil {
				return Reply{Error: fmt.Sprintf("reset job %d: %v", j.ID, err)}
			}
			return Reply{}
		}
		return Reply{Error: fmt.Sprintf("%v: job %d", ErrNoGroup, r.Job)}
	case "status":
		v := c.View()
		return Reply{View: &v}
	}
	return Reply{Error: fmt.Sprintf("unknown op %q (failover, reset, status)", r.Op)}
}

// View is the controller's view, written to the state directory's status file after every round
// (`xdpagg inspect --controller-status`). It holds no keys.
type View struct {
	Time      time.Time       `json:"time"`
	Heartbeat HeartbeatConfig `json:"heartbeat"`
	Degrade   DegradePolicy   `json:"degrade"`
	Groups    []GroupView     `json:"groups"`
	Jobs      []JobView       `json:"jobs"`
}

// GroupView is one group in a View.
type GroupView struct {
	Name         string         `json:"name"`
	Primary      string         `json:"primary"`
	Standby      string         `json:"standby"`
	Active       string         `json:"active"`
	Armed        bool           `json:"armed"`
	Switches     []Status       `json:"switches"`
	Degraded     string         `json:"degraded,omitempty"` // why the active switch is degraded now
	Pending      string         `json:"pending,omitempty"`  // a drained failover's reason, until its restore completes
	ReplicaTaken time.Time      `json:"replica_taken,omitzero"`
	Hot          bool           `json:"hot"`               // the standby is a mirror of the active switch
	Mirrored     time.Time      `json:"mirrored,omitzero"` // the Taken time of the last replica mirrored onto it
	Members      []mgmt.Member  `json:"members"`           // in the replica
	LastFailover *Failover      `json:"last_failover,omitempty"`
	Failovers    map[string]int `json:"failovers,omitempty"`
}

// JobView is one job in a View.
type JobView struct {
	JobConfig
	KeyFile  string          `json:"key_file"`
	Admitted map[string]bool `json:"admitted"`
	// ThresholdNow is the job's H on its group's active switch as of the replica (MSG_SETH may
	// have moved it from the configured Threshold); absent before the first replica with the job.
	ThresholdNow *uint8 `json:"threshold_now,omitempty"`
}

// View returns the controller's view.
func (c *Controller) View() View {
	statuses := c.mon.Status()
	c.mu.Lock()
	defer c.mu.Unlock()
	v := View{Time: time.Now().UTC(), Degrade: c.deg,
		Heartbeat: HeartbeatConfig{Interval: Duration(c.pol.Interval), SuspectAfter: c.pol.SuspectAfter, FailAfter: c.pol.FailAfter}}
	for _, g := range c.cfg.Groups {
		gs := c.st.Groups[g.Name]
		gv := GroupView{Name: g.Name, Primary: g.Primary.Name, Standby: g.Standby.Name, Active: gs.Active, Armed: gs.Armed,
			Degraded: c.degraded[gs.Active], Pending: gs.Pending, LastFailover: gs.LastFailover, Failovers: gs.Failovers,
			Hot: c.hot[g.Name] != "", Mirrored: gs.Mirrored}
		for _, s := range statuses {
			if s.Name == g.Primary.Name || s.Name == g.Standby.Name {
				gv.Switches = append(gv.Switches, s)
			}
		}
		if gs.Replica != nil {
			gv.ReplicaTaken, gv.Members = gs.Replica.Taken, gs.Replica.Members
		}
		v.Groups = append(v.Groups, gv)
	}
	for _, j := range c.cfg.Jobs {
		js := c.st.Jobs[j.ID]
		admitted := map[string]bool{}
		for k, b := range js.Admitted {
			admitted[k] = b
		}
		jv := JobView{JobConfig: j, KeyFile: js.KeyFile, Admitted: admitted}
		if gs := c.st.Groups[j.Group]; gs != nil && gs.Replica != nil {
			for _, rj := range gs.Replica.Jobs {
				if rj.ID == j.ID {
					h := rj.Threshold
					jv.ThresholdNow = &h
				}
			}
		}
		v.Jobs = append(v.Jobs, jv)
	}
	return v
}

// writeStatus writes the View to the status file.
func (c *Controller) writeStatus() {
	b, err := json.MarshalIndent(c.View(), "", "  ")
	if err == nil {
		err = writeAtomic(filepath.Join(c.dir, StatusFile), append(b, '\n'), 0o644)
	}
	c.report(err)
}
