#!/usr/bin/env bash
# What the kernel sees of one running proxy: its system calls per second, how long its writes
# and reads take, and who takes its core from it. Figures only; needs perf and root.
#
#   tests/bench/kernel_probe.sh PATTERN [SECONDS]
#
# PATTERN is matched against command lines (pgrep -f) and the first Python process matching
# it is probed for SECONDS (default 2) while a benchmark loads it, e.g. in another shell:
#   .venv/bin/python tests/bench/bench_paced.py --seconds 12 --rounds 1 --streams 100 \
#       --targets dp-default &
#   sleep 5; tests/bench/kernel_probe.sh "from proxy.cli import main" 2
# (bench_paced.py's ht-relay targets match "HttpResponseParser".)
set -euo pipefail
pattern=${1:?usage: kernel_probe.sh PATTERN [SECONDS]}
seconds=${2:-2}
pid=""
for p in $(pgrep -f "$pattern"); do
    if [ "$p" != "$$" ] && readlink "/proc/$p/exe" | grep -q python; then pid=$p; break; fi
done
[ -n "$pid" ] || { echo "no Python process matches: $pattern" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-100)"

echo "== system calls and context switches in ${seconds}s (perf stat)"
perf stat -e 'syscalls:sys_enter_write,syscalls:sys_enter_read,syscalls:sys_enter_epoll_pwait,task-clock,context-switches' \
    -p "$pid" -- sleep "$seconds" 2>&1 | grep -E "syscalls|task-clock|context-switches" || true

echo "== write and read latency, us (perf record of the enter and exit tracepoints)"
perf record -q -e syscalls:sys_enter_write -e syscalls:sys_exit_write \
    -e syscalls:sys_enter_read -e syscalls:sys_exit_read \
    -p "$pid" -o "$out/calls.data" -- sleep "$seconds" > /dev/null 2>&1
perf script -i "$out/calls.data" -F time,event 2> /dev/null | python3 -c '
import statistics, sys
start, took = {}, {"write": [], "read": []}
for line in sys.stdin:
    parts = line.split()
    if len(parts) < 2:
        continue
    at, event = float(parts[0].rstrip(":")), parts[1]
    kind = "write" if "write" in event else "read"
    if "enter" in event:
        start[kind] = at
    elif kind in start:
        took[kind].append((at - start.pop(kind)) * 1e6)
for kind, values in took.items():
    if values:
        values.sort()
        print(f"  {kind}: {len(values)} calls, p50 {values[len(values) // 2]:.1f},"
              f" p90 {values[int(len(values) * 0.9)]:.1f}, mean {statistics.mean(values):.1f}")
'

echo "== what ran next when it lost its core (perf record of sched_switch, all cores)"
perf record -q -e sched:sched_switch -a -o "$out/sched.data" -- sleep "$seconds" > /dev/null 2>&1
perf script -i "$out/sched.data" 2> /dev/null | grep "prev_pid=$pid " | awk '{
    for (i = 1; i <= NF; i++) {
        if ($i ~ /^prev_state=/) state = $i
        if ($i ~ /^next_comm=/) next_comm = $i
    }
    print "  " state, next_comm
}' | sort | uniq -c | sort -rn | head -8
echo "  (prev_state=R: preempted while runnable; S: it slept)"
