"""Sums Nsight Compute's per-launch kernel times by kernel name.

Usage: ncu --metrics gpu__time_duration.sum --csv --print-units base ... > k.csv
       python3 tools/ncu_summary.py k.csv
"""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
agg = collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    if 'Kernel Name' in r and 'Metric Value' in r:
        hdr = r; continue
    if hdr is None or len(r) != len(hdr): continue
    d = dict(zip(hdr, r))
    if d.get('Metric Name') != 'gpu__time_duration.sum': continue
    name = d['Kernel Name'].split('(')[0]
    v = float(d['Metric Value'].replace(',', ''))
    agg[name][0] += 1; agg[name][1] += v
tot = sum(v[1] for v in agg.values())
print(f"total {tot/1e3:.1f} us over {sum(v[0] for v in agg.values())} kernels")
for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"{k:<34} {n:>6} {t/1e3:>10.1f} us {t/n/1e3:>8.2f} us each {100*t/tot:5.1f}%")
