package topo

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// writeSysctl writes value to the sysctl key ("net.ipv4.ip_forward") of the calling thread's
// network namespace: /proc/sys/net is resolved per thread, so call it inside Do.
func writeSysctl(key, value string) error {
	path := filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
	if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", key, value, err)
	}
	return nil
}

// disableIPv6 turns IPv6 off in the calling thread's namespace, so no router solicitations, MLD
// reports or DAD probes reach the XDP programs under test. A kernel without IPv6 is fine.
func disableIPv6() error {
	for _, key := range []string{"net.ipv6.conf.all.disable_ipv6", "net.ipv6.conf.default.disable_ipv6"} {
		if err := writeSysctl(key, "1"); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

// ethtoolValue is struct ethtool_value.
type ethtoolValue struct {
	cmd  uint32
	data uint32
}

// ifreqData is struct ifreq with ifr_data set (40 bytes on 64-bit Linux).
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [24 - unsafe.Sizeof(uintptr(0))]byte
}

// ethtoolSet issues the ethtool "set" command cmd (ETHTOOL_S*) with value on interface ifname of
// the calling thread's network namespace (the SIOCETHTOOL ioctl acts in the socket's namespace,
// and the socket is created here).
func ethtoolSet(ifname string, cmd, value uint32) error {
	if len(ifname) >= unix.IFNAMSIZ {
		return fmt.Errorf("interface name %q too long", ifname)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("ethtool socket: %w", err)
	}
	defer unix.Close(fd)
	val := &ethtoolValue{cmd: cmd, data: value}
	ifr := &ifreqData{data: unsafe.Pointer(val)}
	copy(ifr.name[:], ifname)
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(ifr)))
	runtime.KeepAlive(ifr)
	runtime.KeepAlive(val)
	if errno != 0 {
		return fmt.Errorf("ethtool command %#x=%d on %s: %w", cmd, value, ifname, errno)
	}
	return nil
}

// ethtoolGet issues the ethtool "get" command cmd (ETHTOOL_G*) on ifname and returns its value.
func ethtoolGet(ifname string, cmd uint32) (uint32, error) {
	if len(ifname) >= unix.IFNAMSIZ {
		return 0, fmt.Errorf("interface name %q too long", ifname)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("ethtool socket: %w", err)
	}
	defer unix.Close(fd)
	val := &ethtoolValue{cmd: cmd}
	ifr := &ifreqData{data: unsafe.Pointer(val)}
	copy(ifr.name[:], ifname)
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(ifr)))
	runtime.KeepAlive(ifr)
	runtime.KeepAlive(val)
	if errno != 0 {
		return 0, fmt.Errorf("ethtool command %#x on %s: %w", cmd, ifname, errno)
	}
	return val.data, nil
}

// tuneVeth applies the offload settings every veth of a topology needs, on interface ifname of the
// calling thread's namespace: TX checksum offload off (a socket on veth leaves a partial UDP
// checksum that the receiver drops once an XDP program rewrote the packet) and GRO on (veth then
// runs NAPI, so XDP_REDIRECT into it works even without an XDP program on its peer).
func tuneVeth(ifname string) error {
	if err := ethtoolSet(ifname, unix.ETHTOOL_STXCSUM, 0); err != nil {
		return fmt.Errorf("disable TX checksum offload: %w", err)
	}
	if err := ethtoolSet(ifname, unix.ETHTOOL_SGRO, 1); err != nil {
		return fmt.Errorf("enable GRO: %w", err)
	}
	return nil
}
