#!/usr/bin/env bash
# README's figures, measured: a fresh clone of this repository's HEAD, README's two set-up
# commands as a new user runs them (a new venv; the kernels built from nothing), each timed,
# and the machine they ran on.  The report goes to stdout; commit it under
# benchmarks/results/ and quote it in README with its machine and date.
#
#   bash benchmarks/setup_times.sh > benchmarks/results/$(date +%F)-cpu-setup.txt
#
# Environment: KEEP=1 keeps the clone (its path is printed).  The pip cache is used as on a
# user's machine that installed torch before (the download is not what is measured).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
export TORCH_EXTENSIONS_DIR="$work/torch_extensions"  # nothing built before
export PIP_DISABLE_PIP_VERSION_CHECK=1
git clone -q "$repo" "$work/clone"
cd "$work/clone"

# README's own commands (tests/test_readme.py keeps them the same as README's)
main_job=$(sed -n '/^# the main job/{n;p}' README.md)
tests=$(sed -n '/^# the tests/{n;p}' README.md)

stamp() { date +%s.%N; }
elapsed() { python3 -c "print(f'{$2 - $1:.0f} s')"; }

echo "# README's figures, measured $(date -u '+%F %H:%M UTC') at $(git -C "$repo" rev-parse --short HEAD)"
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, $(lscpu | sed -n 's/^Model name: *//p'),"\
     "$(uptime | sed 's/.*load average/load average/') before the runs"

# The main job, first run: the venv, the install and the kernels it calls built from nothing.
t0=$(stamp)
bash -c "$main_job" > "$work/main1.log" 2>&1
t1=$(stamp)
build_line=$(grep -m1 "built the CPU kernels" "$work/main1.log" || true)
echo "main job, first run (venv and install, the kernels it calls built, training): $(elapsed "$t0" "$t1")"
echo "  $build_line"
# Again, everything in place: the job alone.
t0=$(stamp)
bash -c "$main_job" > "$work/main2.log" 2>&1
t1=$(stamp)
echo "main job, again (the venv and kernels in place): $(elapsed "$t0" "$t1")"
grep "mean train loss" "$work/main2.log" | tail -1 | sed "s/^/  /" || true
# Every kernel, from nothing (what the tests' first run builds, with torch's CUDA roundings).
rm -rf "$TORCH_EXTENSIONS_DIR"
t0=$(stamp)
(. .venv/bin/activate && LIGHTNING_FASTOPT_CUDA_ROUNDINGS=1 python3 -m lightning_fastopt.ops build) > "$work/build.log" 2>&1
t1=$(stamp)
echo "every CPU kernel built from nothing (with Adam in torch's CUDA roundings): $(elapsed "$t0" "$t1")"
# The tests, as README runs them (the kernels built above).
t0=$(stamp)
bash -c "$tests" > "$work/tests.log" 2>&1 || true
t1=$(stamp)
echo "tests (README's command, the venv in place): $(elapsed "$t0" "$t1")"
tail -1 "$work/tests.log" | sed 's/^/  /'
if [ "${KEEP:-0}" = 1 ]; then echo "kept: $work"; else rm -rf "$work"; fi
