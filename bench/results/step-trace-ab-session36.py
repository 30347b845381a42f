"""Per-request mean engine step and loop gap from a step trace of block-ab-session36.py (policy.mode_arbiter.
step_trace_path): each auto request against the forced requests on either side. usage: python3 THIS TRACE.jsonl"""
import json, statistics as st, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
runs=[];cur=None
for r in rows:
    if r["bs"]==0:
        cur=[None,[]]; runs.append(cur); continue
    if cur is None or r["bs"]!=1: continue
    cur[1].append(r); cur[0]=sum(x["chosen"] for x in cur[1])*2>len(cur[1])
a=[(c, st.mean(x["s"] for x in rs), st.mean(x["gap"] for x in rs if x["gap"] is not None)) for c,rs in runs if len(rs)>20]
print(len(a), "requests")
ratios=[];gr=[]
for i in range(1,len(a)-1):
    if not a[i][0]: continue
    p=[j for j in range(i-1,-1,-1) if not a[j][0]][:1]; n=[j for j in range(i+1,len(a)) if not a[j][0]][:1]
    if not p or not n or n[0]-p[0]>4: continue
    p,n=p[0],n[0]
    ratios.append(a[i][1]/((a[p][1]+a[n][1])/2)); gr.append(a[i][2]/((a[p][2]+a[n][2])/2))
print("auto/off mean step-s ratio (bracketed)", round(st.mean(ratios),4), "+-", round(st.stdev(ratios)/len(ratios)**.5,4), len(ratios))
print("gap ratio", round(st.mean(gr),4), "+-", round(st.stdev(gr)/len(gr)**.5,4))
print("auto step mean", st.mean(x[1] for x in a if x[0]), "off", st.mean(x[1] for x in a if not x[0]))
