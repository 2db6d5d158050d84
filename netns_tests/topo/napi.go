package topo

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// SetThreadedNAPI turns threaded NAPI on or off (/sys/class/net/<dev>/threaded) on every veth of
// the topology that has NAPI: the switch's ports and every host's HostIfname. With it on, a veth's
// receive processing (its XDP program included) runs in a kernel thread of its own, which the
// scheduler places, instead of in the softirq of whichever task sent the packet.
func (t *Topology) SetThreadedNAPI(on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	byNS := map[string][]string{}
	for _, p := range t.ports {
		byNS[p.ns] = append(byNS[p.ns], p.name)
	}
	for _, h := range t.Hosts() {
		byNS[h.NSName] = append(byNS[h.NSName], h.Ifname)
	}
	for ns, devs := range byNS {
		nsh, ok := t.nsHandles[ns]
		if !ok {
			return fmt.Errorf("threaded NAPI: namespace %s not open", ns)
		}
		err := inNetSysfs(nsh, func(sys string) error {
			for _, d := range devs {
				if err := os.WriteFile(filepath.Join(sys, "class", "net", d, "threaded"), []byte(v), 0); err != nil {
					return fmt.Errorf("%s: %w", d, err)
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("threaded NAPI in %s: %w", ns, err)
		}
	}
	return nil
}

// inNetSysfs runs fn with the directory of a sysfs that shows the network devices of namespace
// nsh. sysfs shows those of the namespace that mounted it, so fn runs on a thread of its own: a
// private mount namespace, the target network namespace, and a fresh sysfs mount there. That
// thread is never unlocked: it ends with its goroutine rather than return to Go's pool in another
// mount namespace.
func inNetSysfs(nsh netns.NsHandle, fn func(sys string) error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		done <- func() error {
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				return fmt.Errorf("unshare mount namespace: %w", err)
			}
			if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
				return fmt.Errorf("make mounts private: %w", err)
			}
			if err := netns.Set(nsh); err != nil {
				return fmt.Errorf("enter network namespace: %w", err)
			}
			dir, err := os.MkdirTemp("", "xdpagg-sysfs-")
			if err != nil {
				return err
			}
			defer os.Remove(dir)
			if err := unix.Mount("sysfs", dir, "sysfs", 0, ""); err != nil {
				return fmt.Errorf("mount sysfs: %w", err)
			}
			defer unix.Unmount(dir, unix.MNT_DETACH)
			return fn(dir)
		}()
	}()
	return <-done
}
