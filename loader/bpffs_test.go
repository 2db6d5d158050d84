package loader_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/xdpagg/xdpagg/loader"
)

// The child half of TestMountBPFFSOnBareSysfs runs when this variable holds the parent's mount
// namespace (the inode of /proc/self/ns/mnt): the child refuses to touch mounts unless its own
// namespace differs.
const bareSysfsChildEnv = "XDPAGG_TEST_BARE_SYSFS_PARENT_MNTNS"

// mountNS returns the inode of this process's mount namespace.
func mountNS(t *testing.T) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/mnt", &st); err != nil {
		t.Fatalf("stat /proc/self/ns/mnt: %v", err)
	}
	return st.Ino
}

// fsTypesAt lists the filesystem types mounted at dir, bottom first, in this mount namespace.
func fsTypesAt(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for line := range strings.Lines(string(b)) {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) > 4 && len(g) > 0 && f[4] == dir {
			out = append(out, g[0])
		}
	}
	return out
}

func fsType(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		t.Fatalf("statfs %s: %v", path, err)
	}
	return st.Type
}

// On a machine where nothing mounted a bpffs at /sys/fs/bpf (a fresh VM without systemd, a
// minimal container), /sys/fs/bpf is an empty sysfs directory in which nothing can be created:
// `xdpagg switch` failed with "mkdir /sys/fs/bpf/xdpagg: no such file or directory". MountBPFFS
// must mount a bpffs there and create the pin root inside; it must never mount over any other
// directory it cannot create a path in.
//
// The real host's mounts are left alone: the checks run in a child process (this test binary
// again) in a new mount namespace whose mounts are private (os/exec makes "/" MS_REC|MS_PRIVATE
// after unsharing, and the child does it once more), where /sys/fs/bpf is unmounted first.
func TestMountBPFFSOnBareSysfs(t *testing.T) {
	if parent := os.Getenv(bareSysfsChildEnv); parent != "" {
		bareSysfsChild(t, parent)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestMountBPFFSOnBareSysfs$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", bareSysfsChildEnv, mountNS(t)))
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	before := fsTypesAt(t, "/sys/fs/bpf")
	out, err := cmd.CombinedOutput()
	t.Logf("child in a private mount namespace:\n%s", out)
	if err != nil {
		t.Fatalf("child: %v", err)
	}
	if !strings.Contains(string(out), "--- PASS: TestMountBPFFSOnBareSysfs") {
		t.Fatalf("the child did not run the checks")
	}
	if after := fsTypesAt(t, "/sys/fs/bpf"); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("the host's mounts at /sys/fs/bpf changed: %v -> %v", before, after)
	}
}

func bareSysfsChild(t *testing.T, parentNS string) {
	if strconv.FormatUint(mountNS(t), 10) == parentNS {
		t.Fatal("child is still in the parent's mount namespace: refusing to touch mounts")
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		t.Fatalf("make / rprivate: %v", err)
	}
	const bpfDir = "/sys/fs/bpf"
	if _, err := os.Stat(bpfDir); err != nil {
		t.Fatalf("%s: %v (the kernel makes it when it has BPF)", bpfDir, err)
	}
	// Take away every bpffs stacked on /sys/fs/bpf: the fresh machine's state.
	for i := 0; fsType(t, bpfDir) == unix.BPF_FS_MAGIC; i++ {
		if err := unix.Unmount(bpfDir, unix.MNT_DETACH); err != nil || i > 10 {
			t.Fatalf("unmount %s: %v", bpfDir, err)
		}
	}
	if fsType(t, bpfDir) != unix.SYSFS_MAGIC {
		t.Fatalf("%s is not on sysfs once its bpffs mounts are gone (mounts %v): the kernel makes it a sysfs directory", bpfDir, fsTypesAt(t, bpfDir))
	}
	root := filepath.Join(bpfDir, fmt.Sprintf("xdpagg-test-%d", os.Getpid()))
	if err := os.Mkdir(root, 0o700); err == nil {
		t.Fatalf("created %s on bare sysfs: the kernel allows it, nothing to test", root)
	} else {
		t.Logf("as on a fresh machine: %v", err)
	}

	dir := filepath.Join(root, "sub")
	if err := loader.MountBPFFS(dir); err != nil {
		t.Fatalf("MountBPFFS(%s) on bare sysfs: %v", dir, err)
	}
	if got := fsTypesAt(t, bpfDir); len(got) != 1 || got[0] != "bpf" {
		t.Errorf("mounts at %s: %v, want one bpf", bpfDir, got)
	}
	if err := loader.CheckBPFFS(dir); err != nil {
		t.Errorf("CheckBPFFS(%s): %v", dir, err)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		t.Errorf("pin root %s: %v", dir, err)
	}
	// Again (a second switch, or a restart): nothing more is mounted.
	if err := loader.MountBPFFS(filepath.Join(root, "other")); err != nil {
		t.Errorf("second MountBPFFS: %v", err)
	}
	if got := fsTypesAt(t, bpfDir); len(got) != 1 {
		t.Errorf("mounts at %s after a second MountBPFFS: %v, want one", bpfDir, got)
	}

	// What cannot be created elsewhere stays an error, with nothing mounted.
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	full := t.TempDir()
	if err := os.WriteFile(filepath.Join(full, "keep"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ dir, ancestor, why string }{
		{"/sys/kernel/xdpagg-test/pins", "/sys/kernel", "a sysfs directory with entries"},
		{"/proc/xdpagg-test/pins", "/proc", "procfs"},
		{filepath.Join(file, "pins"), filepath.Dir(file), "a regular file in the way"},
		{full, full, "an existing directory with entries"},
	} {
		before := fsTypesAt(t, c.ancestor)
		if err := loader.MountBPFFS(c.dir); err == nil {
			t.Errorf("MountBPFFS(%s) (%s) succeeded", c.dir, c.why)
		} else {
			t.Logf("MountBPFFS(%s) (%s): %v", c.dir, c.why, err)
		}
		if after := fsTypesAt(t, c.ancestor); len(after) != len(before) {
			t.Errorf("MountBPFFS(%s) (%s) mounted on %s: %v -> %v", c.dir, c.why, c.ancestor, before, after)
		}
		if fsType(t, c.ancestor) == unix.BPF_FS_MAGIC {
			t.Errorf("%s is a bpffs after MountBPFFS(%s) (%s)", c.ancestor, c.dir, c.why)
		}
	}
}
