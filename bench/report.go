package bench

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"slices"
	"sort"
	"strconv"
	"text/tabwriter"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Table prints every cell, then xdpagg's ratio to each other mode.
func (r *Report) Table(w io.Writer) {
	fmt.Fprintf(w, "machine: %s; MTU %d\n", r.Machine, r.MTU)
	for _, m := range knownModes() {
		if e, ok := r.Environments[m]; ok {
			fmt.Fprintf(w, "  %-6s runs on %s\n", m, e)
		}
	}
	if r.LinkShaping != "" {
		fmt.Fprintf(w, "  link rates (column \"link\"): %s\n", r.LinkShaping)
	}
	fmt.Fprintln(w, "  CPU s/GB: the mode's own CPU per GB reduced per worker, split into the workers' and the switch's side:")
	for _, m := range knownModes() {
		if e, ok := r.CPUSplit[m]; ok {
			fmt.Fprintf(w, "    %-6s %s\n", m, e)
		}
	}
	fmt.Fprintf(w, "  cores busy: busy CPU-time (/proc/stat, everyone's load) of %s over the wall time of the cell's timed runs,\n"+
		"    ± the standard deviation that /proc/stat's 10 ms units alone cause\n", r.countedCPUs())
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tW\tsize\tlink\tmedian ms\tp10 ms\tp90 ms\telements/s\talgbw GB/s\tCPU s/GB\tworker\tswitch\tcores busy\tverified\t")
	for _, c := range r.Cells {
		if c.Error != "" {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\tFAILED: %s\t\t\t\t\t\t\t\t\t\t\n", c.Mode, c.Workers, humanBytes(c.Bytes), FormatRate(c.LinkRate), c.Error)
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%.3f\t%.3f\t%.3f\t%.3g\t%.3f\t%.2f\t%s\t%s\t%.2f±%.2f/%d\t%v\t\n", c.Mode, c.Workers, humanBytes(c.Bytes),
			FormatRate(c.LinkRate), 1e3*c.Median, 1e3*c.P10, 1e3*c.P90, c.ElementsPerSec, c.AlgBWGBps, c.CPUSecPerGB,
			optional(c.WorkerCPUPerGB), optional(c.SwitchCPUPerGB), c.CoresBusy, c.CoresBusyErr, r.countedCores(), c.Verified)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nxdpagg speed-up over each mode (time(other)/time(xdpagg) over paired rounds; >1: xdpagg faster);")
	fmt.Fprintln(w, "on shaped links, the link-bound theory (ring, gloo: 2(W-1)/W; ps: W) and the median's distance from it")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "vs\tW\tsize\tlink\tmedian\tp10\tp90\ttheory\tvs theory\t")
	for _, x := range r.Ratios {
		if x.Mode != ModeXdpagg {
			continue
		}
		th, from := "", ""
		if x.Theory > 0 {
			th, from = fmt.Sprintf("%.2fx", x.Theory), fmt.Sprintf("%+.0f%%", 100*x.FromTheory)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%.2fx\t%.2fx\t%.2fx\t%s\t%s\t\n", x.Other, x.Workers, humanBytes(x.Bytes),
			FormatRate(x.LinkRate), x.Median, x.P10, x.P90, th, from)
	}
	tw.Flush()
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}

// countedCPUs says which CPUs the cells' CoresBusy counts.
func (r *Report) countedCPUs() string {
	if len(r.CPUs) > 0 {
		return fmt.Sprintf("CPU(s) %s, to which every process of every mode was pinned (%d online)", FormatCPUList(r.CPUs), r.Cores)
	}
	return fmt.Sprintf("all %d online CPUs (nothing pinned)", r.Cores)
}

// countedCores is how many CPUs the cells' CoresBusy counts.
func (r *Report) countedCores() int {
	if len(r.CPUs) > 0 {
		return len(r.CPUs)
	}
	return r.Cores
}

// optional formats a figure that may be absent ("-").
func optional(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.2f", *v)
}

var modeColors = map[string]color.Color{
	ModeXdpagg:    color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	ModeXdpaggUDP: color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff},
	ModePS:        color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	ModeRing:      color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	ModeGloo:      color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
}

// Plot writes a PNG with two panels: aggregated elements/s against tensor size (at the W closest
// to 4) and against W (at the size closest to 4 MiB), of the unshaped cells (or, without any, of
// the lowest link rate's).
func (r *Report) Plot(path string) error {
	var ws, sizes []int
	var rates []uint64
	for _, c := range r.Cells {
		if !slices.Contains(rates, c.LinkRate) {
			rates = append(rates, c.LinkRate)
		}
	}
	if len(rates) == 0 {
		return fmt.Errorf("plot: no measurements")
	}
	rate := slices.Min(rates)
	for _, c := range r.Cells {
		if c.LinkRate != rate {
			continue
		}
		if !slices.Contains(ws, c.Workers) {
			ws = append(ws, c.Workers)
		}
		if !slices.Contains(sizes, c.Bytes) {
			sizes = append(sizes, c.Bytes)
		}
	}
	if len(ws) == 0 {
		return fmt.Errorf("plot: no measurements")
	}
	sort.Ints(ws)
	sort.Ints(sizes)
	pickW := closest(ws, 4)
	pickB := closest(sizes, 4<<20)

	bySize := plot.New()
	link := ""
	if rate != 0 {
		link = ", links " + FormatRate(rate)
	}
	bySize.Title.Text = fmt.Sprintf("allreduce throughput vs size (W=%d%s)", pickW, link)
	bySize.X.Label.Text = "tensor size (bytes, log)"
	bySize.Y.Label.Text = "aggregated elements/s (log)"
	bySize.X.Scale, bySize.Y.Scale = plot.LogScale{}, plot.LogScale{}
	bySize.X.Tick.Marker, bySize.Y.Tick.Marker = logTicks{}, logTicks{}
	byW := plot.New()
	byW.Title.Text = fmt.Sprintf("allreduce throughput vs workers (%s%s)", humanBytes(pickB), link)
	byW.X.Label.Text = "workers"
	byW.Y.Label.Text = "aggregated elements/s"
	for _, p := range []*plot.Plot{bySize, byW} {
		p.Legend.Top = true
		p.Add(plotter.NewGrid())
	}

	for _, m := range knownModes() {
		var s, w plotter.XYs
		for _, c := range r.Cells {
			if c.Mode != m || c.ElementsPerSec == 0 || c.LinkRate != rate {
				continue
			}
			if c.Workers == pickW {
				s = append(s, plotter.XY{X: float64(c.Bytes), Y: c.ElementsPerSec})
			}
			if c.Bytes == pickB {
				w = append(w, plotter.XY{X: float64(c.Workers), Y: c.ElementsPerSec})
			}
		}
		for _, set := range []struct {
			p   *plot.Plot
			xys plotter.XYs
		}{{bySize, s}, {byW, w}} {
			if len(set.xys) == 0 {
				continue
			}
			l, pts, err := plotter.NewLinePoints(set.xys)
			if err != nil {
				return fmt.Errorf("plot %s: %w", m, err)
			}
			l.Color, pts.Color = modeColors[m], modeColors[m]
			l.Width = vg.Points(2)
			set.p.Add(l, pts)
			set.p.Legend.Add(m, l, pts)
		}
	}

	img := vgimg.New(vg.Points(1100), vg.Points(420))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Points(20), PadY: vg.Points(10), PadTop: vg.Points(10), PadBottom: vg.Points(10), PadLeft: vg.Points(10), PadRight: vg.Points(10)}
	canvases := plot.Align([][]*plot.Plot{{bySize, byW}}, tiles, dc)
	bySize.Draw(canvases[0][0])
	byW.Draw(canvases[0][1])
	f, err := createFile(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

func closest(xs []int, target int) int {
	best := xs[0]
	for _, x := range xs {
		if abs(x-target) < abs(best-target) {
			best = x
		}
	}
	return best
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

func createFile(path string) (io.WriteCloser, error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", path, err)
	}
	return f, nil
}

// logTicks labels 1, 2 and 5 times each power of ten, so a log axis spanning less than a decade
// still has labels (plot.LogTicks labels powers of ten only).
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	var out []plot.Tick
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if v < lo || v > hi {
				continue
			}
			out = append(out, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'g', 3, 64)})
		}
	}
	return out
}
