"""Per-worker totals and the top test files by CPU from timeline_plugin.py output:

    timeline_report.py DIR [N] [--write-durations tests/file_durations.json]

--write-durations also writes each file's wall seconds (files of 5 s or more): tests/conftest.py
orders the files without slow tests by them, longest first (slow files keep collection order)."""
import json, sys, glob, collections, os
write_to = None
if "--write-durations" in sys.argv:
    i = sys.argv.index("--write-durations")
    write_to = sys.argv[i + 1]
    del sys.argv[i:i + 2]
rows = []
for p in glob.glob(os.path.join(sys.argv[1], "*.jsonl")):
    w = os.path.basename(p)[:-6]
    for l in open(p): r = json.loads(l); r["w"] = w; rows.append(r)
t0 = min(r["t0"] for r in rows)
for w in sorted({r["w"] for r in rows}):
    rs = [r for r in rows if r["w"] == w]
    print(w, "end %.0f" % max(r["t0"] + r["wall"] - t0 for r in rs), "cpu %.0f" % sum(r["cpu"] for r in rs))
files = collections.defaultdict(lambda: [0, 0, 0])
for r in rows:
    f = files[r["id"].split("::")[0]]; f[0] += r["wall"]; f[1] += r["cpu"]; f[2] += 1
print("total cpu %.0f" % sum(v[1] for v in files.values()))
for k, v in sorted(files.items(), key=lambda kv: -kv[1][1])[:int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
    print("%6.0f %6.0f %4d %s" % (v[1], v[0], v[2], k))
if write_to:
    with open(write_to, "w") as f:
        json.dump({k: round(v[0]) for k, v in sorted(files.items(), key=lambda kv: -kv[1][0]) if v[0] >= 5}, f, indent=0)
        f.write("\n")
