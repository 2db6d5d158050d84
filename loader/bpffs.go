package loader

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// CheckBPFFS reports whether dir is on a bpffs mount, where pins can be made.
func CheckBPFFS(dir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrNotBPFFS, dir, err)
	}
	if st.Type != unix.BPF_FS_MAGIC {
		return fmt.Errorf("%w: %s (mount one with: mount -t bpf bpf %s)", ErrNotBPFFS, dir, dir)
	}
	return nil
}

// MountBPFFS makes sure dir exists and is on a bpffs, mounting one if it is not:
//
//   - dir on a bpffs already (a mount, or a directory inside one): nothing to mount.
//   - dir created, or already there as an empty directory, elsewhere: a bpffs is mounted on dir
//     itself (a private pin root, e.g. a test's temporary directory). A directory with entries is
//     refused: a mount would hide them.
//   - dir cannot be created because its nearest existing ancestor is an empty sysfs directory: a
//     bpffs is mounted on that ancestor and dir is created inside. Such a directory is a mount
//     point the kernel provides for a pseudo filesystem, /sys/fs/bpf on a machine where nothing
//     mounted a bpffs there (no systemd, a minimal VM or container): sysfs allows no mkdir, so
//     the default pin root /sys/fs/bpf/xdpagg could not be made otherwise, and /sys/fs/bpf is
//     where every BPF tool expects the bpffs. Any other ancestor is never mounted over (an
//     uncreatable /tmp/a/b stays an error): only sysfs's empty directories exist to be mounted on.
func MountBPFFS(dir string) error {
	dir = filepath.Clean(dir)
	mkErr := os.MkdirAll(dir, 0o700)
	if mkErr == nil {
		if CheckBPFFS(dir) == nil {
			return nil
		}
		if empty, err := emptyDir(dir); err != nil {
			return fmt.Errorf("mount bpffs at %s: %w", dir, err)
		} else if !empty {
			return fmt.Errorf("mount bpffs at %s: the directory is not empty (a mount would hide its entries)", dir)
		}
		return mountBPF(dir)
	}
	anc, ok := sysfsMountPoint(dir)
	if !ok {
		return fmt.Errorf("create %s: %w", dir, mkErr)
	}
	if err := mountBPF(anc); err != nil {
		return fmt.Errorf("create %s: %w; %w", dir, mkErr, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s after mounting a bpffs at %s: %w", dir, anc, err)
	}
	return CheckBPFFS(dir)
}

// mountBPF mounts a bpffs at dir. Losing a race to another process that mounted one there first
// is fine.
func mountBPF(dir string) error {
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		if CheckBPFFS(dir) == nil {
			return nil
		}
		return fmt.Errorf("mount bpffs at %s: %w", dir, err)
	}
	return nil
}

// sysfsMountPoint returns the nearest existing ancestor of dir if it is an empty sysfs directory
// (a kernel-provided mount point such as /sys/fs/bpf with nothing mounted on it).
func sysfsMountPoint(dir string) (string, bool) {
	anc := dir
	for {
		parent := filepath.Dir(anc)
		if parent == anc {
			return "", false // "/" exists, so dir itself must have been there: not this case
		}
		anc = parent
		if _, err := os.Stat(anc); err == nil {
			break
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", false
		}
	}
	var st unix.Statfs_t
	if err := unix.Statfs(anc, &st); err != nil || st.Type != unix.SYSFS_MAGIC {
		return "", false
	}
	if empty, err := emptyDir(anc); err != nil || !empty {
		return "", false // sysfs's own directories (devices, attributes) are never mounted over
	}
	return anc, true
}

// emptyDir reports whether dir is a directory without entries.
func emptyDir(dir string) (bool, error) {
	f, err := os.Open(dir)
	if err != nil {
		return false, err
	}
	defer f.Close()
	if _, err := f.Readdirnames(1); err != nil {
		if errors.Is(err, io.EOF) {
			return true, nil
		}
		return false, err
	}
	return false, nil
}
