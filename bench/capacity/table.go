//go:build linux

package capacity

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"

	"github.com/xdpagg/xdpagg/bpf"
)

// Table writes r as a readable table. Write errors are ignored (it is a report).
func (r Result) Table(w io.Writer) {
	o := r.Options
	fmt.Fprintf(w, "xdpagg switch capacity: %d values/packet, %d workers, window %d, batch %d, %v per live run, CPU %d\n",
		o.Values, o.Workers, o.Window, o.Batch, o.Duration, r.CPU)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "live frames, one core\tpackets/s\telements/s\t\n")
	fmt.Fprintf(tw, "xdpagg_switch, aggregation mix\t%s\t%s\t\n", si(r.AggPPS), si(r.AggElementsPerSec))
	fmt.Fprintf(tw, "payload-copy ceiling (xdp_copy)\t%s\t%s\t\n", si(r.CeilingPPS), si(r.CeilingElementsPerSec))
	fmt.Fprintf(tw, "bare XDP_TX\t%s\t\t\n", si(r.TxPPS))
	fmt.Fprintf(tw, "generator + XDP_TX\t%s\t\t\n", si(r.GenTxPPS))
	fmt.Fprintf(tw, "results delivered to hosts\t%s\t\t\n", si(r.HostRxPPS))
	fmt.Fprintf(tw, "aggregation / ceiling (target >= 0.7)\t%.3f\t\t\n", r.OfCeiling)
	fmt.Fprintf(tw, "ratio switch / XDP_TX\t%.3f\t\t\n", r.Ratio)
	tw.Flush()

	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "Program.Run path\tns/packet\t\n")
	for _, k := range sortedKeys(r.RunNsPerPacket, PathAggregate, PathComplete, PathDuplicate, PathNonAgg, PathGenerator) {
		fmt.Fprintf(tw, "%s\t%.1f\t\n", k, r.RunNsPerPacket[k])
	}
	tw.Flush()

	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "program\tinstructions\tverifier-processed\t\n")
	names := []string{bpf.XdpaggProgXdpaggSwitch, bpf.XdpaggProgXdpaggEgress, bpf.XdpaggProgXdpaggPass}
	for _, k := range sortedKeys(r.Insns, names...) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t\n", k, r.Insns[k], r.VerifiedInsns[k])
	}
	tw.Flush()
}

// sortedKeys returns the keys of m: first those of order that m has, then the rest sorted.
func sortedKeys[V any](m map[string]V, order ...string) []string {
	var out, rest []string
	for _, k := range order {
		if _, ok := m[k]; ok {
			out = append(out, k)
		}
	}
	for k := range m {
		if !slices.Contains(order, k) {
			rest = append(rest, k)
		}
	}
	slices.Sort(rest)
	return append(out, rest...)
}

// si formats v with three significant digits and an SI suffix.
func si(v float64) string {
	for _, u := range []struct {
		div float64
		suf string
	}{{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}} {
		if v >= u.div {
			return fmt.Sprintf("%.3g%s", v/u.div, u.suf)
		}
	}
	return fmt.Sprintf("%.3g", v)
}
