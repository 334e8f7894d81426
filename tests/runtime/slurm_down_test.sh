#!/usr/bin/env bash
# ctest slurm_down (the slurm tests' fixture cleanup): stops the private Slurm cluster
# (scripts/slurm-local.sh down) and checks, with pgrep, that none of its daemons, step daemons
# or munge socket is left. Passes trivially (saying so) when the cluster was never up.
#   slurm_down_test.sh path/to/slurm-local.sh
set -uo pipefail
script=$1
state=${MORPH_SLURM_DIR:-/tmp/morph-slurm-$(id -u)}
conf=$state/slurm.conf
if [ ! -d "$state" ]; then
  echo "slurm_down: no cluster under $state (never started, or the slurm tests skipped)"
  exit 0
fi
bash "$script" down || { echo "slurm_down: slurm-local.sh down failed"; exit 1; }

left=""
# The daemons carry the generated slurm.conf on their command line (-f CONF); munged its socket.
for p in $(pgrep -f -- "-f $conf" 2>/dev/null); do left+=" $p($(cat /proc/$p/comm 2>/dev/null))"; done
for p in $(pgrep -f -- "--socket=$state/munge/" 2>/dev/null); do left+=" $p(munged)"; done
# Step daemons and tasks inherit SLURM_CONF from slurmd.
for p in $(pgrep -x slurmstepd 2>/dev/null); do
  if { tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$conf"; then
    left+=" $p(slurmstepd)"
  fi
done
[ -e "$state/munge/munge.socket" ] && left+=" $state/munge/munge.socket"
if [ -n "$left" ]; then
  echo "slurm_down: still there after down:$left"
  exit 1
fi
echo "slurm_down: no slurmd, slurmctld, munged, slurmstepd or socket left"
