// Package bpf holds the xdpagg XDP programs, compiled by bpf2go, and the wire types shared with
// them. The C header xdpagg.h is the single source of the wire format: the Go types below come
// from it through bpf2go -type.
package bpf

//go:generate go tool bpf2go -go-package bpf -output-stem xdpagg -target bpfel -type hdr -type join_body -type help_body -type result_rec -type cache_stats -type ctl_auth -type gc_args -type sparse_hdr -type kv_pair -type cold_pair -type reg_read -type heartbeat_stats -type slot_op -type seth_body Xdpagg xdpagg.c -- -I./include -O2 -g -Wall -Werror
