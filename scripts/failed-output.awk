# Reads `go test -v` output and prints, for every test that failed, every line it wrote (its
# t.Log/t.Errorf/t.Fatalf messages, a panic's trace): `make test` filters its figure tests' -v
# output down to the figures, and this puts back what a red run needs to say why.
# go test -v names the test that the lines after it belong to ("=== RUN", "=== CONT", "=== NAME",
# "=== PAUSE"), so lines are kept per test and printed, in the order the tests started, for those
# with a "--- FAIL" line. With several packages go test prints each package's output in one
# piece, ending with its verdict ("ok", "FAIL"): the tests are kept per package, so two
# packages' tests of one name stay apart. A panic (a test timeout's too, which lists the tests
# still running after it) is kept with the test that was running.
function flush(pkg,   i, t) {
	for (i = 1; i <= n; i++) {
		t = order[i]
		if (t in failed) {
			printf "=== output of failed test %s%s\n%s", t, pkg, buf[t]
		}
	}
	delete seen; delete order; delete buf; delete failed
	n = 0; cur = ""
}
/^=== (RUN|CONT|NAME|PAUSE) / {
	cur = $3
	if (!(cur in seen)) { seen[cur] = 1; order[++n] = cur }
	next
}
/^(ok|FAIL)[ \t]+[^ \t]+[ \t]/ { flush(" (" $2 ")"); next }
{ buf[cur] = buf[cur] $0 "\n" }
/^[[:space:]]*--- FAIL: / { failed[$3] = 1 }
/^(panic|fatal error):/ { failed[cur] = 1 }
END { flush("") }
