package workload

import (
	"bytes"
	"embed"
	"fmt"
	"sort"
	"strings"
)

// recorded holds the traces recorded from a real sparse model (testdata/README.md says how).
//
//go:embed testdata/*.trace.gz
var recorded embed.FS

// RecordedNames lists the embedded recorded traces ("ctr_w8", ...).
func RecordedNames() []string {
	ents, _ := recorded.ReadDir("testdata")
	var out []string
	for _, e := range ents {
		if n, ok := strings.CutSuffix(e.Name(), ".trace.gz"); ok {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}

// Recorded returns the embedded recorded trace of that name (see RecordedNames).
func Recorded(name string) (*Trace, error) {
	b, err := recorded.ReadFile("testdata/" + name + ".trace.gz")
	if err != nil {
		return nil, fmt.Errorf("%w: no recorded trace %q (have %v)", ErrBadTrace, name, RecordedNames())
	}
	return Read(bytes.NewReader(b))
}
