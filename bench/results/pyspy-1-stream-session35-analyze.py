import sys, re, collections
def load(path):
    incl = collections.Counter(); threads = collections.Counter(); idle = collections.Counter()
    for line in open(path):
        line = line.rstrip()
        if not line: continue
        stack, n = line.rsplit(" ", 1); n = int(n)
        frames = stack.split(";")
        th = frames[0]
        threads[th] += n
        seen = set()
        for f in frames[1:]:
            name = f.split(" (")[0]
            key = (th[:40], name)
            if key not in seen:
                incl[key] += n; seen.add(key)
    return incl, threads
files = sys.argv[1:]
data = [load(f) for f in files]
for f, (incl, th) in zip(files, data):
    print(f, {k[:40]: v for k, v in th.most_common(6)})
keys = collections.Counter()
for incl, _ in data:
    for k, v in incl.items(): keys[k] += v
print()
for k, _ in keys.most_common(70):
    print(f"{k[0][:28]:28} {k[1][:60]:60}", " ".join(f"{d[0][k]:6d}" for d in data))
