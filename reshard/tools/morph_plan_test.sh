#!/usr/bin/env bash
# Runs morph-plan on the example and on bad inputs; checks exit codes and messages.
#   morph_plan_test.sh path/to/morph-plan path/to/examples/plans
set -u
BIN=$1
EX=$2/gpt_16_to_12.json
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fails=0

fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect CODE SUBSTRING FILE [ARGS...]
expect() {
  local code=$1 want=$2 file=$3
  shift 3
  local out rc
  out=$("$BIN" "$@" "$file" 2>&1)
  rc=$?
  [[ $rc == "$code" ]] || fail "$file: exit $rc, want $code; output: ${out:0:400}"
  [[ $out == *"$want"* ]] || fail "$file: output lacks '$want'; got: ${out:0:400}"
}

# The example: bytes moved equal the lower bound and every field is printed.
expect 0 "bytes moved:" "$EX"
out=$("$BIN" "$EX")
lb=$(sed -n 's/^bytes lower bound: *\([0-9]*\).*/\1/p' <<<"$out")
mv=$(sed -n 's/^bytes moved: *\([0-9]*\).*/\1/p' <<<"$out")
[[ -n $lb && $lb == "$mv" && $lb -gt 0 ]] || fail "lower bound '$lb' != moved '$mv'"
for f in "busiest sender:" "busiest receiver:" "busiest link:" "plan time:" "leaving: gpu5 gpu10 gpu14 gpu15"; do
  [[ $out == *"$f"* ]] || fail "summary lacks '$f'"
done
json=$("$BIN" --json "$EX") || fail "--json exit $?"
for f in '"bytes_lower_bound": '"$lb" '"bytes_moved": '"$mv" '"assignment"' '"plans"' '"sends"'; do
  [[ $json == *"$f"* ]] || fail "--json lacks $f"
done

# Bad inputs: each names the JSON path, exit 2.
mk() { sed "$1" "$EX" >"$TMP/$2.json"; }
mk '/"new"/,/}/s/"tp": 2/"tp": 3/' tp3
expect 2 "\$.tensors[0]: tensor 'embed.weight': dimension 0 of size 32000 is not divisible by tp=3 (with \$.new)" "$TMP/tp3.json"
mk '0,/"dp": 4/s//"dpp": 4/' dpp
expect 2 '$.old.dpp: unknown field' "$TMP/dpp.json"
mk '0,/"shape": \[/s//"shape": [-4, /' neg
expect 2 '$.tensors[0].shape[0]: -4 is not in [0,' "$TMP/neg.json"
mk '/"leave"/,/]/s/"gpu10"/"gpu99"/' unknown
expect 2 "\$.workers.leave[1]: 'gpu99' is not in \$.workers.old" "$TMP/unknown.json"
mk 's/"leave": \[/"leave": [ "gpu0",/' toofew
expect 2 '$.new: needs 12 workers but only 11 are available' "$TMP/toofew.json"
mk 's/"dtype": "bf16"/"dtype": "bf17"/' dtype
expect 2 '$.tensors[0].dtype:' "$TMP/dtype.json"
mk '0,/"layer": 0/s//"layer": 0, "layers": [0, 1]/' both
expect 2 '$.tensors[0]: give either "layer" or "layers", not both' "$TMP/both.json"
printf '{"tensors": [' >"$TMP/broken.json"
expect 2 '$: not valid JSON' "$TMP/broken.json"
expect 2 'cannot open' "$TMP/missing.json"
# Issue 7: valid per-tensor sizes whose sum is not: four f64 tensors of 2^30 x 2^29 (2^62 bytes
# each). morph-plan printed "bytes needed: 0" (or a negative total) and exited 0.
cat >"$TMP/overflow.json" <<'JSON'
{"tensors": [
  {"name": "a", "layer": 0, "dtype": "f64", "shape": [1073741824, 536870912]},
  {"name": "b", "layer": 0, "dtype": "f64", "shape": [1073741824, 536870912]},
  {"name": "c", "layer": 0, "dtype": "f64", "shape": [1073741824, 536870912]},
  {"name": "d", "layer": 0, "dtype": "f64", "shape": [1073741824, 536870912]}],
 "old": {"dp": 1, "tp": 1, "pp": 1}, "new": {"dp": 1, "tp": 1, "pp": 1}}
JSON
expect 2 "exceeds the planner's limit of 2^60 bytes" "$TMP/overflow.json"
# (Within that limit replicas can still sum past int64; plan_digest_test covers Summarize.)
# "layers" ranges that together expand past the planner's 2^20 tensors are refused before the
# expansion goes on (each range alone is within 2^20 layers), naming the entry that crosses it.
python3 - "$TMP/manylayers.json" <<'PY'
import json, sys
t = [{"name": "a.{layer}", "layers": [0, 1048575], "dtype": "f32", "shape": [4]},
     {"name": "b.{layer}", "layers": [0, 1], "dtype": "f32", "shape": [4]}]
json.dump({"tensors": t, "old": {"dp": 1, "tp": 1, "pp": 1}, "new": {"dp": 1, "tp": 1, "pp": 1}},
          open(sys.argv[1], "w"))
PY
start=$(date +%s)
expect 2 '$.tensors[1].layers: the model would have more than 1048576 tensors' "$TMP/manylayers.json"
(( $(date +%s) - start < 30 )) || fail "manylayers: took $(( $(date +%s) - start )) s"
# Duplicate keys (nlohmann keeps the last one silently), empty worker names, a directory.
mk '0,/"dtype": "bf16"/s//"dtype": "bf16", "dtype": "f32"/' dupkey
expect 2 '$.tensors[0].dtype: duplicate key' "$TMP/dupkey.json"
mk '0,/"dp": 4/s//"dp": 4, "dp": 2/' dupkey2
expect 2 '$.old.dp: duplicate key' "$TMP/dupkey2.json"
mk '0,/"gpu3"/s//""/' emptyname
expect 2 '$.workers.old[3]: worker name is empty' "$TMP/emptyname.json"
expect 2 'is a directory' "$TMP"
# A dead worker whose ZeRO shard has no replica: data loss, exit 3.
mk 's/"dead": \[\]/"dead": ["gpu1"]/; s/"join": \[\]/"join": ["new0"]/' dead
expect 3 "DATA_LOSS" "$TMP/dead.json"
# ... which --allow-lost reports instead: moved + lost = lower bound.
expect 0 "(no surviving replica: restore from a checkpoint)" "$TMP/dead.json" --allow-lost
out=$("$BIN" --allow-lost "$TMP/dead.json")
lb=$(sed -n 's/^bytes lower bound: *\([0-9]*\).*/\1/p' <<<"$out")
mv=$(sed -n 's/^bytes moved: *\([0-9]*\).*/\1/p' <<<"$out")
ls=$(sed -n 's/^bytes lost: *\([0-9]*\).*/\1/p' <<<"$out")
[[ -n $ls && $ls -gt 0 && $((mv + ls)) == "$lb" ]] || fail "moved $mv + lost $ls != lower bound $lb"
json=$("$BIN" --json --allow-lost "$TMP/dead.json") || fail "--json --allow-lost exit $?"
[[ $json == *'"bytes_lost": '"$ls"* && $json == *'"peer": null'* ]] || fail "--json lacks lost pieces"

# Issue 7 §5: the real-model layouts. A model with each of them plans and moves exactly the lower
# bound; each new field with a bad value is refused naming the field.
cat >"$TMP/layouts.json" <<'JSON'
{"tensors": [
  {"name": "embed", "layer": 0, "also_on_layers": [3], "dtype": "bf16", "shape": [50257, 64],
   "tp_dim": 0, "pad_multiple": 128},
  {"name": "l{layer}.qkv", "layers": [0, 3], "dtype": "bf16", "shape": [384, 64], "tp_dim": 0,
   "tp_blocks": 6},
  {"name": "l{layer}.gate_up", "layers": [0, 3], "dtype": "bf16", "shape": [64, 512],
   "tp_dim": 1, "tp_blocks": 2},
  {"name": "l{layer}.qkv.adam_m", "layers": [0, 3], "dtype": "f32", "shape": [384, 64],
   "tp_dim": 0, "tp_blocks": 6, "zero": true, "zero_group": 2}],
 "old": {"dp": 4, "tp": 4, "pp": 2}, "new": {"dp": 2, "tp": 2, "pp": 4}}
JSON
expect 0 "bytes moved:" "$TMP/layouts.json"
out=$("$BIN" "$TMP/layouts.json")
lb=$(sed -n 's/^bytes lower bound: *\([0-9]*\).*/\1/p' <<<"$out")
mv=$(sed -n 's/^bytes moved: *\([0-9]*\).*/\1/p' <<<"$out")
[[ -n $lb && $lb == "$mv" && $lb -gt 0 ]] || fail "layouts: lower bound '$lb' != moved '$mv'"
L=$TMP/layouts.json
bad() { sed "$1" "$L" >"$TMP/$2.json"; expect 2 "$3" "$TMP/$2.json"; }
bad 's/"tp_blocks": 6}/"tp_blocks": 5}/' blocks5 '$.tensors[1].tp_blocks: 5 blocks do not divide dimension 0 of size 384'
bad 's/"tp_blocks": 2}/"tp_blocks": 0}/' blocks0 '$.tensors[2].tp_blocks: 0 is not in [1,'
bad 's/"tp_dim": 1, "tp_blocks": 2/"tp_blocks": 2/' blocksnodim '$.tensors[2].tp_blocks: needs "tp_dim"'
bad 's/"pad_multiple": 128/"pad_multiple": -1/' padneg '$.tensors[0].pad_multiple: -1 is not in [1,'
bad 's/"tp_dim": 0, "pad_multiple"/"pad_multiple"/' padnodim '$.tensors[0].pad_multiple: needs "tp_dim"'
bad 's/"also_on_layers": \[3\]/"also_on_layers": 3/' alsonum '$.tensors[0].also_on_layers: must be an array'
bad 's/"also_on_layers": \[3\]/"also_on_layers": [-3]/' alsoneg '$.tensors[0].also_on_layers[0]: -3 is not in [0,'
bad 's/"zero": true, "zero_group": 2/"zero_group": 2/' groupnozero '$.tensors[3].zero_group: needs "zero": true'
bad 's/"zero_group": 2/"zero_group": 3/' group3 "\$.tensors[3]: tensor 'l0.qkv.adam_m': zero_group=3 does not divide dp=4"
bad 's/"tp_blocks": 6}/"tp_blocks": 6, "blocks": 2}/' unknownkey '$.tensors[1].blocks: unknown field'
# The block size (384 / 6 = 64) must divide by tp: tp 3 is refused naming tensor and block.
bad '/"new"/s/"tp": 2/"tp": 3/' tp3b "block size 64 of dimension 0 (6 blocks) is not divisible by tp=3 (with \$.new)"

# Issue 24: torch's layouts (DTensor's Shard(d) with torch.chunk sizes, FSDP2's dim-0 Shard(0),
# HSDP). Uneven sizes plan under a tp that divides nothing; moved = lower bound; bad values
# are refused naming the field.
cat >"$TMP/torch.json" <<'JSON'
{"tensors": [
  {"name": "l{layer}.wq", "layers": [0, 3], "dtype": "bf16", "shape": [100, 37], "tp_dim": 0,
   "tp_chunk": true, "dp_chunk": true},
  {"name": "l{layer}.wo", "layers": [0, 3], "dtype": "bf16", "shape": [37, 100], "tp_dim": 1,
   "tp_chunk": true, "dp_chunk": true},
  {"name": "l{layer}.wo.adam_m", "layers": [0, 3], "dtype": "f32", "shape": [37, 100],
   "tp_dim": 1, "tp_chunk": true, "dp_chunk": true, "zero_group": 2},
  {"name": "l{layer}.norm", "layers": [0, 3], "dtype": "f32", "shape": [37], "dp_chunk": true}],
 "old": {"dp": 4, "tp": 3, "pp": 2}, "new": {"dp": 2, "tp": 3, "pp": 1}}
JSON
expect 0 "bytes moved:" "$TMP/torch.json"
out=$("$BIN" "$TMP/torch.json")
lb=$(sed -n 's/^bytes lower bound: *\([0-9]*\).*/\1/p' <<<"$out")
mv=$(sed -n 's/^bytes moved: *\([0-9]*\).*/\1/p' <<<"$out")
[[ -n $lb && $lb == "$mv" && $lb -gt 0 ]] || fail "torch layouts: lower bound '$lb' != moved '$mv'"
T=$TMP/torch.json
tbad() { sed "$1" "$T" >"$TMP/$2.json"; expect 2 "$3" "$TMP/$2.json"; }
tbad 's/"tp_dim": 0,$/"tp_dim": null,/' chunknodim '$.tensors[0].tp_chunk: needs "tp_dim"'
tbad '0,/"tp_chunk": true/s//"tp_chunk": 1/' chunknotbool '$.tensors[0].tp_chunk: must be true or false'
tbad 's/"shape": \[37\], "dp_chunk": true/"shape": [37], "zero": true, "dp_chunk": true/' dpzero \
  '$.tensors[3].dp_chunk: cannot be combined with "zero": true'
tbad 's/"shape": \[37\], "dp_chunk": true/"shape": [], "dp_chunk": true/' dpscalar \
  "\$.tensors[3]: tensor 'l0.norm': dp_chunk (ChunkDP) cuts dimension 0"
tbad 's/"zero_group": 2/"zero_group": 3/' chunkgroup3 \
  "\$.tensors[2]: tensor 'l0.wo.adam_m': zero_group=3 does not divide dp=4 (hybrid ChunkDP"
tbad 's/"dp_chunk": true, "zero_group": 2/"zero_group": 2/' groupnochunk \
  '$.tensors[2].zero_group: needs "zero": true (hybrid ZeRO) or "dp_chunk": true'

# --project: the transfer projected on a topology (reshard/projection.h).
TOPO=$2/topology_h200.json
expect 0 "projection on H200 nodes of 8" "$EX" --project "$TOPO"
out=$("$BIN" --project "$TOPO" "$EX")
for f in "transfer:" "bytes intra-node:" "bytes inter-node:" "stall:" "slowest:"; do
  [[ $out == *"$f"* ]] || fail "projection lacks '$f'"
done
json=$("$BIN" --json --project "$TOPO" "$EX") || fail "--json --project exit $?"
for f in '"projection"' '"transfer_seconds"' '"bytes_inter_node"' '"per_worker"'; do
  [[ $json == *"$f"* ]] || fail "--json --project lacks $f"
done
# All 16 workers of the example on one node: nothing crosses a NIC.
printf '{"gpus_per_node": 16}' >"$TMP/one_node.json"
out=$("$BIN" --project "$TMP/one_node.json" "$EX")
[[ $out == *"bytes inter-node:  0.000 GB"* ]] || fail "one node: inter-node bytes not 0: $out"
printf '{"nic_Gbps": 0}' >"$TMP/bad_topo.json"
expect 2 '$.nic_Gbps: must be > 0' "$EX" --project "$TMP/bad_topo.json"
printf '{"nics": 8}' >"$TMP/bad_topo2.json"
expect 2 '$.nics: unknown field' "$EX" --project "$TMP/bad_topo2.json"

if [[ $fails -gt 0 ]]; then
  echo "$fails failure(s)"
  exit 1
fi
echo "morph_plan_test: all checks passed"
