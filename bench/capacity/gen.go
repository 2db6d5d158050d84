package capacity

//go:generate go tool bpf2go -go-package capacity -output-stem xdptx -tags linux -target bpfel Xdptx xdptx.c -- -I../../bpf/include -O2 -g -Wall -Werror
