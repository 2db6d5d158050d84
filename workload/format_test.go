package workload

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// equalTraces reports whether a and b hold the same name, key space and batches; nil and empty
// batches are the same (Read gives nil for an empty batch).
func equalTraces(a, b *Trace) bool {
	if a.Name != b.Name || a.KeySpace != b.KeySpace || len(a.Iters) != len(b.Iters) {
		return false
	}
	for i := range a.Iters {
		if !slices.EqualFunc(a.Iters[i], b.Iters[i], func(x, y []uint64) bool { return slices.Equal(x, y) }) {
			return false
		}
	}
	return true
}

// sampleTraces are small traces exercising the format's corners.
func sampleTraces(t testing.TB) []*Trace {
	gen, err := Generate(GenConfig{Workers: 3, Iterations: 4, KeysPerBatch: 50, KeySpace: 1000, Skew: 1.2, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	return []*Trace{
		{Name: "", KeySpace: 0},
		{Name: "empty batches", KeySpace: 0, Iters: [][][]uint64{{nil, {}}, {{}, nil}}},
		{Name: "edges ünïcode", KeySpace: 1<<64 - 1, Iters: [][][]uint64{
			{{0, 1, 2, 1<<64 - 2}, {1<<63 - 1, 1 << 63}},
			{{127, 128, 16383, 16384}, {}},
		}},
		{Name: strings.Repeat("n", MaxNameLen), KeySpace: 1, Iters: [][][]uint64{{{0}}}},
		gen,
	}
}

// encode returns the Write encoding of t.
func encode(t testing.TB, tr *Trace) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := tr.Write(&b); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// gz compresses raw content, for building corrupt files by hand.
func gz(raw []byte) []byte {
	var b bytes.Buffer
	w := gzip.NewWriter(&b)
	w.Write(raw)
	w.Close()
	return b.Bytes()
}

// gunzip returns the decompressed content of a trace file written by Write.
func gunzip(t testing.TB, file []byte) []byte {
	t.Helper()
	r, err := gzip.NewReader(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func TestRoundTrip(t *testing.T) {
	for _, tr := range sampleTraces(t) {
		file := encode(t, tr)
		got, err := Read(bytes.NewReader(file))
		if err != nil {
			t.Fatalf("%.20q: %v", tr.Name, err)
		}
		if !equalTraces(tr, got) {
			t.Errorf("%.20q: read back a different trace", tr.Name)
		}
		// Writing is deterministic, so files can be compared and committed.
		if again := encode(t, got); !bytes.Equal(file, again) {
			t.Errorf("%.20q: rewriting gives different bytes", tr.Name)
		}
	}
}

func TestSaveLoad(t *testing.T) {
	tr := sampleTraces(t)[4]
	path := filepath.Join(t.TempDir(), "x.trace.gz")
	if err := tr.Save(path); err != nil {
		t.Fatal(err)
	}
	got, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if !equalTraces(tr, got) {
		t.Error("loaded a different trace")
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("Save left %d files, want 1", len(entries))
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Load of a missing file: %v, want ErrNotExist", err)
	}
	bad := &Trace{KeySpace: 1, Iters: [][][]uint64{{{1}}}}
	if err := bad.Save(filepath.Join(t.TempDir(), "bad")); !errors.Is(err, ErrBadTrace) {
		t.Errorf("Save of an invalid trace: %v, want ErrBadTrace", err)
	}
}

func TestWriteRejectsInvalid(t *testing.T) {
	for name, tr := range map[string]*Trace{
		"key outside":      {KeySpace: 10, Iters: [][][]uint64{{{10}}}},
		"unsorted":         {KeySpace: 10, Iters: [][][]uint64{{{3, 2}}}},
		"duplicate":        {KeySpace: 10, Iters: [][][]uint64{{{2, 2}}}},
		"ragged":           {KeySpace: 10, Iters: [][][]uint64{{{1}, {2}}, {{1}}}},
		"no workers":       {KeySpace: 10, Iters: [][][]uint64{{}}},
		"long name":        {Name: strings.Repeat("x", MaxNameLen+1)},
		"too many workers": {KeySpace: 10, Iters: [][][]uint64{make([][]uint64, MaxWorkers+1)}},
		"too many batches": {KeySpace: 10, Iters: slices.Repeat([][][]uint64{make([][]uint64, MaxWorkers)}, MaxBatches/MaxWorkers+1)},
	} {
		if err := tr.Write(io.Discard); !errors.Is(err, ErrBadTrace) {
			t.Errorf("%s: Write gave %v, want ErrBadTrace", name, err)
		}
	}
}

// header builds the decompressed header of a trace file.
func header(name string, keySpace uint64, iters, workers uint32) []byte {
	b := []byte(magic)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(name)))
	b = append(b, name...)
	b = binary.LittleEndian.AppendUint64(b, keySpace)
	b = binary.LittleEndian.AppendUint32(b, iters)
	return binary.LittleEndian.AppendUint32(b, workers)
}

func cat(parts ...[]byte) []byte { return slices.Concat(parts...) }

func TestReadRejectsCorrupt(t *testing.T) {
	good := encode(t, sampleTraces(t)[2])
	raw := gunzip(t, good)
	crc := slices.Clone(good)
	crc[len(crc)-8] ^= 1 // the gzip trailer's CRC-32
	cases := map[string][]byte{
		"empty":            nil,
		"not gzip":         []byte("XAGGTRC1 but not compressed"),
		"bad crc":          crc,
		"bad magic":        gz(cat([]byte("XAGGTRC2"), raw[8:])),
		"trailing byte":    gz(cat(raw, []byte{0})),
		"long name":        gz(cat(header(strings.Repeat("x", MaxNameLen+1), 1, 0, 0))),
		"iters no workers": gz(header("", 1, 1, 0)),
		"workers no iters": gz(header("", 1, 0, 1)),
		"many workers":     gz(header("", 1, 1, MaxWorkers+1)),
		"many batches":     gz(header("", 1, MaxBatches/MaxWorkers+1, MaxWorkers)),
		"short of iters":   gz(cat(header("", 10, MaxBatches, 1), []byte{0, 0, 0})),
		"count > space":    gz(cat(header("", 2, 1, 1), []byte{3, 0, 0, 0})),
		"count > MaxKeys":  gz(cat(header("", 1<<40, 1, 1), binary.AppendUvarint(nil, MaxKeys+1))),
		"huge count short": gz(cat(header("", 1<<40, 1, 1), binary.AppendUvarint(nil, MaxKeys), []byte{1, 2, 3})),
		"first key out":    gz(cat(header("", 5, 1, 1), []byte{1, 5})),
		"gap out":          gz(cat(header("", 5, 1, 1), []byte{2, 3, 1})),
		"gap overflow":     gz(cat(header("", 1<<64-1, 1, 1), []byte{2, 5}, binary.AppendUvarint(nil, 1<<64-1))),
		"overlong uvarint": gz(cat(header("", 5, 1, 1), []byte{1, 0x81, 0x00})),
		"uvarint > 64 bit": gz(cat(header("", 1<<64-1, 1, 1), []byte{1}, bytes.Repeat([]byte{0xff}, 9), []byte{2})),
		"11-byte uvarint":  gz(cat(header("", 1<<64-1, 1, 1), []byte{1}, bytes.Repeat([]byte{0x80}, 10), []byte{1})),
	}
	// Every strict prefix of a good file, compressed or not, is truncated.
	for n := 0; n < len(raw); n++ {
		cases[fmt.Sprintf("content prefix %d", n)] = gz(raw[:n])
	}
	for n := 0; n < len(good); n++ {
		cases[fmt.Sprintf("file prefix %d", n)] = good[:n]
	}
	for name, file := range cases {
		if tr, err := Read(bytes.NewReader(file)); !errors.Is(err, ErrBadTrace) {
			t.Errorf("%s: Read gave (%v, %v), want ErrBadTrace", name, tr != nil, err)
		}
	}
}

// errReader fails every read with errBroken.
type errReader struct{}

var errBroken = errors.New("broken pipe")

func (errReader) Read([]byte) (int, error) { return 0, errBroken }

func TestReadKeepsReaderErrors(t *testing.T) {
	_, err := Read(errReader{})
	if !errors.Is(err, errBroken) || errors.Is(err, ErrBadTrace) {
		t.Errorf("Read of a failing reader: %v, want errBroken and not ErrBadTrace", err)
	}
}

// FuzzRead checks that Read never panics, that whatever it accepts is a valid trace that writes
// back to the same content, and that its allocations stay proportional to the decompressed input.
func FuzzRead(f *testing.F) {
	for _, tr := range sampleTraces(f) {
		f.Add(encode(f, tr))
	}
	f.Add(gz(cat(header("", 1<<40, 1, 1), binary.AppendUvarint(nil, MaxKeys), []byte{1, 2, 3})))
	f.Add(gz(cat(header("x", 100, 2, 2), []byte{1, 5, 0, 2, 0, 0, 3, 1, 2, 3})))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, file []byte) {
		// How much the input decompresses to bounds what Read may allocate: gzip's own state,
		// one slice header per batch (at least one byte each) and two words per key (at least one
		// byte each, slices grown by doubling), with room to spare.
		var size int64
		if zr, err := gzip.NewReader(bytes.NewReader(file)); err == nil {
			size, _ = io.Copy(io.Discard, io.LimitReader(zr, 1<<26))
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		tr, err := Read(bytes.NewReader(file))
		runtime.ReadMemStats(&after)
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20+64*uint64(size) {
			t.Fatalf("Read allocated %d bytes for %d decompressed bytes", alloc, size)
		}
		if err != nil {
			if !errors.Is(err, ErrBadTrace) {
				t.Fatalf("Read error %v does not wrap ErrBadTrace", err)
			}
			return
		}
		if err := tr.Validate(); err != nil {
			t.Fatalf("Read accepted an invalid trace: %v", err)
		}
		// The encoding is canonical: the decompressed content comes back byte for byte.
		if !bytes.Equal(gunzip(t, encode(t, tr)), gunzip(t, file)) {
			t.Fatal("Write after Read changes the content")
		}
	})
}
