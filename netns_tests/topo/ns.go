package topo

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// NetnsDir is where named network namespaces live (the directory `ip netns` uses; /var/run is a
// symlink to /run).
const NetnsDir = "/run/netns"

// NewPrefix returns a fresh topology prefix: "xa" and 6 random hex digits, so that concurrent
// tests and runs never collide on namespace names.
func NewPrefix() string {
	var b [3]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go >= 1.24)
	return "xa" + hex.EncodeToString(b[:])
}

// Leftovers returns the sorted names of the named network namespaces whose names start with
// prefix. Tests use it to prove that a topology left nothing behind.
func Leftovers(prefix string) ([]string, error) {
	entries, err := os.ReadDir(NetnsDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list network namespaces: %w", err)
	}
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			out = append(out, e.Name())
		}
	}
	slices.Sort(out)
	return out, nil
}

// panicError carries a panic of fn out of the helper goroutine, to be re-raised in the caller.
type panicError struct{ v any }

// onLockedThread runs fn on a fresh goroutine locked to its OS thread after enter has moved that
// thread into another network namespace, and waits for it. Afterwards the thread goes back to the
// namespace it started in; when that fails the goroutine exits still locked, so the runtime
// terminates the thread instead of reusing it in the wrong namespace. The caller's goroutine never
// changes thread or namespace. A panic in fn is re-raised in the caller.
func onLockedThread(enter func() error, fn func() error) error {
	done := make(chan error, 1)
	var panicked *panicError
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("get the thread's network namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := enter(); err != nil {
			// A failed setns/unshare leaves the thread where it was, but make sure.
			if rerr := netns.Set(orig); rerr != nil {
				done <- errors.Join(err, fmt.Errorf("restore the thread's network namespace: %w", rerr))
				return // still locked: the thread is discarded
			}
			runtime.UnlockOSThread()
			done <- err
			return
		}
		var ferr error
		func() {
			defer func() {
				if v := recover(); v != nil {
					panicked = &panicError{v}
				}
			}()
			ferr = fn()
		}()
		if rerr := netns.Set(orig); rerr != nil {
			done <- errors.Join(ferr, fmt.Errorf("restore the thread's network namespace: %w", rerr))
			return // still locked: the thread is discarded
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	err := <-done
	if panicked != nil {
		panic(panicked.v)
	}
	return err
}

// Do runs fn on an OS thread inside the named network namespace nsName (a name under
// /run/netns) and returns its error. Sockets that fn creates stay in that namespace after it
// returns. Goroutines that fn starts do NOT run in the namespace. The caller's goroutine and
// thread never change namespace.
func Do(nsName string, fn func() error) error {
	target, err := netns.GetFromName(nsName)
	if err != nil {
		return fmt.Errorf("open network namespace %q: %w", nsName, err)
	}
	defer target.Close()
	return DoHandle(target, fn)
}

// DoHandle is Do for an open namespace handle.
func DoHandle(target netns.NsHandle, fn func() error) error {
	return onLockedThread(func() error {
		if err := netns.Set(target); err != nil {
			return fmt.Errorf("enter network namespace: %w", err)
		}
		return nil
	}, fn)
}

// newNamed creates the named network namespace name (like `ip netns add`) and returns an open
// handle to it. created reports whether the name was taken by this call (and so must be deleted by
// the caller even if err != nil); a name that already exists is an error and is left alone.
func newNamed(name string) (h netns.NsHandle, created bool, err error) {
	h = netns.None()
	if err := os.MkdirAll(NetnsDir, 0o755); err != nil {
		return h, false, fmt.Errorf("create %s: %w", NetnsDir, err)
	}
	path := filepath.Join(NetnsDir, name)
	err = onLockedThread(func() error {
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("unshare network namespace: %w", err)
		}
		return nil
	}, func() error {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
		if err != nil {
			return fmt.Errorf("create network namespace %q: %w", name, err)
		}
		f.Close()
		created = true
		self := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		if err := unix.Mount(self, path, "none", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind-mount network namespace %q: %w", name, err)
		}
		h, err = netns.GetFromPath(path)
		if err != nil {
			return fmt.Errorf("open network namespace %q: %w", name, err)
		}
		return nil
	})
	return h, created, err
}

// deleteNamed removes a named network namespace made by newNamed (like `ip netns delete`). The
// namespace itself goes away when nothing else (sockets, open handles, processes) holds it.
func deleteNamed(name string) error {
	path := filepath.Join(NetnsDir, name)
	var errs []error
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		// EINVAL: not a mount point (the bind mount failed or is already gone).
		errs = append(errs, fmt.Errorf("unmount network namespace %q: %w", name, err))
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove network namespace %q: %w", name, err))
	}
	return errors.Join(errs...)
}
