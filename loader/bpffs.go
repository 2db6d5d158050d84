package loader

import (
	"fmt"
	"os"

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

// MountBPFFS makes sure dir exists and is a bpffs mount, mounting one there if it is not.
func MountBPFFS(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	if CheckBPFFS(dir) == nil {
		return nil
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", dir, err)
	}
	return nil
}
