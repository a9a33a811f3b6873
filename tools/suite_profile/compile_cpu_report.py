"""Compile calls logged by compile_cpu/sitecustomize.py: totals, by module, by test file, and (with
CPROF_STACK) where the named modules were compiled from. Usage: compile_cpu_report.py DIR [N]."""
import collections
import glob
import json
import sys

rows = [json.loads(line) for p in glob.glob(sys.argv[1] + "/*.jsonl") for line in open(p)]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
misses = [r for r in rows if r["compile_cpu"] > 0]
print(f"calls {len(rows)}  compiles {len(misses)}  processes {len({r['pid'] for r in rows})}  "
      f"compile CPU {sum(r['compile_cpu'] for r in rows):.0f} s  cache-hit calls CPU "
      f"{sum(r['cpu'] for r in rows if not r['compile_cpu']):.0f} s")
by_module = collections.defaultdict(lambda: [0, 0.0])
for r in misses:
    by_module[r["module"]][0] += 1
    by_module[r["module"]][1] += r["compile_cpu"]
print("-- compiles by module: count, CPU s")
for name, (n, s) in sorted(by_module.items(), key=lambda kv: -kv[1][1])[:top]:
    print(f"{n:6d} {s:8.1f}  {name}")
by_file = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
for r in rows:
    f = by_file[r["test"].split("::")[0] or "(no test) " + r["argv"][:60]]
    f[0] += 1
    f[1] += r["cpu"]
    f[2] += r["compile_cpu"] > 0
    f[3] += r["compile_cpu"]
print("-- by test file: calls, their CPU s, compiles, compile CPU s")
for name, (n, s, m, c) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:top]:
    print(f"{n:6d} {s:8.1f} {m:6d} {c:8.1f}  {name}")
stacks = collections.Counter((r["module"], " <- ".join(reversed(r["stack"][-3:]))) for r in rows if "stack" in r)
if stacks:
    print("-- where (CPROF_STACK)")
    for (module, where), n in stacks.most_common(top):
        print(f"{n:6d}  {module}  {where}")
