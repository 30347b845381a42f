"""Auto's cells by what they ran (session 37): those that drafted in >= 93 % of their steps against forced
'on' in the same round ("same-on"), those that drafted nothing against forced 'off' ("zero-off"), and the
rest (warm-ups, probes) as (streams, drafting share, auto / better fixed).
usage: .venv/bin/python bench/results/cell-classes-session37.py bench/results/load-cpu-runXX.json ..."""
import json,sys,statistics as st
for f in sys.argv[1:]:
  d=json.load(open(f)); cells=d['cells']
  def peer(c,p):
    o=[x for x in cells if x['concurrency']==c['concurrency'] and x['policy']==p and x['round']==c['round']]
    return o[0]['goodput_tok_s'] if o else None
  same=[];zero=[];mixed=[]
  for c in cells:
    if c['policy']!='auto': continue
    share=c['drafts']/max(c['steps'],1) if c['steps'] else 0
    if share>=0.93: same.append(c['goodput_tok_s']/peer(c,'on'))
    elif c['drafts']==0: zero.append(c['goodput_tok_s']/peer(c,'off'))
    else: mixed.append((c['concurrency'],round(share,2),round(c['goodput_tok_s']/max(peer(c,'on'),peer(c,'off')),3)))
  f2=lambda r:(len(r),round(st.mean(r),3),round(st.stdev(r)/len(r)**.5,3)) if len(r)>1 else r
  print(f[-9:-5],'same-on',f2(same),'zero-off',f2(zero)); print('  mixed',mixed)
