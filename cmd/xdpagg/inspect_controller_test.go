package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/xdpagg/xdpagg/controller"
	"github.com/xdpagg/xdpagg/mgmt"
)

// TestInspectController: `xdpagg inspect --controller-status` shows the groups, the active
// switch, the members, the jobs, the thresholds and the last failover, from the file or from the
// state directory; `xdpagg failover` without a running controller fails.
func TestInspectController(t *testing.T) {
	dir := t.TempDir()
	hNow := uint8(1) // job 7's binding moved H from the configured 2 to 1 (MSG_SETH)
	v := controller.View{Time: time.Now(), Heartbeat: controller.HeartbeatConfig{Interval: controller.Duration(200 * time.Millisecond), SuspectAfter: 1, FailAfter: 3},
		Degrade: controller.DegradePolicy{MaxResendShare: 0.25, MinPackets: 200, Heartbeats: 5},
		Groups: []controller.GroupView{{Name: "rack1", Primary: "sw-a", Standby: "sw-b", Active: "sw-b",
			Switches:     []controller.Status{{Name: "sw-a", State: controller.StateFailed}, {Name: "sw-b", State: controller.StateHealthy}},
			Members:      []mgmt.Member{{Job: 7, Worker: 1, Port: "p1", Addr: netip.MustParseAddrPort("10.200.2.2:9600"), MAC: net.HardwareAddr{2, 0, 10, 200, 2, 2}}},
			LastFailover: &controller.Failover{From: "sw-a", To: "sw-b", Reason: controller.ReasonFailed, Source: "replica", Migrated: mgmt.RestoreStats{Members: 3}},
			Failovers:    map[string]int{controller.ReasonFailed: 1}}},
		Jobs: []controller.JobView{{JobConfig: controller.JobConfig{ID: 7, Workers: 3, Group: "rack1", PSPort: "p3", Threshold: 2}, Admitted: map[string]bool{"sw-a": true, "sw-b": true}, ThresholdNow: &hNow},
			{JobConfig: controller.JobConfig{ID: 8, Workers: 4, Group: "rack1", PSPort: "p3"}, Admitted: map[string]bool{"sw-b": true}}},
	}
	b, _ := json.Marshal(v)
	if err := os.WriteFile(filepath.Join(dir, controller.StatusFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := runInspect([]string{"--controller-status", dir}, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"group rack1: primary sw-a, standby sw-b, active sw-b", "automatic failover disarmed", "10.200.2.2:9600",
		"sw-a -> sw-b (failed", "state from replica", "Members:3", "failed after 3", "0.25 resends", "sw-a,sw-b", "2 (now 1)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("inspect output lacks %q:\n%s", want, out.String())
		}
	}
	if !regexp.MustCompile(`(?m)^8 +rack1 +4 +sync `).MatchString(out.String()) {
		t.Errorf("job 8 (synchronous) not shown with H sync:\n%s", out.String())
	}
	out.Reset()
	if err := runInspect([]string{"--controller-status", filepath.Join(dir, controller.StatusFile), "--json"}, &out); err != nil || !strings.Contains(out.String(), `"active": "sw-b"`) {
		t.Errorf("--json: %v\n%s", err, out.String())
	}
	if err := runFailover([]string{"--state-dir", dir, "--group", "rack1", "--timeout", "2s"}, &out); err == nil {
		t.Error("failover without a controller succeeded")
	}
}

// TestResetAsksTheController: `xdpagg reset` sends the controller a reset request for the job
// and reports its refusal; usage errors need no controller.
func TestResetAsksTheController(t *testing.T) {
	dir := t.TempDir()
	var out bytes.Buffer
	for _, args := range [][]string{{"--job", "7"}, {"--state-dir", dir}, {"--state-dir", dir, "--job", "4294967296"}} {
		if err := runReset(args, &out); !errors.Is(err, errUsage) {
			t.Errorf("reset %v: %v, want a usage error", args, err)
		}
	}
	ln, err := net.Listen("unix", filepath.Join(dir, controller.SocketFile))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan controller.Request, 2)
	go func() {
		for _, answer := range []string{"", "no job 9"} {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			var r controller.Request
			_ = json.NewDecoder(conn).Decode(&r)
			got <- r
			_ = json.NewEncoder(conn).Encode(controller.Reply{Error: answer})
			conn.Close()
		}
	}()
	if err := runReset([]string{"--state-dir", dir, "--job", "7"}, &out); err != nil || !strings.Contains(out.String(), "job 7 reset") {
		t.Errorf("reset: %v %q", err, out.String())
	}
	if r := <-got; r.Op != "reset" || r.Job != 7 {
		t.Errorf("request %+v, want reset of job 7", r)
	}
	if err := runReset([]string{"--state-dir", dir, "--job", "9"}, &out); !errors.Is(err, controller.ErrRequest) {
		t.Errorf("refused reset: %v, want ErrRequest", err)
	}
	<-got
}
