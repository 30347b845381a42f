"""Session 21: the branching chain model (bench.overlap_bound, as bench.gpu_branches.branch_ms prices it) at alpha 0.7
with session 19's 8B verify costs and sequential int8 step (as session 20's script), and the R-row step costs that
session 21's pins leave (one H200, bench.gpu_split_k --loop-steps 1,4,5,6 --before session20, run 3): as measured,
and session 19's costs scaled by this run's after / before ratio. Session 20's absolute row for comparison.
Run from the repository root: PYTHONPATH=. python3 bench/results/model-branching-session21.py (pure Python)."""
import json
from bench.overlap_bound import PassCosts, best_overlapped, sequential_ms_per_token
r = json.load(open('bench/results/gpu-branches-int8-inplace-h200x2-session19-seeds4-R56.json'))
t_ver = {int(w): t for w, t in r['t_verify_8b_ms'].items()}
t_seq = r['t_draft_ms_sequential_int8']
old = {int(k): v for k, v in r['t_draft_ms_by_rows_int8'].items()}
steps = json.load(open('bench/results/gpu-split-k-loop-steps-session21-h200-run3.json'))['loop_steps']
before = {s['rows']: s['step_ms'] for s in steps if s['variant'].startswith('before')}
after = {s['rows']: s['step_ms'] for s in steps if s['variant'] == 'after (defaults)'}
s20 = {**old, 4: 1.029, 5: 1.041, 6: 1.050}  # session 20's measured (its run 3)
# session 19's costs x session 20's on/off ratio x this run's after/before ratio
s20_ratio = {4: 1.029 / 1.165, 5: 1.041 / 1.179, 6: 1.050 / 1.188}
scaled = {R: old[R] * s20_ratio.get(R, 1.0) * (after[R] / before[R] if R in (4, 5, 6) else 1.0) for R in old}
absolute = {**old, **{R: after[R] for R in (4, 5, 6)}}
print("session 21 run 3 loop steps, before (session 20 pins) / after:",
      {R: (round(before[R], 3), round(after[R], 3)) for R in sorted(after)})
max_k = 6
a = 0.7
seq_ms, seq_k = min((sequential_ms_per_token(a, k, PassCosts(t_verify=t_ver, t_draft=t_seq)), k) for k in range(1, max_k + 1))
print(f"t_verify {t_ver[1]:.3f}/{t_ver[5]:.3f}; seq int8 draft {t_seq:.3f}; best sequential k {seq_k}: {t_ver[1]/seq_ms:.3f}x plain")
for name, rows in (("session-20 absolute", s20), ("s19 x s20 ratio x s21 ratio", scaled), ("session-21 absolute", absolute)):
    for beta in (0.41, 0.52):
        cells = []
        for R in (4, 5, 6):
            ms, k, L = best_overlapped(a, PassCosts(t_verify=t_ver, t_draft=rows[R]), max_k, branch_hit=beta, branch_rows=R - 1)
            cells.append(f"R{R} {rows[R]:.3f}ms k{k} L{L}: {t_ver[1]/ms:.3f}x plain, {seq_ms/ms:.3f}x seq")
        print(f"{name:28} beta {beta}: " + " | ".join(cells))
for R in (5, 6):
    for beta in (0.41,):
        lo, hi = 0.5, 1.3
        for _ in range(30):
            mid = (lo + hi) / 2
            ms = best_overlapped(a, PassCosts(t_verify=t_ver, t_draft=mid), max_k, branch_hit=beta, branch_rows=R - 1)[0]
            (lo, hi) = (mid, hi) if seq_ms / ms >= 1.30 else (lo, mid)
        print(f"R {R} beta {beta}: 1.30x over sequential needs an R-row step <= {lo:.3f} ms")
