"""Sums Nsight Compute's per-launch kernel times by kernel name, and
averages any other metrics collected beside them.

Usage: ncu --metrics gpu__time_duration.sum[,...] --csv --print-units base ... > k.csv
       python3 tools/ncu_summary.py k.csv
"""
import collections
import csv
import sys

TIME = 'gpu__time_duration.sum'
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
# (launch id, kernel) -> {metric: value}
launches = collections.OrderedDict()
for r in rows:
    if 'Kernel Name' in r and 'Metric Value' in r:
        hdr = r
        continue
    if hdr is None or len(r) != len(hdr):
        continue
    d = dict(zip(hdr, r))
    try:
        v = float(d['Metric Value'].replace(',', ''))
    except ValueError:
        continue
    key = (d.get('ID', ''), d['Kernel Name'].split('(')[0])
    launches.setdefault(key, {})[d['Metric Name']] = v

others = sorted({m for values in launches.values() for m in values if m != TIME})
agg = collections.defaultdict(lambda: [0, 0.0, collections.defaultdict(float)])
for (_, name), values in launches.items():
    if TIME not in values:
        continue
    a = agg[name]
    a[0] += 1
    a[1] += values[TIME]
    for m in others:
        a[2][m] += values.get(m, 0.0)
tot = sum(v[1] for v in agg.values())
print(f"total {tot/1e3:.1f} us over {sum(v[0] for v in agg.values())} kernels")
print(f"{'kernel':<34} {'launches':>8} {'total':>12} {'each':>11}   share" +
      ''.join(f"  {m}" for m in others))
for k, (n, t, sums) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    extra = ''.join(f"  {sums[m]/n:.4g}" for m in others)
    print(f"{k:<34} {n:>8} {t/1e3:>9.1f} us {t/n/1e3:>8.2f} us {100*t/tot:5.1f}%{extra}")
