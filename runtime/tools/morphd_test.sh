#!/usr/bin/env bash
# morphd: prints its addresses as one JSON line, stops on SIGTERM with exit 0, refuses bad
# flags with exit 2 and a message naming the flag, and a missing token with a message.
set -u
MORPHD="$1"
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT
pid=""

echo "secret-token" > "$tmp/token"
env -u MORPH_TOKEN "$MORPHD" --token-file "$tmp/token" --initial-world 2 >"$tmp/out" 2>"$tmp/err" &
pid=$!
for _ in $(seq 100); do [ -s "$tmp/out" ] && break; sleep 0.05; done
line=$(head -1 "$tmp/out")
[[ "$line" =~ ^\{\"control\":\"127\.0\.0\.1:[0-9]+\",\"store\":\"127\.0\.0\.1:[0-9]+\",\"http_port\":[0-9]+\}$ ]] ||
  fail "unexpected first line: '$line' ($(cat "$tmp/err"))"
http_port=$(sed -E 's/.*"http_port":([0-9]+).*/\1/' <<<"$line")
[ "$http_port" -gt 0 ] || fail "no scheduler API port in '$line'"
kill -TERM $pid
for _ in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.05; done
kill -0 $pid 2>/dev/null && fail "morphd still runs 5 s after SIGTERM"
wait $pid; rc=$?
[ $rc -eq 0 ] || fail "exit status $rc after SIGTERM, expected 0"
pid=""

env -u MORPH_TOKEN -u MORPH_TOKEN_FILE "$MORPHD" >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 2 ] || fail "no token: exit $rc, expected 2"
grep -q "MORPH_TOKEN" "$tmp/err" || fail "no token: message does not name MORPH_TOKEN: $(cat "$tmp/err")"

MORPH_TOKEN=x "$MORPHD" --port 70000 >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 2 ] || fail "--port 70000: exit $rc, expected 2"
grep -q -- "--port" "$tmp/err" || fail "--port 70000: message does not name the flag"
echo "morphd_test: ok"
