#!/usr/bin/env bash
# libmorph exports the public API and nothing else: every symbol `nm -D --defined-only` lists is
# in namespace morph and names something declared in include/morph/ (NCCL's libnccl.map keeps
# its exports the same way). Prints the exports it found; fails naming each one that is not.
# Usage: surface_symbols_test.sh <libmorph.so> <source-dir>
set -euo pipefail
lib=$1
src=$2
fail() { echo "surface_symbols_test: $*" >&2; exit 1; }
[ -f "$lib" ] || fail "no $lib"
command -v nm >/dev/null || fail "nm not found (binutils)"
syms=$(nm -D --defined-only --demangle "$lib" | awk '{ $1 = ""; $2 = ""; sub(/^  /, ""); print }' |
       grep -vE '^(_init|_fini|_edata|_end|__bss_start|MORPH_[0-9.]+)$' | sort -u)
[ -n "$syms" ] || fail "no symbol exported"
# The names the public headers declare (types, functions, operators).
declared=$(cat "$src"/include/morph/*.h | grep -oE '\b[A-Z][A-Za-z0-9_]*\b|\boperator(<<|==)' | sort -u)
bad=0
n=0
while IFS= read -r s; do
  n=$((n + 1))
  # The type information of a public class: judged by the class's name.
  s=${s#typeinfo name for }
  s=${s#typeinfo for }
  s=${s#vtable for }
  case $s in
    morph::*) ;;
    # The one C export, on purpose (runtime/api/libmorph.map says why).
    getpeername@@MORPH_*) continue ;;
    *) echo "not in namespace morph: $s" >&2; bad=1; continue ;;
  esac
  name=${s#morph::}
  # Helpers the public headers' inline code and macros use (status.h's StatusBuilder) live in
  # morph::internal; a build that does not inline them (-O1, sanitizers) exports them.
  name=${name#internal::}
  name=${name%%@@*}
  name=${name%%[(<:]*}
  if [[ $s == morph::operator* ]]; then name=$(echo "$s" | grep -oE 'operator(<<|==)'); fi
  if ! grep -qxF "$name" <<<"$declared"; then
    echo "not declared in include/morph/: $s" >&2
    bad=1
  fi
done <<<"$syms"
[ $bad = 0 ] || fail "libmorph exports symbols outside its public API (above)"
echo "surface_symbols_test: $n symbols, all in the public API of include/morph/"
