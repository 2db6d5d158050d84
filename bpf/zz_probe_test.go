package bpf_test

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/xdpagg/xdpagg/loader"
)

func TestZZProbe(t *testing.T) {
	sw, err := loader.Load(loader.Config{PoolSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Close()
	pkt := make([]byte, 100)
	pkt[12] = 8
	out := make([]byte, 600)
	opts := &ebpf.RunOptions{Data: pkt, DataOut: out}
	r, err := sw.Objects.XdpaggEgress.Run(opts)
	t.Logf("egress: %v %v", r, err)
	r, err = sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: pkt, DataOut: out})
	t.Logf("switch: %v %v", r, err)
	r, err = sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: pkt[:14], DataOut: out})
	t.Logf("switch 14: %v %v", r, err)
	r, err = sw.Objects.XdpaggSwitch.Run(&ebpf.RunOptions{Data: pkt[:10], DataOut: out})
	t.Logf("switch 10: %v %v", r, err)
}
