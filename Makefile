# xdpagg. The two commands a fresh machine needs: `make demo` and `make test` (as root).
SHELL := /bin/bash
GO ?= go
export PATH := $(PATH):/usr/local/go/bin
BIN := bin/xdpagg
TEST_TIMEOUT ?= 40m
# Go's SIMD experiment (simd/archsimd): hostlib's fixed-point codec runs on AVX2 with it, 1.26x
# faster end to end at W = 4, 4 MiB (docs/benchmarks.md, Fast path); without it (or on a CPU
# without AVX2) the scalar twin runs, with the same results. GOEXPERIMENT= make ... builds without.
export GOEXPERIMENT ?= simd

.PHONY: all deps deps-clang deps-bench generate check-generated build test demo demo-sparse bench bench-sparse lint clean

all: build

deps:
	@scripts/deps.sh

deps-clang:
	@scripts/deps.sh --clang

# Regenerate the BPF objects and Go bindings (needs clang; commit the result).
deps-bench:
	@scripts/deps.sh --bench

generate: deps-clang
	$(GO) generate ./bpf/... ./bench/capacity/...

# Regenerate and fail if the committed objects are stale (CI runs this when clang is present).
check-generated: generate
	@git diff --exit-code --stat -- bpf/ bench/capacity/ || { echo "generated BPF files are stale: run 'make generate' and commit" >&2; exit 1; }

build:
	$(GO) build -o $(BIN) ./cmd/xdpagg

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed: $$out" >&2; exit 1; fi
	$(GO) vet ./...

# The tests whose figures `make test` prints (go test hides passing tests' output), and what
# they print. They run once, in the second command, with -v; the first runs everything else
# (-skip). Anchored, so a name elsewhere that merely contains one of these is not skipped.
FIGURE_TESTS := ^(TestSwitchModel|TestFaultScenarios|TestRetransmitCacheRecoversOneWorkersLosses|TestCongestion.*|TestAttack.*|TestSparse(Exact|LossAndDuplication|OnlineSwap|ModelRandom|CacheRecovery|FailoverDrained)|TestVerifierInstructionCounts|TestAgentRestartKeepsJobs|TestResetMidJob|TestHaltJob|TestControllerDetectsFailure|TestAsyncTraining|TestSetHAndFBcast|TestFailover.*|TestHelpRecoversFromMembers|TestMgmtChannel|TestTenantFloodHelpCacheJoin)$$
FIGURES := differential model check|exact  slots leaked|retransmit cache:|congestion:|forged results:|join takeover:|spoofed data:|options and fragments:|direct results:|control flood:|tenant flood:|job stopped with|worker pairs hot/cold|resends [0-9]+; switch duplicates|swap to version|hot pairs after the swap|recirculation histogram|attacker sent [0-9]+ frames; switch|processed by the verifier|agent restarted|reset: [0-9]+ resets|halt: every member|controller: failure detected|async vs sync convergence|SETH 3->2->3 and FBCAST|member-assisted help|ScopeAll snapshot:|primary killed:|primary degraded:|fail-back by hand:|controller restarted, then primary killed:|forged resends:|sparse cache:|sparse failover:|tenant flood of help/cache/join

# The Gloo baseline's tests need python3-torch, so tests install the bench dependencies too.
test: deps-bench lint
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) -skip '$(FIGURE_TESTS)' ./...
	@# pipefail: the line fails when the tests fail, not only when grep does. grep exits 1 when
	@# no line matches, e.g. a figure a passing test no longer prints: only that status is
	@# forgiven (2, a grep error, is not). Failing tests' names are kept ("--- FAIL"), and the
	@# packages' verdicts but for those with no figure test ("[no tests to run]"). The whole -v
	@# output goes to a file too; when the line fails, every failed test's own lines (its
	@# t.Errorf/t.Fatalf messages, a panic) are printed from it (scripts/failed-output.awk).
	log=$$(mktemp); trap 'rm -f "$$log"' EXIT; set -o pipefail; \
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) -run '$(FIGURE_TESTS)' -v ./... | tee "$$log" | { grep -E '$(FIGURES)|^[[:space:]]*--- FAIL|^(FAIL|panic)|^ok .*s$$' || [ $$? -eq 1 ]; } \
	|| { rc=$$?; awk -f scripts/failed-output.awk "$$log"; exit $$rc; }

demo: deps build
	./$(BIN) demo

# The sparse (hot-parameter) demo: a recorded sparse-model trace, every key of every update checked.
demo-sparse: deps build
	./$(BIN) demo --sparse

# Side-by-side benchmark (xdpagg, user-space PS, ring, Gloo): table on stdout, bench-out/bench.{json,png}.
# W = 2, 4, 8 at 40 KB, 4 MiB and 64 MiB, unshaped and with every host link shaped to
# BENCH_LINK_RATES (each direction, every mode's topology alike), the ratios with p10-p90 and, shaped,
# against the link-bound 2(W-1)/W; then the 0.1%-loss cost and the switch capacity with its
# payload-copy ceiling. 200 Mbit/s keeps even W = 8 link-bound on a 2-core machine. Expected
# duration on an idle 2-core VM: about 20-25 minutes (unshaped about 4, shaped about 16: its 64 MiB
# cells dominate, where the PS's one link carries W x 64 MiB each way).
BENCH_FLAGS ?=
BENCH_LINK_RATES ?= none,200mbit
bench: deps-bench build
	./$(BIN) bench --out bench-out --with-capacity --mtu 3388 --link-rate $(BENCH_LINK_RATES) $(BENCH_FLAGS)

# Sparse benchmark (Zebra Figs. 6, 9, 10; sparse xdpagg vs PS-only vs dense xdpagg): table on stdout,
# bench-out/bench-sparse.json.
bench-sparse: deps build
	./$(BIN) bench --sparse --out bench-out $(BENCH_FLAGS)

clean:
	rm -rf bin
