// Package host holds xdpagg_host, the XDP program of a worker host whose worker receives its
// results through AF_XDP (hostlib.WorkerConfig.AFXDP): it redirects the worker's job's results
// into the worker's AF_XDP socket and passes everything else to the kernel.
package host

//go:generate go tool bpf2go -go-package host -output-stem host -tags linux -target bpfel Host host.c -- -I../include -O2 -g -Wall -Werror
