"""Compile misses logged by compile_log/sitecustomize.py, by module and by test file: compile_report.py DIR."""
import json, sys, glob, collections
rows = [json.loads(l) for p in glob.glob(sys.argv[1] + "/*.jsonl") for l in open(p)]
for r in rows:
    r["file"] = (r["test"].split("::")[0] if r["test"] else "(no test) " + r["argv"][:60])
    r["s"] = r["secs"] + 0.5
print("entries", len(rows), "est compile s %.0f" % sum(r["s"] for r in rows))
by_mod = collections.defaultdict(lambda: [0, 0.0])
for r in rows: by_mod[r["module"]][0] += 1; by_mod[r["module"]][1] += r["s"]
print("-- by module"); [print("%5d %7.0f %s" % (v[0], v[1], k)) for k, v in sorted(by_mod.items(), key=lambda kv: -kv[1][1])[:25]]
by_file = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
for r in rows:
    f = by_file[r["file"]]; f[0] += 1; f[1] += r["s"]
    if r["secs"] >= 1: f[2][r["module"]] += 1
print("-- by file"); [print("%5d %7.0f %s %s" % (v[0], v[1], k, dict(v[2].most_common(5)))) for k, v in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:40]]
keys = collections.Counter(r["key"] for r in rows)
dup = [(k, n) for k, n in keys.items() if n > 1]
print("-- duplicate keys (compiled more than once):", len(dup), "extra s %.0f" % sum(r["s"] for r in rows if keys[r["key"]] > 1) )
