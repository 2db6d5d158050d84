package main

import (
	"errors"
	"io"
	"testing"

	"github.com/xdpagg/xdpagg/bench"
)

// A link rate that is not one is a usage error, and one out of range a configuration error,
// before anything is built.
func TestBenchLinkRateUsage(t *testing.T) {
	for bad, want := range map[string]error{"fast": errUsage, "1gb": errUsage, "10kbit": bench.ErrConfig} {
		if err := runBench([]string{"--link-rate", bad, "--out", t.TempDir()}, io.Discard); !errors.Is(err, want) {
			t.Errorf("--link-rate %s: %v, want %v", bad, err, want)
		}
	}
}
