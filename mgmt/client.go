package mgmt

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// call makes one exchange on a fresh connection: the request (op, args) sealed with a new stamp,
// the response opened and checked to answer it, its result decoded into out (if not nil).
func (c *Client) call(ctx context.Context, op string, args, out any) error {
	req := request{Op: op}
	if args != nil {
		b, err := json.Marshal(args)
		if err != nil {
			return fmt.Errorf("mgmt %s: encode: %w", op, err)
		}
		req.Args = b
	}
	body, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("mgmt %s: encode: %w", op, err)
	}
	if _, ok := ctx.Deadline(); !ok {
		t := c.Timeout
		if t <= 0 {
			t = DefaultTimeout
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t)
		defer cancel()
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", c.addr.String())
	if err != nil {
		return fmt.Errorf("mgmt %s: connect to %v: %w", op, c.addr, err)
	}
	defer conn.Close()
	dl, _ := ctx.Deadline()
	_ = conn.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { conn.Close() }) // cancellation interrupts reads
	defer stop()

	stamp := c.stamper.Next()
	payload, err := seal(c.keys.req, stamp, body)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(conn)
	if err := writeFrame(w, payload); err != nil {
		return fmt.Errorf("mgmt %s: send to %v: %w", op, c.addr, err)
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("mgmt %s: send to %v: %w", op, c.addr, ctxErr(ctx, err))
	}
	in, err := readFrame(bufio.NewReader(conn))
	if err != nil {
		if errors.Is(err, io.EOF) {
			// The agent closes the connection on a request it does not accept.
			return fmt.Errorf("mgmt %s: %v closed the connection without an answer (request refused as not authentic or stale?): %w", op, c.addr, ErrFrame)
		}
		return fmt.Errorf("mgmt %s: answer from %v: %w", op, c.addr, ctxErr(ctx, err))
	}
	rstamp, rbody, err := open(c.keys.resp, in)
	if err != nil {
		return fmt.Errorf("mgmt %s: answer from %v: %w", op, c.addr, err)
	}
	if err := fresh(rstamp, time.Now()); err != nil {
		return fmt.Errorf("mgmt %s: answer from %v: %w", op, c.addr, err)
	}
	var resp response
	if err := json.Unmarshal(rbody, &resp); err != nil {
		return fmt.Errorf("mgmt %s: answer from %v: %w: %w", op, c.addr, ErrFrame, err)
	}
	if resp.Re != stamp {
		return fmt.Errorf("mgmt %s: answer from %v is for request %d, not %d: %w", op, c.addr, resp.Re, stamp, ErrAuth)
	}
	switch resp.Kind {
	case "":
	case kindRefused:
		return fmt.Errorf("mgmt %s: %w: %s", op, ErrRefused, resp.Err)
	case kindIncompatible:
		return fmt.Errorf("mgmt %s: %w: %s", op, ErrIncompatible, resp.Err)
	default:
		return fmt.Errorf("mgmt %s: %w: %s", op, ErrFailed, resp.Err)
	}
	if out != nil {
		if err := json.Unmarshal(resp.Result, out); err != nil {
			return fmt.Errorf("mgmt %s: result from %v: %w: %w", op, c.addr, ErrFrame, err)
		}
	}
	return nil
}

// ctxErr prefers the context's error (deadline, cancellation) to the I/O error it caused.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%v)", ctx.Err(), err)
	}
	return err
}
