// Command xdpagg runs and inspects the xdpagg in-network aggregation switch.
//
//	xdpagg switch  --iface p0,p1 [--name default] [--ready-file F] ...   run a switch (verb: changes state)
//	xdpagg inspect [--name default] [--json] [--slots]                 read a live switch (noun)
//	xdpagg job add --id N --workers W --ps IP[:PORT] | list [--json] | rm --id N   admit/list/end jobs
//	xdpagg demo    [--workers 4] [--values N] [--json]                 embedded netns topology + allreduce
//	xdpagg bench   [--modes ...] [--sizes ...] [--workers ...] [--json]  side-by-side benchmark
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
)

type command struct {
	name    string
	summary string
	run     func(args []string, stdout io.Writer) error
}

var commands = []command{
	{"switch", "attach the XDP switch to interfaces and serve until SIGINT/SIGTERM", runSwitch},
	{"inspect", "show a running switch's counters, slots, members and sparse jobs' registers", runInspect},
	{"job", "admit (add), list or end (rm) jobs on a running switch", runJob},
	{"demo", "build a netns topology, run a verified allreduce through the switch, tear down (--sparse: a sparse model's trace)", runDemo},
	{"bench", "compare xdpagg with a parameter server, ring allreduce and Gloo side by side (--sparse: sparse vs PS-only vs dense)", runBench},
	{"controller", "own switch groups and their jobs: heartbeat, replicate, fail over (--config); or just heartbeat (--switch)", runController},
	{"reset", "ask the running controller to clear a job's slots, registers and counters on both switches of its group", runReset},
	{"failover", "ask the running controller to drain a group's active switch and move the group to its other switch", runFailover},
}

// errUsage marks errors whose message is the whole story (bad flags): no extra prefix.
var errUsage = errors.New("usage")

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: xdpagg <command> [flags]\n\ncommands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nrun 'xdpagg <command> -h' for its flags")
}

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, nil)))
	if len(os.Args) < 2 {
		usage(os.Stderr)
		os.Exit(2)
	}
	name := os.Args[1]
	if name == "-h" || name == "--help" || name == "help" {
		usage(os.Stdout)
		return
	}
	for _, c := range commands {
		if c.name != name {
			continue
		}
		err := c.run(os.Args[2:], os.Stdout)
		switch {
		case err == nil:
			return
		case errors.Is(err, flag.ErrHelp):
			return
		case errors.Is(err, errUsage):
			fmt.Fprintf(os.Stderr, "xdpagg %s: %v\n", name, err)
			os.Exit(2)
		default:
			// %+v: a verifier error prints its full log.
			fmt.Fprintf(os.Stderr, "xdpagg %s: %+v\n", name, err)
			os.Exit(1)
		}
	}
	fmt.Fprintf(os.Stderr, "xdpagg: unknown command %q\n\n", name)
	usage(os.Stderr)
	os.Exit(2)
}

// parseFlags parses a command's flags and rejects stray arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	fs.SetOutput(os.Stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q (flags go before nothing else; see -h)", errUsage, fs.Arg(0))
	}
	return nil
}
