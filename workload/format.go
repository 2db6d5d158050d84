package workload

import (
	"bufio"
	"compress/flate"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// magic opens every decompressed trace file; its last byte is the format version.
const magic = "XAGGTRC1"

// Write writes t to w in the trace file format (see the package documentation). It refuses a
// trace that Validate rejects, since Read would reject the file.
func (t *Trace) Write(w io.Writer) error {
	if err := t.Validate(); err != nil {
		return err
	}
	// No name or modification time in the gzip header: the same trace always gives the same bytes.
	gz, err := gzip.NewWriterLevel(w, gzip.BestCompression)
	if err != nil {
		return fmt.Errorf("write trace: %w", err)
	}
	bw := bufio.NewWriter(gz)
	var hdr []byte
	hdr = append(hdr, magic...)
	hdr = binary.LittleEndian.AppendUint16(hdr, uint16(len(t.Name)))
	hdr = append(hdr, t.Name...)
	hdr = binary.LittleEndian.AppendUint64(hdr, t.KeySpace)
	hdr = binary.LittleEndian.AppendUint32(hdr, uint32(len(t.Iters)))
	hdr = binary.LittleEndian.AppendUint32(hdr, uint32(t.Workers()))
	if _, err := bw.Write(hdr); err != nil {
		return fmt.Errorf("write trace: %w", err)
	}
	var buf []byte
	for _, it := range t.Iters {
		for _, b := range it {
			buf = binary.AppendUvarint(buf[:0], uint64(len(b)))
			for j, k := range b {
				if j == 0 {
					buf = binary.AppendUvarint(buf, k)
				} else {
					buf = binary.AppendUvarint(buf, k-b[j-1]-1)
				}
			}
			if _, err := bw.Write(buf); err != nil {
				return fmt.Errorf("write trace: %w", err)
			}
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("write trace: %w", err)
	}
	if err := gz.Close(); err != nil {
		return fmt.Errorf("write trace: %w", err)
	}
	return nil
}

// Save writes t to the file at path. It writes a temporary file next to it and renames it into
// place, so that a failed or interrupted Save never leaves a truncated trace behind.
func (t *Trace) Save(path string) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("save trace: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := t.Write(f); err != nil {
		return fmt.Errorf("save trace %s: %w", path, err)
	}
	// CreateTemp makes the file 0600; a trace is data to share, like any file the user creates.
	if err := f.Chmod(0o644); err != nil {
		return fmt.Errorf("save trace: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("save trace: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("save trace: %w", err)
	}
	return nil
}

// Load reads the trace file at path.
func Load(path string) (*Trace, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("load trace: %w", err)
	}
	defer f.Close()
	t, err := Read(f)
	if err != nil {
		return nil, fmt.Errorf("load trace %s: %w", path, err)
	}
	return t, nil
}

// Read reads a trace in the trace file format (see the package documentation). Malformed input,
// including a truncated or corrupt gzip stream, gives an error wrapping ErrBadTrace; an error of
// r itself is wrapped as it is.
func Read(r io.Reader) (*Trace, error) {
	gz, err := gzip.NewReader(r)
	if err != nil {
		return nil, badInput(err)
	}
	d := decoder{r: bufio.NewReader(gz)}
	t, err := d.trace()
	if err != nil {
		return nil, err
	}
	// Read to the end even though the content is complete: gzip checks its CRC and length only
	// there, and anything after the last batch is corruption too.
	if _, err := d.r.ReadByte(); err == nil {
		return nil, fmt.Errorf("%w: data after the last batch", ErrBadTrace)
	} else if !errors.Is(err, io.EOF) {
		return nil, badInput(err)
	}
	return t, nil
}

// badInput wraps a read error: the gzip layer's complaints and an early end of input are the
// file's fault (ErrBadTrace); anything else comes from the underlying reader and keeps its own
// identity.
func badInput(err error) error {
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("%w: truncated", ErrBadTrace)
	case errors.Is(err, gzip.ErrHeader), errors.Is(err, gzip.ErrChecksum):
		return fmt.Errorf("%w: %w", ErrBadTrace, err)
	}
	var corrupt flate.CorruptInputError
	if errors.As(err, &corrupt) {
		return fmt.Errorf("%w: %w", ErrBadTrace, err)
	}
	return fmt.Errorf("read trace: %w", err)
}

// decoder reads the decompressed content of a trace file.
type decoder struct {
	r *bufio.Reader
}

func (d *decoder) full(n int) ([]byte, error) {
	b := make([]byte, n) // n is at most MaxNameLen or 8: callers check it first
	if _, err := io.ReadFull(d.r, b); err != nil {
		return nil, badInput(err)
	}
	return b, nil
}

// uvarint reads a uvarint, rejecting overlong encodings so that every trace has exactly one
// encoding (Read then Write gives back the same content).
func (d *decoder) uvarint() (uint64, error) {
	var x uint64
	for i := 0; ; i++ {
		c, err := d.r.ReadByte()
		if err != nil {
			return 0, badInput(err)
		}
		if i == binary.MaxVarintLen64-1 && c > 1 {
			return 0, fmt.Errorf("%w: uvarint overflows 64 bits", ErrBadTrace)
		}
		if c < 0x80 {
			if c == 0 && i > 0 {
				return 0, fmt.Errorf("%w: overlong uvarint", ErrBadTrace)
			}
			return x | uint64(c)<<(7*i), nil
		}
		x |= uint64(c&0x7f) << (7 * i)
	}
}

func (d *decoder) trace() (*Trace, error) {
	m, err := d.full(len(magic))
	if err != nil {
		return nil, err
	}
	if string(m) != magic {
		return nil, fmt.Errorf("%w: bad magic %q", ErrBadTrace, m)
	}
	b, err := d.full(2)
	if err != nil {
		return nil, err
	}
	nameLen := int(binary.LittleEndian.Uint16(b))
	if nameLen > MaxNameLen {
		return nil, fmt.Errorf("%w: name of %d bytes exceeds %d", ErrBadTrace, nameLen, MaxNameLen)
	}
	name, err := d.full(nameLen)
	if err != nil {
		return nil, err
	}
	b, err = d.full(16)
	if err != nil {
		return nil, err
	}
	keySpace := binary.LittleEndian.Uint64(b)
	iters := uint64(binary.LittleEndian.Uint32(b[8:]))
	workers := uint64(binary.LittleEndian.Uint32(b[12:]))
	switch {
	case (iters == 0) != (workers == 0):
		return nil, fmt.Errorf("%w: %d iterations of %d workers", ErrBadTrace, iters, workers)
	case workers > MaxWorkers:
		return nil, fmt.Errorf("%w: %d workers exceed %d", ErrBadTrace, workers, MaxWorkers)
	case iters*workers > MaxBatches: // both < 2^32: no overflow
		return nil, fmt.Errorf("%w: %d iterations of %d workers exceed %d batches", ErrBadTrace, iters, workers, MaxBatches)
	}
	t := &Trace{Name: string(name), KeySpace: keySpace}
	// Grown per iteration decoded, not sized from the header: a header claiming many iterations
	// over a short stream costs nothing.
	var keys uint64
	for i := uint64(0); i < iters; i++ {
		it := make([][]uint64, workers) // at most MaxWorkers slice headers per iteration decoded
		for w := range it {
			n, err := d.uvarint()
			if err != nil {
				return nil, err
			}
			if n > keySpace || n > MaxKeys-keys {
				return nil, fmt.Errorf("%w: iteration %d worker %d: %d keys do not fit", ErrBadTrace, i, w, n)
			}
			keys += n
			batch, err := d.batch(n, keySpace)
			if err != nil {
				return nil, fmt.Errorf("iteration %d worker %d: %w", i, w, err)
			}
			it[w] = batch
		}
		t.Iters = append(t.Iters, it)
	}
	return t, nil
}

// batch reads n delta-coded keys below keySpace. n is checked against MaxKeys but not against the
// input: the slice starts small and grows with the keys actually read, at least one byte each.
func (d *decoder) batch(n, keySpace uint64) ([]uint64, error) {
	if n == 0 {
		return nil, nil
	}
	b := make([]uint64, 0, min(n, 1024))
	for j := uint64(0); j < n; j++ {
		v, err := d.uvarint()
		if err != nil {
			return nil, err
		}
		var k uint64
		if j == 0 {
			k = v
		} else {
			prev := b[j-1]
			// k = prev + 1 + v must stay below keySpace; prev < keySpace, so no overflow here.
			if v >= keySpace-prev-1 {
				return nil, fmt.Errorf("%w: key beyond key space %d", ErrBadTrace, keySpace)
			}
			k = prev + 1 + v
		}
		if k >= keySpace {
			return nil, fmt.Errorf("%w: key %d outside key space %d", ErrBadTrace, k, keySpace)
		}
		b = append(b, k)
	}
	return b, nil
}
