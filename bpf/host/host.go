package host

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
)

// Config is what xdpagg_host redirects: results of job JobID addressed to Addr.
type Config struct {
	Addr  netip.AddrPort // the worker's IPv4 address and UDP port (port != 0)
	JobID uint32         // the worker's job (!= 0)
}

// Counter ids of the host_counters map, re-exported from enum host_counter in host.c.
const (
	CounterXSK  = int(HostHostCounterHOST_CNT_XSK)  // results handed to the AF_XDP socket map
	CounterPass = int(HostHostCounterHOST_CNT_PASS) // frames passed to the kernel
	numCounters = int(HostHostCounterHOST_CNT_MAX)
)

// ErrConfig is returned for a Config xdpagg_host cannot serve.
var ErrConfig = errors.New("invalid host program configuration")

// Load loads xdpagg_host for c into the kernel. The caller attaches Objects.XdpaggHost to the
// interface (native mode), puts its AF_XDP socket into Objects.Xsks at its queue index, and
// closes the objects when done.
func Load(c Config) (*HostObjects, error) {
	if !c.Addr.Addr().Unmap().Is4() || c.Addr.Port() == 0 || c.JobID == 0 {
		return nil, fmt.Errorf("%w: %v job %d: need an IPv4 address, a port and a nonzero job", ErrConfig, c.Addr, c.JobID)
	}
	spec, err := LoadHost()
	if err != nil {
		return nil, fmt.Errorf("host program spec: %w", err)
	}
	ip := c.Addr.Addr().Unmap().As4()
	p := c.Addr.Port()
	// The program compares these with packet fields, which are in network byte order: store
	// values whose in-memory bytes are that order.
	vars := map[string]any{
		HostVarWorkerIp:   binary.NativeEndian.Uint32(ip[:]),
		HostVarWorkerPort: binary.NativeEndian.Uint16([]byte{byte(p >> 8), byte(p)}),
		HostVarJobId:      c.JobID,
	}
	for name, v := range vars {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("set %s: %w", name, err)
		}
	}
	var objs HostObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return nil, fmt.Errorf("load xdpagg_host: %w", err)
	}
	return &objs, nil
}

// Counters returns the program's counters summed over CPUs, indexed by Counter*.
func (o *HostObjects) Counters() ([numCounters]uint64, error) {
	var out [numCounters]uint64
	for id := range uint32(numCounters) {
		var per []uint64
		if err := o.HostCounters.Lookup(id, &per); err != nil {
			return out, fmt.Errorf("read host counter %d: %w", id, err)
		}
		for _, v := range per {
			out[id] += v
		}
	}
	return out, nil
}
