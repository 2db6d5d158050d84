package hostlib

import (
	"encoding/binary"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/bpf"
	"github.com/xdpagg/xdpagg/ctlauth"
	"github.com/xdpagg/xdpagg/wire"
)

// Member-assisted Help, the worker's side (docs/protocol.md, HELP). A joined worker keeps the
// results it received lately, and answers the switch agent's MSG_HELP for one of them with its
// values, so that a member that lost a result the switch no longer holds (its retransmit cache
// off, full or lost in a failover; the slot's shadow copy reused) still gets it. No member can be
// more than a window of fragments ahead of another (each sum needs every member's data), so the
// last 2*Window results hold every result another member can still be missing.

// startKeeping allocates the ring of kept results: 2*Window entries of ValuesPerPacket values.
// Called with mu held, at the worker's first Join.
func (w *Worker) startKeeping() {
	n, k := 2*w.cfg.Window, 4*w.cfg.ValuesPerPacket
	slab := make([]byte, n*k)
	w.kept = make([]keptResult, n)
	for i := range w.kept {
		w.kept[i].vals = slab[i*k : (i+1)*k : (i+1)*k]
	}
	w.helpBuf = make([]byte, 0, wire.HdrSize+wire.HelpBodySize+4*wire.HelpPartValues+ctlauth.TrailerSize)
}

// keep copies a result just taken into the ring: one copy of the values per result on the hot
// path, which is what the ring costs (see docs/protocol.md, HELP). A result with F_OVERFLOW is no
// sum and is not kept (its float repair is). Called with mu held.
func (w *Worker) keep(h *wire.Header, vals []byte) {
	n := 4 * int(h.Count)
	if h.Flags&wire.FlagOverflow != 0 || n > len(vals) || n > cap(w.kept[0].vals) {
		return
	}
	e := &w.kept[h.Seq%uint32(len(w.kept))]
	e.ok, e.h = true, *h
	e.vals = e.vals[:n]
	copy(e.vals, vals[:n])
}

// handleHelp answers the switch agent's MSG_HELP (b, parsed into h, from `from`): accepted only
// as the agent's other messages are (handleHalt), and answered only with a result this worker
// keeps, in parts of at most wire.HelpPartValues values, each sealed under JobKey. A request for a
// result it does not keep gets no answer: another member may have it, and the requester's data
// timer goes on. Called with mu held (the answer is sent at once: Help is rare, and the requester
// is stalled until it comes).
func (w *Worker) handleHelp(b []byte, h *wire.Header, from *unix.RawSockaddrInet4) {
	if !w.agentMessage(b, h, from) {
		return
	}
	var e *keptResult
	if w.kept != nil {
		e = &w.kept[h.Seq%uint32(len(w.kept))]
	}
	if e == nil || !e.ok || e.h.Seq != h.Seq || !w.ctrlSet {
		w.st.helpUnknown.Add(1)
		return
	}
	total := int(e.h.Count)
	for off := 0; off < total; off += wire.HelpPartValues {
		n := min(wire.HelpPartValues, total-off)
		ph := e.h
		ph.Type, ph.Count, ph.WorkerId = wire.MsgHelp, uint16(n), w.cfg.WorkerID
		ph.Flags &^= wire.FlagShadow | wire.FlagCached
		msg := wire.AppendHeader(w.helpBuf[:0], &ph)
		msg, err := binary.Append(msg, binary.LittleEndian, &bpf.XdpaggHelpBody{Total: uint16(total), Offset: uint16(off)})
		if err != nil {
			return // unreachable: a fixed-size struct
		}
		msg = append(msg, e.vals[4*off:4*(off+n)]...)
		out, err := ctlauth.Seal(w.cfg.JobKey, msg, w.stamper.Next())
		if err != nil {
			return // unreachable: ctrlSet needs a successful Join, which needs a valid key
		}
		if _, err := w.bc.conn.WriteToUDPAddrPort(out, w.ctrl); err != nil {
			w.st.sendErrors.Add(1)
			return
		}
	}
	w.st.helpAnswers.Add(1)
}
