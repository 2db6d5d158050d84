package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/maps"
)

// feedCache moves results from the switch's `results` ring buffer into the caches (store files
// each record) until ctx is done. The reader is closed on return.
func feedCache(ctx context.Context, results *ebpf.Map, store func(rec []byte, now time.Time) error, log *slog.Logger) error {
	rd, err := ringbuf.NewReader(results)
	if err != nil {
		return fmt.Errorf("open the results ring buffer: %w", err)
	}
	go func() {
		<-ctx.Done()
		rd.Close() // unblocks Read
	}()
	var rec ringbuf.Record
	for {
		if err := rd.ReadInto(&rec); err != nil {
			if errors.Is(err, ringbuf.ErrClosed) || ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("read the results ring buffer: %w", err)
		}
		if err := store(rec.RawSample, time.Now()); err != nil {
			log.Warn("result record dropped", "err", err)
		}
	}
}

// CacheStatsMap is the name of the agent's pinned cache statistics map, next to the switch's maps.
const CacheStatsMap = maps.CacheStatsName

// publishCacheStats creates the one-entry `cache_stats` map, pins it under dir/maps, and rewrites
// it (and sweeps the cache by age) every interval until ctx is done; then it unpins and closes it.
func publishCacheStats(ctx context.Context, dir string, c *ResultCache, interval time.Duration) (func(), error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{
		Name: CacheStatsMap, Type: ebpf.Array, KeySize: 4,
		ValueSize: uint32(binary.Size(bpf.XdpaggCacheStats{})), MaxEntries: 1,
	})
	if err != nil {
		return nil, fmt.Errorf("create %s map: %w", CacheStatsMap, err)
	}
	pin := filepath.Join(dir, "maps", CacheStatsMap)
	_ = os.Remove(pin) // left by a run that was killed: this run's statistics replace it
	if err := m.Pin(pin); err != nil {
		m.Close()
		return nil, fmt.Errorf("pin %s map: %w", CacheStatsMap, err)
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			now := time.Now()
			c.Sweep(now)
			st := c.Stats()
			_ = m.Put(uint32(0), &st) // best effort: inspection only
			select {
			case <-ctx.Done():
				return
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() {
		close(done)
		<-stopped
		_ = m.Unpin()
		_ = os.Remove(filepath.Join(dir, "maps", CacheStatsMap))
		m.Close()
	}, nil
}
