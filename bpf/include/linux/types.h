/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Minimal stand-in for the kernel's <linux/types.h>: the fixed-width types the vendored UAPI
 * <linux/bpf.h> and libbpf headers need. Vendored so that `make generate` depends on clang only,
 * not on linux-libc-dev or the host architecture's <asm/types.h>. */
#ifndef __XDPAGG_LINUX_TYPES_H
#define __XDPAGG_LINUX_TYPES_H

typedef unsigned char __u8;
typedef signed char __s8;
typedef unsigned short __u16;
typedef signed short __s16;
typedef unsigned int __u32;
typedef signed int __s32;
typedef unsigned long long __u64;
typedef signed long long __s64;

typedef __u16 __le16;
typedef __u16 __be16;
typedef __u32 __le32;
typedef __u32 __be32;
typedef __u64 __le64;
typedef __u64 __be64;
typedef __u16 __sum16;
typedef __u32 __wsum;

#define __bitwise
#define __aligned_u64 __u64 __attribute__((aligned(8)))

#endif
